"""The values a generate call is made of, at the bottom of the pipeline layer (they import no pipeline code).

What may change between calls without recompiling is one pytree, `Inputs`; what fixes the compiled program is one
frozen, hashable value, `Settings`. `Cond` and `Start` are what the text and start pieces hand to the loop,
`Output` what `generate` returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np


def batched(default=None):
    """An `Inputs` field (or a conditioning's inputs' field) with one row per image: split over devices under pmap
    and the sharded path."""
    return flax.struct.field(default=default, metadata={"batched": True})


@flax.struct.dataclass
class Inputs:
    """Every traced input of a generate call; leaves left None are not used. Batched fields lead with the
    batch (B, ...), or (devices, B / devices, ...) under pmap; the rest are shared by all images."""

    prompt_ids: Any = batched()  # (B, 77) for SD, (B, 2, 77) for SDXL (one row per tokenizer)
    neg_prompt_ids: Any = batched()  # as prompt_ids; None: the empty prompt (SDXL: zeros, if its config says)
    # A1111's token weights, float32 as the ids (of k chunks of 77: (B, 77 k), SDXL (B, 2, 77 k)); None: plain
    prompt_weights: Any = batched()
    neg_prompt_weights: Any = batched()
    # (B,) bool: the rows given no negative prompt, for SDXL's default there (zeros if its config says); SDXL
    # pipelines fill it in beside placeholder neg_prompt_ids, so that calls with and without one share a program
    no_negative_prompt: Any = batched()
    prompt_embeds: Any = batched()  # (B, 77, D): text states that replace prompt_ids' encoding
    neg_prompt_embeds: Any = batched()
    pooled_prompt_embeds: Any = batched()  # SDXL: (B, P), the second encoder's projected pooled output
    neg_pooled_prompt_embeds: Any = batched()
    latents: Any = batched()  # (B, C, h, w) standard-normal start noise of text-to-image (unscaled)
    noise: Any = batched()  # (B, C, h, w) standard-normal noise added to an image's latents
    image: Any = batched()  # (B, 3, H, W) in [-1, 1]
    mask: Any = batched()  # (B, 1, H, W), >= 0.5 repainted
    prng_seed: Any = batched()  # one key, or one key per image (B,); under pmap one per device or per image
    guidance_scale: Any = 7.5
    guidance_rescale: Any = 0.0
    embedded_guidance: Any = None  # a guidance-distilled denoiser's guidance input (Flux.1 dev's guidance_scale)
    # SDXL's micro-conditioning, (h, w) / (top, left) pairs; None: (height, width), (0, 0), (height, width)
    original_size: Any = None
    crops_coords_top_left: Any = None
    target_size: Any = None
    # SDXL refiner (requires_aesthetics_score): the scores that replace target_size in the time ids of the
    # conditional and the unconditional rows; None: diffusers' 6.0 and 2.5
    aesthetic_score: Any = None
    negative_aesthetic_score: Any = None
    # the conditionings' own inputs by their key (ControlNet's control images and scales, an adapter's pictures):
    # each a flax.struct dataclass whose per-image fields are `batched()`, as here (`Conditioning.call_inputs`)
    conditions: Any = None
    # sdflax.hooks: a tuple of hooks (Pipeline.with_hooks); their numbers are traced, the rest is the pytree's
    # structure, on which jit keys its programs as on Settings
    hooks: Any = None

    def prompts(self):
        """prompt_ids, or prompt_embeds where no ids are given: the array the batch is counted on."""
        return self.prompt_ids if self.prompt_ids is not None else self.prompt_embeds

    def condition(self, key):
        """A conditioning's inputs (None where the call has none)."""
        return (self.conditions or {}).get(key)

    @classmethod
    def shared_fields(cls) -> tuple[str, ...]:
        """The numbers every image shares (scales, sizes)."""
        return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("batched")
                     and f.name not in ("conditions", "hooks"))


def float32_array(x):
    """A picture as float32 numpy, or as the jax array it is (a caller's, already placed or traced)."""
    return x if isinstance(x, jax.Array) else np.asarray(x, np.float32)


def by_field(inputs, batched_value, shared_value):
    """A pytree prefix of `inputs` (an `Inputs`, or a conditioning's inputs): `batched_value` for its per-image
    fields, `shared_value` for the rest, the conditionings' fields alike: pmap's and shard_map's axes."""
    values = {}
    for field in dataclasses.fields(inputs):
        value = getattr(inputs, field.name)
        if field.name == "conditions" and value is not None:
            values[field.name] = {key: by_field(c, batched_value, shared_value) for key, c in value.items()}
        else:
            values[field.name] = batched_value if field.metadata.get("batched") else shared_value
    return inputs.replace(**values)


def map_batched(inputs, fn, skip=()):
    """`inputs` with `fn` applied to every array of its per-image fields, the conditionings' too (but `skip`)."""
    values = {}
    for field in dataclasses.fields(inputs):
        value = getattr(inputs, field.name)
        if field.name == "conditions" and value is not None:
            values[field.name] = {key: map_batched(c, fn) for key, c in value.items()}
        elif field.metadata.get("batched") and field.name not in skip:
            values[field.name] = jax.tree.map(fn, value)
    return inputs.replace(**values)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that fixes the compiled program; one compile per distinct value. Functions are compared by
    identity: reuse the same `guidance` and `callback` objects."""

    num_inference_steps: int = 50
    height: int | None = None  # None: the UNet's sample size, or the image's
    width: int | None = None
    strength: float = 1.0  # image pipelines: how much of the schedule runs (1: all of it)
    # SDXL's base -> refiner hand-off: the fraction of the schedule (of the training timesteps) after which the
    # base stops, and from which the refiner continues (it then ignores strength and adds no noise)
    denoising_start: float | None = None
    denoising_end: float | None = None
    output_type: str = "np"  # "latent": return the latents undecoded (B, C, h, w), for a refiner
    guidance: Callable | None = None  # guidance(uncond, cond, scale) -> prediction; None: CFG with the rescale
    callback: Callable | None = None  # callback(step, num_steps, latents) on the host after every evaluation
    return_trajectory: bool = False
    guess_mode: bool = False  # ControlNet: the nets see only the conditional batch
    # False: no classifier-free guidance, the UNet runs on the conditional batch only (half the work), as diffusers
    # does for guidance_scale <= 1 (turbo and LCM models); the pipelines turn it off for such a scale
    classifier_free_guidance: bool = True
    # A schedule in place of the scheduler's spacing (diffusers' `timesteps=` / `sigmas=`; `with_schedule`): tuples
    # of floats; num_inference_steps is their step count
    timesteps: tuple | None = None
    sigmas: tuple | None = None
    # the image's tokens, where the denoiser's schedule depends on them (SD 3's dynamic shift; `denoisers`)
    image_seq_len: int | None = None
    # SD 3.5's skip-layer guidance: the transformer blocks its extra pass skips (None: none)
    skip_guidance_layers: tuple | None = None
    clip_skip: int | None = None  # SD and SDXL: diffusers' clip_skip, the text encoders' last layers skipped

    def scheduler(self, scheduler):
        """`scheduler` running these settings' schedule (at these settings' image size, where it shifts by it)."""
        if self.timesteps or self.sigmas:
            scheduler = scheduler.with_schedule(self.timesteps, self.sigmas)
        if self.image_seq_len is not None and hasattr(scheduler, "for_image_seq_len"):
            scheduler = scheduler.for_image_seq_len(self.image_seq_len)
        return scheduler


class Cond(NamedTuple):
    """What the text conditioning gives the denoiser, for the [unconditional; conditional] batch (2B, ...)."""

    context: Any  # (2B, T, D) text states
    unet_kwargs: dict  # extra denoiser inputs, e.g. SDXL's text_embeds and time_ids, SD 3's pooled_projections

    def conditional(self) -> "Cond":
        """The conditional half (B, ...). What only the other half needed (the negative prompt's encoding) is
        then dead code, which XLA removes."""
        half = lambda x: jnp.split(x, 2)[1]  # noqa: E731
        return Cond(half(self.context), {name: half(v) for name, v in self.unet_kwargs.items()})


class Start(NamedTuple):
    """Where sampling begins, and how the UNet and the loop are changed for it."""

    latents: Any  # x at the first evaluation, already scaled as the scheduler expects
    state: Any  # the scheduler state to begin from (part-way through the schedule for img2img)
    sampler_key: Any  # the key of the scheduler's own noise (ancestral samplers)
    wrap_unet: Callable | None = None  # unet_fn -> unet_fn (an inpainting UNet's extra channels)
    # (a UNet function is unet_fn(x, t, context, step, **residuals): step is the evaluation index, residuals the
    # UNet's extra keyword inputs, e.g. ControlNet's down_block_additional_residuals)
    post_step: Callable | None = None  # post_step(x, i, state) -> x (an ordinary UNet's inpainting paste)
    num_evals: int | None = None  # static: the evaluations run from `state` (None: to the end; denoising_end)


class Output(NamedTuple):
    """What `generate` returns: images (B, H, W, 3) in [0, 1] (with output_type="latent" the latents
    (B, C, h, w)), and with `return_trajectory` a Trajectory."""

    images: Any
    trajectory: Any = None


def random_draws(prng_seed, shape, count):
    """`count` standard-normal arrays of `shape` (B, ...) and the sampler's key, from one PRNG key, or from one key
    per image (B,), image b then drawing exactly what a batch of one with key b draws (diffusers' list of
    generators). The sampler's key is then one per image too: samplers that add noise at every step draw image
    b's from key b (`schedulers.common.step_noise`), so image b does not depend on the batch it is made in.

    This is how every pipeline turns its key into noise, so image n of a seed list can be made alone.
    """
    typed = jnp.issubdtype(prng_seed.dtype, jax.dtypes.prng_key)
    if prng_seed.ndim == (0 if typed else 1):
        keys = jax.random.split(prng_seed, count + 1)
        return [jax.random.normal(keys[j], shape, jnp.float32) for j in range(count)], keys[count]
    if prng_seed.shape[0] != shape[0]:
        raise ValueError(f"{prng_seed.shape[0]} PRNG keys for a batch of {shape[0]}: give one key, or one per image")
    keys = jax.vmap(lambda k: jax.random.split(k, count + 1))(prng_seed)  # (B, count + 1)
    one = (1, *shape[1:])
    draws = [jax.vmap(lambda k: jax.random.normal(k, one, jnp.float32))(keys[:, j]).reshape(shape)
             for j in range(count)]
    return draws, keys[:, count]


@dataclasses.dataclass(frozen=True)
class Spec:
    """The pieces one pipeline runs, a frozen, hashable value: `generate`'s static first argument (one compile per
    distinct spec, as per Settings). Each piece holds the models it runs; the weights are in `params`."""

    text: Any  # text.SDText / text.SDXLText / sd3_text.SD3Text: ids -> Cond
    start: Any  # starts.FromNoise / FromImage / FromImageMask: -> Start
    denoiser: Any  # denoisers.UNetDenoiser / MMDiTDenoiser
    vae: Any  # vae.VAE: decodes the result
    scheduler: Any
    wrappers: tuple = ()  # UNet wrappers (IPAdapter, T2IAdapters, ControlNet), the first listed innermost
