"""Where sampling starts: from noise (text-to-image), from a noised image (SDEdit, Meng et al. 2022), or from an
image and a mask (inpainting), each exactly as the matching diffusers pipeline does it for every scheduler.

Each is a frozen value holding the VAE (`vae.VAE`) it encodes with; `images` names the (B, C, H, W) inputs it
takes (for the checks before compiling), `begin(params, inputs, settings, scheduler) -> types.Start`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .types import Start, random_draws


def start_step(num_inference_steps: int, strength: float) -> int:
    """How many steps of the schedule img2img skips (diffusers' `get_timesteps`)."""
    if not 0 < strength <= 1:
        raise ValueError(f"strength must be in (0, 1], got {strength}: 1 repaints everything, small values keep "
                         "the image")
    steps_run = min(int(num_inference_steps * strength), num_inference_steps)
    if steps_run == 0:
        raise ValueError(f"strength={strength} with num_inference_steps={num_inference_steps} runs no denoising "
                         f"step: raise the strength to at least {1 / num_inference_steps:.3g} or the step count")
    return num_inference_steps - steps_run


def _check_fraction(name, value):
    if value is not None and not (isinstance(value, float) and 0 < value < 1):
        raise ValueError(f"{name}={value!r} must be a float in (0, 1): the fraction of the schedule (0.8 hands the "
                         "last 20% of the steps to a refiner)")


def schedule_timesteps(scheduler, steps, start=0) -> np.ndarray:
    """The timesteps of a schedule's evaluations as numpy, also while a caller traces (the schedule is static)."""
    with jax.ensure_compile_time_eval():
        return np.asarray(scheduler.set_timesteps(steps, shape=(1, 1, 1, 1), start=start).timesteps)


def schedule_window(scheduler, settings) -> tuple[int, int | None]:
    """(start, num_evals): the steps of the schedule skipped, and the model evaluations run from there (None: to
    the end), as diffusers' SDXL pipelines cut the schedule.

    `strength` skips the first 1 - strength of the steps (`get_timesteps`). `denoising_start` d instead skips the
    evaluations at timesteps >= round((1 - d) T), a two-evaluation sampler (Heun) keeping whole steps;
    `denoising_end` e stops before the first evaluation at a timestep below round((1 - e) T). A base run with
    denoising_end=e and a refiner run with denoising_start=e split one schedule between two models (Podell et
    al. 2023, §2.5, "ensemble of expert denoisers").
    """
    steps, first, last = settings.num_inference_steps, settings.denoising_start, settings.denoising_end
    _check_fraction("denoising_start", first)
    _check_fraction("denoising_end", last)
    if first is not None and last is not None and first >= last:
        raise ValueError(f"denoising_start={first} must be below denoising_end={last}")
    T = scheduler.config.num_train_timesteps
    if first is None:  # a flow scheduler rounds as SD 3's pipelines do
        start = getattr(scheduler, "img2img_start", start_step)(steps, settings.strength)
        if start >= steps:
            raise ValueError(f"strength={settings.strength} with num_inference_steps={steps} runs no denoising step: "
                             f"raise the strength or the step count")
    else:
        full = schedule_timesteps(scheduler, steps)
        run = int((full < int(round(T - first * T))).sum())
        per_step = len(full) - len(schedule_timesteps(scheduler, steps, 1)) if steps > 1 else 1  # evaluations per step
        if per_step == 2 and run % 2 == 0:
            run += 1  # end after a step's second evaluation, not between its two (as diffusers)
        if run == 0:
            raise ValueError(f"denoising_start={first} leaves no step of {steps}: lower it, or raise "
                             "num_inference_steps")
        start = (len(full) - run) // per_step
    if last is None:
        return start, None
    num_evals = int((schedule_timesteps(scheduler, steps, start) >= int(round(T - last * T))).sum())
    if num_evals == 0:
        raise ValueError(f"denoising_end={last} ends before the first step: raise it, or raise num_inference_steps")
    return start, num_evals


def _given_or_drawn(given, drawn, name):
    if given is None:
        return drawn
    if given.shape != drawn.shape:
        raise ValueError(f"{name} has shape {given.shape}; expected {drawn.shape}")
    return given.astype(jnp.float32)


def _latent_shape(vae, batch, settings):
    return (batch, vae.latent_channels, settings.height // vae.scale_factor, settings.width // vae.scale_factor)


@dataclasses.dataclass(frozen=True)
class FromNoise:
    """Text-to-image: x = σ_init · z, z ~ N(0, I) drawn from the key, or `latents` (unscaled, as diffusers')."""

    vae: Any

    images = ()

    @classmethod
    def build(cls, vae, denoiser) -> "FromNoise":
        return cls(vae)

    def begin(self, params, inputs, settings, scheduler) -> Start:
        batch = (inputs.prompt_ids if inputs.prompt_embeds is None else inputs.prompt_embeds).shape[0]
        # the VAE's latent channels: a denoiser's other input channels are its conditionings' (Flux Control)
        shape = (batch, self.vae.latent_channels, settings.height // self.vae.scale_factor,
                 settings.width // self.vae.scale_factor)
        (drawn,), sampler_key = random_draws(inputs.prng_seed, shape, 1)
        if inputs.latents is not None and inputs.latents.shape != shape:
            raise ValueError(f"latents have shape {inputs.latents.shape}; expected {shape} for a batch of {batch} "
                             f"at {settings.height}x{settings.width}")
        latents = drawn if inputs.latents is None else inputs.latents.astype(jnp.float32)
        # The first σ can depend on the step count (Euler with leading spacing): the state knows it.
        state = scheduler.set_timesteps(settings.num_inference_steps, shape=shape)
        _, num_evals = schedule_window(scheduler, settings)
        return Start(latents * state.init_noise_sigma, state, sampler_key, num_evals=num_evals)


@dataclasses.dataclass(frozen=True)
class FromNoiseBesideImageMask(FromNoise):
    """Text-to-image from noise that takes an image and a mask for an inpainting ControlNet, SD 3.x's (checked,
    sized and sharded as every pipeline's pictures)."""

    images = (("image", 3), ("mask", 1))


@dataclasses.dataclass(frozen=True)
class FromImage:
    """Image-to-image: the image's latents noised to the timestep `strength` picks, then the rest of the schedule.
    With `denoising_start` (a refiner continuing a base run) the latents are not noised, as diffusers."""

    vae: Any

    images = (("image", (3, 4)),)  # RGB, or 4-channel latents

    @classmethod
    def build(cls, vae, denoiser) -> "FromImage":
        return cls(vae)

    def begin(self, params, inputs, settings, scheduler) -> Start:
        start, num_evals = schedule_window(scheduler, settings)
        shape = _latent_shape(self.vae, inputs.image.shape[0], settings)
        (posterior_eps, drawn), sampler_key = random_draws(inputs.prng_seed, shape, 2)
        if self.vae.is_latent_image(inputs.image):
            image_latents = inputs.image.astype(jnp.float32)
        else:
            image_latents = self.vae.encode(params, inputs.image, posterior_eps)
        noise = _given_or_drawn(inputs.noise, drawn, "noise")
        state = scheduler.set_timesteps(settings.num_inference_steps, shape=shape, start=start)
        if settings.denoising_start is not None:
            return Start(image_latents, state, sampler_key, num_evals=num_evals)
        return Start(scheduler.add_noise(state, image_latents, noise, 0), state, sampler_key, num_evals=num_evals)


def is_inpainting_unet(latent_channels: int, unet_channels: int) -> bool:
    """True for a 9-channel inpainting UNet, False for an ordinary one (the known region is pasted back)."""
    if unet_channels not in (latent_channels, 2 * latent_channels + 1):
        raise ValueError(f"the UNet takes {unet_channels} input channels; inpainting needs {latent_channels} (an "
                         f"ordinary UNet) or {2 * latent_channels + 1} (latents, mask and masked image: an "
                         "inpainting UNet)")
    return unet_channels != latent_channels


@dataclasses.dataclass(frozen=True)
class FromImageMask:
    """Inpainting: repaint where the mask is white (>= 0.5), keep the rest, as diffusers' inpainting pipeline.

    Inpainting UNets (`in_channels=9`, `nine`) see [latents, mask, masked image latents] at every step (Rombach
    et al. 2022, §4.5); with an ordinary UNet the known region is pasted back after every step, noised to the next
    step's level (RePaint's simple variant, Lugmayr et al. 2022). Strength 1 starts from pure noise; below 1
    from the image latents noised to the starting timestep, as image-to-image.
    """

    vae: Any
    nine: bool  # a 9-channel inpainting UNet

    images = (("image", 3), ("mask", 1))

    @classmethod
    def build(cls, vae, denoiser) -> "FromImageMask":
        return cls(vae, is_inpainting_unet(vae.latent_channels, denoiser.in_channels))

    def begin(self, params, inputs, settings, scheduler) -> Start:
        strength, steps = settings.strength, settings.num_inference_steps
        start, num_evals = schedule_window(scheduler, settings)
        noised = settings.denoising_start is None  # a refiner's start is not noised
        f = self.vae.scale_factor
        shape = _latent_shape(self.vae, inputs.image.shape[0], settings)
        (image_eps, masked_eps, drawn), sampler_key = random_draws(inputs.prng_seed, shape, 3)
        noise = _given_or_drawn(inputs.noise, drawn, "noise")

        mask = (jnp.asarray(inputs.mask, jnp.float32) >= 0.5).astype(jnp.float32)  # binarised, as diffusers
        image = jnp.asarray(inputs.image, jnp.float32)
        # diffusers encodes the image only where it is needed, in this order: the posterior draws stay aligned.
        needed = strength < 1 or not self.nine or not noised
        image_latents = self.vae.encode(params, image, image_eps) if needed else None
        masked_latents = self.vae.encode(params, image * (mask < 0.5), masked_eps)
        latent_mask = mask[:, :, ::f, ::f]  # nearest-neighbour resize to (h, w), as torch's interpolate

        state = scheduler.set_timesteps(steps, shape=shape, start=start)
        if not noised:
            latents = image_latents
        elif strength == 1:
            latents = noise * state.init_noise_sigma
        else:
            latents = scheduler.add_noise(state, image_latents, noise, 0)
        if self.nine:
            condition = self.condition(mask, latent_mask, masked_latents)
            return Start(latents, state, sampler_key, wrap_unet=functools.partial(with_channels, condition),
                         num_evals=num_evals)
        num_evals_run = state.timesteps.shape[0] if num_evals is None else num_evals
        paste = functools.partial(_paste_known, scheduler, image_latents, noise, latent_mask, num_evals_run)
        return Start(latents, state, sampler_key, post_step=paste, num_evals=num_evals)


    @staticmethod
    def condition(mask, latent_mask, masked_latents):
        """What an inpainting denoiser sees beside the latents: the UNet's [mask, masked image latents]."""
        return jnp.concatenate([latent_mask, masked_latents], axis=1)


def with_channels(condition, unet_fn):
    """A denoiser's input with a condition beside the latents on channels (an inpainting UNet's [latents (scaled by
    the scheduler), mask, masked image latents]; Flux Fill's and Flux Control's); the condition (B, ...) repeated
    for the [unconditional; conditional] batch (2B, ...) under guidance."""

    def with_condition(x, t, context, step, **residuals):
        repeated = jnp.tile(condition, (x.shape[0] // condition.shape[0], 1, 1, 1)).astype(x.dtype)
        return unet_fn(jnp.concatenate([x, repeated], axis=1), t, context, step, **residuals)

    return with_condition


def _paste_known(scheduler, image_latents, noise, latent_mask, num_evals, x, i, state):
    """(1 - m) x_known + m x: the kept region is the image latents noised to the next evaluation's timestep
    (not noised after the last evaluation run)."""
    known = scheduler.add_noise(state, image_latents, noise, jnp.minimum(i + 1, num_evals - 1))
    known = jnp.where(i + 1 < num_evals, known, image_latents)
    return (1 - latent_mask) * known + latent_mask * x
