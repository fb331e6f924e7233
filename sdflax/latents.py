"""Where sampling starts: from noise (text-to-image), from a noised image (SDEdit, Meng et al. 2022), or from an
image and a mask (inpainting), each exactly as the matching diffusers pipeline does it for every scheduler.

Each is a small class of static functions that `generate` calls: `images` names the (B, C, H, W) inputs it takes
(for the checks before compiling), `begin(pipeline, params, inputs, settings) -> generate.Start`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from .generate import Start, random_draws


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


def latent_shape(pipeline, batch, height, width):
    f = pipeline.vae_scale_factor
    return (batch, pipeline.vae.config.latent_channels, height // f, width // f)


def _given_or_drawn(given, drawn, name):
    if given is None:
        return drawn
    if given.shape != drawn.shape:
        raise ValueError(f"{name} has shape {given.shape}; expected {drawn.shape}")
    return given.astype(jnp.float32)


def encode_image(pipeline, params, image, eps):
    """Latents of `image` (B, 3, H, W) in [-1, 1]: a posterior sample mean + std * eps, scaled as the UNet
    sees them (diffusers' `latent_dist.sample(generator) * scaling_factor`)."""
    posterior = pipeline.vae.apply(params["vae"], jnp.asarray(image, pipeline.dtype), method="encode")
    latents = posterior.mean + posterior.std * eps
    return latents.astype(jnp.float32) * pipeline.vae.config.scaling_factor


class FromNoise:
    """Text-to-image: x = σ_init · z, z ~ N(0, I) drawn from the key, or `latents` (unscaled, as diffusers')."""

    images = ()

    @staticmethod
    def begin(pipeline, params, inputs, settings) -> Start:
        batch = (inputs.prompt_ids if inputs.prompt_embeds is None else inputs.prompt_embeds).shape[0]
        shape = (batch, pipeline.unet.config.in_channels, settings.height // pipeline.vae_scale_factor,
                 settings.width // pipeline.vae_scale_factor)
        (drawn,), sampler_key = random_draws(inputs.prng_seed, shape, 1)
        if inputs.latents is not None and inputs.latents.shape != shape:
            raise ValueError(f"latents have shape {inputs.latents.shape}; expected {shape} for a batch of {batch} "
                             f"at {settings.height}x{settings.width}")
        latents = drawn if inputs.latents is None else inputs.latents.astype(jnp.float32)
        # The first σ can depend on the step count (Euler with leading spacing): the state knows it.
        state = pipeline.scheduler.set_timesteps(settings.num_inference_steps, shape=shape)
        return Start(latents * state.init_noise_sigma, state, sampler_key)


class FromImage:
    """Image-to-image: the image's latents noised to the timestep `strength` picks, then the rest of the schedule."""

    images = (("image", 3),)

    @staticmethod
    def begin(pipeline, params, inputs, settings) -> Start:
        start = start_step(settings.num_inference_steps, settings.strength)
        shape = latent_shape(pipeline, inputs.image.shape[0], settings.height, settings.width)
        (posterior_eps, drawn), sampler_key = random_draws(inputs.prng_seed, shape, 2)
        image_latents = encode_image(pipeline, params, inputs.image, posterior_eps)
        noise = _given_or_drawn(inputs.noise, drawn, "noise")
        state = pipeline.scheduler.set_timesteps(settings.num_inference_steps, shape=shape, start=start)
        return Start(pipeline.scheduler.add_noise(state, image_latents, noise, 0), state, sampler_key)


def is_inpainting_unet(pipeline) -> bool:
    """True for a 9-channel inpainting UNet, False for an ordinary one (the known region is pasted back)."""
    latent, given = pipeline.vae.config.latent_channels, pipeline.unet.config.in_channels
    if given not in (latent, 2 * latent + 1):
        raise ValueError(f"the UNet takes {given} input channels; inpainting needs {latent} (an ordinary UNet) "
                         f"or {2 * latent + 1} (latents, mask and masked image: an inpainting UNet)")
    return given != latent


class FromImageMask:
    """Inpainting: repaint where the mask is white (>= 0.5), keep the rest, as diffusers' inpainting pipeline.

    Inpainting UNets (`in_channels=9`) see [latents, mask, masked image latents] at every step (Rombach et al.
    2022, §4.5); with an ordinary UNet the known region is pasted back after every step, noised to the next
    step's level (RePaint's simple variant, Lugmayr et al. 2022). Strength 1 starts from pure noise; below 1
    from the image latents noised to the starting timestep, as image-to-image.
    """

    images = (("image", 3), ("mask", 1))

    @staticmethod
    def begin(pipeline, params, inputs, settings) -> Start:
        strength, steps = settings.strength, settings.num_inference_steps
        start = start_step(steps, strength)
        nine = is_inpainting_unet(pipeline)
        f = pipeline.vae_scale_factor
        shape = latent_shape(pipeline, inputs.image.shape[0], settings.height, settings.width)
        (image_eps, masked_eps, drawn), sampler_key = random_draws(inputs.prng_seed, shape, 3)
        noise = _given_or_drawn(inputs.noise, drawn, "noise")

        mask = (jnp.asarray(inputs.mask, jnp.float32) >= 0.5).astype(jnp.float32)  # binarised, as diffusers
        image = jnp.asarray(inputs.image, jnp.float32)
        # diffusers encodes the image only where it is needed, in this order: the posterior draws stay aligned.
        image_latents = encode_image(pipeline, params, image, image_eps) if strength < 1 or not nine else None
        masked_latents = encode_image(pipeline, params, image * (mask < 0.5), masked_eps)
        latent_mask = mask[:, :, ::f, ::f]  # nearest-neighbour resize to (h, w), as torch's interpolate

        scheduler = pipeline.scheduler
        state = scheduler.set_timesteps(steps, shape=shape, start=start)
        if strength == 1:
            latents = noise * state.init_noise_sigma
        else:
            latents = scheduler.add_noise(state, image_latents, noise, 0)
        if nine:
            condition = jnp.concatenate([latent_mask, masked_latents], axis=1)
            return Start(latents, state, sampler_key, wrap_unet=functools.partial(_with_channels, condition))
        paste = functools.partial(_paste_known, scheduler, image_latents, noise, latent_mask)
        return Start(latents, state, sampler_key, post_step=paste)


def _with_channels(condition, unet_fn):
    """An inpainting UNet's input: [latents (scaled by the scheduler), mask, masked image latents] on channels;
    the condition (B, ...) repeated for the [unconditional; conditional] batch (2B, ...) under guidance."""

    def with_channels(x, t, context, step, **residuals):
        repeated = jnp.tile(condition, (x.shape[0] // condition.shape[0], 1, 1, 1)).astype(x.dtype)
        return unet_fn(jnp.concatenate([x, repeated], axis=1), t, context, step, **residuals)

    return with_channels


def _paste_known(scheduler, image_latents, noise, latent_mask, x, i, state):
    """(1 - m) x_known + m x: the kept region is the image latents noised to the next evaluation's timestep
    (not noised after the last)."""
    num_evals = state.timesteps.shape[0]
    known = scheduler.add_noise(state, image_latents, noise, jnp.minimum(i + 1, num_evals - 1))
    known = jnp.where(i + 1 < num_evals, known, image_latents)
    return (1 - latent_mask) * known + latent_mask * x
