"""The VAE as the pipelines use it: images in [-1, 1] to scaled latents, and back to images in [0, 1]."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


# The dtypes a `force_upcast` VAE leaves for float32, to encode and to decode (`VAE`).
UPCAST_TO_ENCODE = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
UPCAST_TO_DECODE = (jnp.dtype(jnp.float16),)


@dataclasses.dataclass(frozen=True)
class VAE:
    """`vae` and whether it runs in float32 in a half-precision program (SDXL's `force_upcast`: its VAE overflows in
    float16). As diffusers' SDXL pipelines: an image is encoded in float32 whatever the VAE's dtype (img2img's
    `prepare_latents`), latents are decoded in float32 only from float16 (`needs_upcasting`); bfloat16, with
    float32's range, decodes in bfloat16."""

    vae: Any
    in_float32: bool = False

    @property
    def scale_factor(self) -> int:
        return self.vae.config.scale_factor

    @property
    def latent_channels(self) -> int:
        return self.vae.config.latent_channels

    def is_latent_image(self, image) -> bool:
        """An image with the latent channels is latents already (a base pipeline's output_type="latent"), as
        diffusers reads a 4-channel image."""
        return image.shape[-3] == self.latent_channels

    def _module(self, params, upcast_from):
        """(vae, its params), cast to float32 inside the program where `in_float32` says so for its dtype."""
        vae, vae_params = self.vae, params["vae"]
        if self.in_float32 and jnp.dtype(vae.dtype) in upcast_from:
            vae, vae_params = vae.clone(dtype=jnp.float32), jax.tree.map(lambda p: p.astype(jnp.float32), vae_params)
        return vae, vae_params

    def encode(self, params, image, eps):
        """Latents of `image` (B, 3, H, W) in [-1, 1]: a posterior sample mean + std * eps, scaled as the UNet
        sees them (diffusers' `latent_dist.sample(generator) * scaling_factor`)."""
        vae, vae_params = self._module(params, UPCAST_TO_ENCODE)
        posterior = vae.apply(vae_params, jnp.asarray(image, vae.dtype), method="encode")
        latents = posterior.mean.astype(jnp.float32) + posterior.std.astype(jnp.float32) * eps
        return (latents.astype(jnp.float32) - self.shift) * self.vae.config.scaling_factor

    @property
    def shift(self) -> float:
        """SD 3.x's `shift_factor` (0 for the others), as diffusers' SD 3 pipelines shift the latents."""
        return self.vae.config.shift_factor or 0.0

    def decode(self, params, latents):
        """Latents as the UNet sees them -> images (B, H, W, 3) in [0, 1]."""
        vae, vae_params = self._module(params, UPCAST_TO_DECODE)
        latents = latents.astype(jnp.float32)  # as the scan leaves them; a bfloat16 VAE casts its input
        images = vae.apply(vae_params, latents / vae.config.scaling_factor + self.shift, method="decode")
        images = jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0, 1)
        return jnp.transpose(images, (0, 2, 3, 1))
