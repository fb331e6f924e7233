"""StableDiffusionXL: SDXL text-to-image (Podell et al. 2023) on StableDiffusion's compiled loop.

What diffusers' `StableDiffusionXLPipeline` adds to SD: two text encoders (the penultimate layer of each,
concatenated; the second's projected pooled output conditions the UNet too), size and crop micro-conditioning
(`time_ids`), zero negative embeddings when no negative prompt is given (`force_zeros_for_empty_prompt`), and
a VAE that decodes in float32 (`force_upcast`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .models import AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, UNet2DConditionModel
from .pipeline import StableDiffusion, StableDiffusionOutput, device_count_of


class StableDiffusionXL(StableDiffusion):
    """`from_pretrained` as StableDiffusion; params `{"text_encoder", "text_encoder_2", "unet", "vae"}`.

    `prepare_inputs(prompts)` gives (B, 2, 77) ids (one row per tokenizer). `__call__` and `_generate` take the
    arguments of diffusers' Flax SDXL pipeline (`guidance_scale` before `height`, `width`), plus
    `guidance_rescale` and the size conditioning `original_size`, `crops_coords_top_left`, `target_size`
    ((h, w) pairs, default (height, width), (0, 0), (height, width)), all traced: changing them never recompiles.
    """

    MODELS = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection,
              "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    TOKENIZERS = ("tokenizer", "tokenizer_2")
    INDEX_OPTIONS = ("force_zeros_for_empty_prompt",)

    def __init__(self, text_encoder, text_encoder_2, unet, vae, tokenizer, tokenizer_2, scheduler, dtype=jnp.float32,
                 force_zeros_for_empty_prompt=True):
        if unet.config.addition_embed_type != "text_time":
            raise ValueError("StableDiffusionXL needs an SDXL UNet (addition_embed_type='text_time'); this one has "
                             f"{unet.config.addition_embed_type!r}: use StableDiffusion")
        self.text_encoder_2, self.tokenizer_2 = text_encoder_2, tokenizer_2
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
        super().__init__(text_encoder, unet, vae, tokenizer, scheduler, dtype)

    @property
    def force_zeros_for_empty_prompt(self):
        return self._force_zeros_for_empty_prompt

    @force_zeros_for_empty_prompt.setter
    def force_zeros_for_empty_prompt(self, value):
        # Compiled programs baked the old choice in: drop them, as setting the scheduler does.
        self._force_zeros_for_empty_prompt = bool(value)
        for name in ("_jitted", "_pmapped", "_sharded"):
            self.__dict__.pop(name, None)

    @classmethod
    def from_single_file(cls, *args, **kwargs):
        raise NotImplementedError("SDXL single-file checkpoints are not supported yet: use a diffusers folder or "
                                  "hub id with StableDiffusionXL.from_pretrained")

    def load_lora(self, params, path, scale=1.0):
        raise NotImplementedError("LoRA for SDXL (two text encoders) is not supported yet")

    def load_textual_inversion(self, params, path, token=None):
        raise NotImplementedError("textual inversion for SDXL (two text encoders) is not supported yet")

    # ---- inputs -------------------------------------------------------------------------------------------
    def prepare_inputs(self, prompts) -> np.ndarray:
        """Token ids (B, 2, 77) int32: each tokenizer's, padded and truncated as diffusers does (the second
        pads with its own pad token, "!" in SDXL)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [tokenizer(prompts, padding="max_length", max_length=self.max_length, truncation=True,
                         return_tensors="np").input_ids for tokenizer in (self.tokenizer, self.tokenizer_2)]
        return np.stack(ids, axis=1).astype(np.int32)

    def _check_ids(self, prompt_ids, neg_prompt_ids, leading_dims):
        shape = (2, self.max_length)
        for name, ids in (("prompt_ids", prompt_ids), ("neg_prompt_ids", neg_prompt_ids)):
            if ids is not None and (ids.ndim != leading_dims + 2 or tuple(ids.shape[-2:]) != shape):
                expected = "(devices, batch, " if leading_dims == 2 else "(batch, "
                raise ValueError(f"{name} has shape {ids.shape}; expected {expected}2, {self.max_length}) (ids of "
                                 "both tokenizers): make it with pipeline.prepare_inputs(prompts)"
                                 + (" and shard()" if leading_dims == 2 else ""))
        if neg_prompt_ids is not None and neg_prompt_ids.shape != prompt_ids.shape:
            raise ValueError(f"neg_prompt_ids {neg_prompt_ids.shape} and prompt_ids {prompt_ids.shape} differ: "
                             "give one negative prompt per prompt")

    # ---- generation ---------------------------------------------------------------------------------------
    def encode_prompt(self, params, prompt_ids):
        """(B, 2, 77) ids -> (text states (B, 77, D1 + D2), pooled (B, P)): both encoders' penultimate layer,
        concatenated, and the second's projected pooled output, as diffusers' SDXL does (clip_skip None)."""
        first = self.text_encoder.apply(params["text_encoder"], prompt_ids[:, 0], output_hidden_states=True)
        second = self.text_encoder_2.apply(params["text_encoder_2"], prompt_ids[:, 1], output_hidden_states=True)
        return jnp.concatenate([first.hidden_states[-2], second.hidden_states[-2]], axis=-1), second.text_embeds

    @staticmethod
    def _size_conditioning(height, width, original_size=None, crops_coords_top_left=(0, 0), target_size=None):
        """original (h, w), crop (top, left), target (h, w) as float32 arrays, sizes defaulting to (height, width).
        (Filled in before the compiled call too, so that other values reuse the same program.)"""
        sizes = ((height, width) if original_size is None else original_size, crops_coords_top_left,
                 (height, width) if target_size is None else target_size)
        return [jnp.asarray(v, jnp.float32) for v in sizes]

    def time_ids(self, height, width, original_size=None, crops_coords_top_left=(0, 0), target_size=None):
        """SDXL's micro-conditioning (6,): original (h, w), crop (top, left), target (h, w)."""
        sizes = self._size_conditioning(height, width, original_size, crops_coords_top_left, target_size)
        return jnp.concatenate([v.reshape(-1) for v in sizes])

    def decode_latents(self, params, latents):
        """As StableDiffusion's, but in float32 when the VAE's config says `force_upcast` (SDXL's VAE overflows
        in half precision): the params and the latents are cast inside the program."""
        if not self.vae.config.force_upcast or jnp.dtype(self.vae.dtype) == jnp.float32:
            return super().decode_latents(params, latents)
        vae_params = jax.tree.map(lambda p: p.astype(jnp.float32), params["vae"])
        images = self.vae.clone(dtype=jnp.float32).apply(
            vae_params, latents.astype(jnp.float32) / self.vae.config.scaling_factor, method="decode")
        return jnp.transpose(jnp.clip(images / 2 + 0.5, 0, 1), (0, 2, 3, 1))

    def _generate(self, prompt_ids, params, prng_seed, num_inference_steps=50, guidance_scale=5.0, height=None,
                  width=None, latents=None, neg_prompt_ids=None, guidance_rescale=0.0, original_size=None,
                  crops_coords_top_left=(0, 0), target_size=None, callback=None, guidance=None,
                  return_trajectory=False):
        """The whole text -> images computation as a pure function; (B, H, W, 3) in [0, 1].

        `prompt_ids`, `neg_prompt_ids`: (B, 2, 77) from `prepare_inputs`. Without `neg_prompt_ids` the
        unconditional embeddings are zeros if the checkpoint says `force_zeros_for_empty_prompt`, else those of
        the empty prompt. The rest as `StableDiffusion._generate`.
        """
        height, width = self._sizes(height, width)
        context, pooled = self.encode_prompt(params, prompt_ids)
        if neg_prompt_ids is None and self.force_zeros_for_empty_prompt:
            neg_context, neg_pooled = jnp.zeros_like(context), jnp.zeros_like(pooled)
        else:
            neg = self._empty_prompt_ids if neg_prompt_ids is None else neg_prompt_ids
            neg_context, neg_pooled = self.encode_prompt(params, neg)
            neg_context = jnp.broadcast_to(neg_context, context.shape)
            neg_pooled = jnp.broadcast_to(neg_pooled, pooled.shape)
        time_ids = self.time_ids(height, width, original_size, crops_coords_top_left, target_size)
        # diffusers uses the same time ids for the unconditional rows (no negative_original_size).
        unet_kwargs = {"text_embeds": jnp.concatenate([neg_pooled, pooled]),
                       "time_ids": jnp.broadcast_to(time_ids, (2 * context.shape[0], time_ids.shape[0]))}
        return super()._generate(None, params, prng_seed, num_inference_steps, height, width, guidance_scale, latents,
                                 callback=callback, guidance_rescale=guidance_rescale, guidance=guidance,
                                 return_trajectory=return_trajectory, prompt_embeds=context,
                                 neg_prompt_embeds=neg_context, unet_kwargs=unet_kwargs)

    # _generate's arguments as (name, how pmap maps it): 0 = split over devices, None = broadcast, "static".
    _GENERATE_ARGS = (("prompt_ids", 0), ("params", 0), ("prng_seed", 0), ("num_inference_steps", "static"),
                      ("guidance_scale", 0), ("height", "static"), ("width", "static"), ("latents", 0),
                      ("neg_prompt_ids", 0), ("guidance_rescale", 0), ("original_size", None),
                      ("crops_coords_top_left", None), ("target_size", None), ("callback", "static"),
                      ("guidance", "static"), ("return_trajectory", "static"))
    _STATIC = tuple(name for name, axis in _GENERATE_ARGS if axis == "static")

    def __call__(self, prompt_ids, params, prng_seed, num_inference_steps=50, guidance_scale=5.0, height=None,
                 width=None, latents=None, neg_prompt_ids=None, guidance_rescale=0.0, original_size=None,
                 crops_coords_top_left=(0, 0), target_size=None, jit=False, callback=None, guidance=None,
                 return_trajectory=False):
        """Generate images (B, H, W, 3); with `jit=True` under `jax.pmap`, inputs sharded (`sdflax.shard`) and
        params replicated (`sdflax.replicate`): (devices, B, H, W, 3)."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be at least 1, got {num_inference_steps}")
        height, width = self._sizes(height, width)
        self._check_ids(prompt_ids, neg_prompt_ids, 2 if jit else 1)
        scalars = jnp.asarray(guidance_scale, jnp.float32), jnp.asarray(guidance_rescale, jnp.float32)
        sizes = self._size_conditioning(height, width, original_size, crops_coords_top_left, target_size)
        if jit:
            devices = device_count_of(prompt_ids)
            scalars = [jnp.broadcast_to(s, (devices,)) for s in scalars]
            run = self._pmapped
        else:
            run = self._jitted
        out = run(prompt_ids, params, prng_seed, num_inference_steps, scalars[0], height, width, latents,
                  neg_prompt_ids, scalars[1], *sizes, callback, guidance, return_trajectory)
        return StableDiffusionOutput.of(out, return_trajectory)

    def generate_sharded(self, prompt_ids, params, prng_seed, num_inference_steps=50, guidance_scale=5.0,
                         height=None, width=None, latents=None, neg_prompt_ids=None, guidance_rescale=0.0,
                         original_size=None, crops_coords_top_left=(0, 0), target_size=None, mesh=None):
        """The `jit` + `NamedSharding` path, as `StableDiffusion.generate_sharded`: the batch (B, 2, 77) is split
        over a one-axis device mesh, one key per device; the images equal the pmap path's. (B, H, W, 3)."""
        from .parallel import replicate_on, shard_batch

        mesh, height, width = self._sharded_checks(prompt_ids, neg_prompt_ids, prng_seed, height, width, mesh)
        batched = shard_batch({"prompt_ids": prompt_ids, "latents": latents, "neg_prompt_ids": neg_prompt_ids}, mesh)
        sizes = self._size_conditioning(height, width, original_size, crops_coords_top_left, target_size)
        shared = {"guidance_scale": jnp.asarray(guidance_scale, jnp.float32),
                  "guidance_rescale": jnp.asarray(guidance_rescale, jnp.float32),
                  **dict(zip(("original_size", "crops_coords_top_left", "target_size"), sizes))}
        images = self._sharded(batched, replicate_on(params, mesh), shard_batch(prng_seed, mesh), shared,
                               num_inference_steps, height, width)
        return np.asarray(images)

    @functools.cached_property
    def _sharded(self):
        def generate(batched, params, keys, shared, steps, height, width):
            devices = keys.shape[0]
            per_device = jax.tree.map(lambda x: x.reshape(devices, -1, *x.shape[1:]), batched)
            one = lambda inputs, key: self._generate(params=params, prng_seed=key, num_inference_steps=steps,  # noqa
                                                     height=height, width=width, **inputs, **shared)
            images = jax.vmap(one)(per_device, keys)
            return images.reshape(-1, *images.shape[2:])

        return jax.jit(generate, static_argnums=(4, 5, 6))
