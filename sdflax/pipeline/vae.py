"""The VAE as the pipelines use it: images in [-1, 1] to scaled latents, and back to images in [0, 1]."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class VAE:
    """`vae` and whether it runs in float32 whatever its dtype (SDXL's `force_upcast`: its VAE overflows in half
    precision, and diffusers encodes and decodes in float32 when the config says so)."""

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

    def _module(self, params):
        """(vae, its params), cast to float32 inside the program where `in_float32` says so."""
        vae, vae_params = self.vae, params["vae"]
        if self.in_float32 and jnp.dtype(vae.dtype) != jnp.float32:
            vae, vae_params = vae.clone(dtype=jnp.float32), jax.tree.map(lambda p: p.astype(jnp.float32), vae_params)
        return vae, vae_params

    def encode(self, params, image, eps):
        """Latents of `image` (B, 3, H, W) in [-1, 1]: a posterior sample mean + std * eps, scaled as the UNet
        sees them (diffusers' `latent_dist.sample(generator) * scaling_factor`)."""
        vae, vae_params = self._module(params)
        posterior = vae.apply(vae_params, jnp.asarray(image, vae.dtype), method="encode")
        latents = posterior.mean.astype(jnp.float32) + posterior.std.astype(jnp.float32) * eps
        return (latents.astype(jnp.float32) - self.shift) * self.vae.config.scaling_factor

    @property
    def shift(self) -> float:
        """SD 3.x's `shift_factor` (0 for the others), as diffusers' SD 3 pipelines shift the latents."""
        return self.vae.config.shift_factor or 0.0

    def decode(self, params, latents):
        """Latents as the UNet sees them -> images (B, H, W, 3) in [0, 1]."""
        vae, vae_params = self._module(params)
        latents = latents.astype(jnp.float32)  # as the scan leaves them; a bfloat16 VAE casts its input
        images = vae.apply(vae_params, latents / vae.config.scaling_factor + self.shift, method="decode")
        images = jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0, 1)
        return jnp.transpose(images, (0, 2, 3, 1))
