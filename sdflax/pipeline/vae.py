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
        decode = lambda z: vae.apply(vae_params, z, method="decode")  # noqa: E731
        latents = latents / vae.config.scaling_factor + self.shift
        tile = vae.config.sample_size // vae.config.scale_factor
        images = tiled_decode(decode, latents, tile, vae.config.sample_size) if self.vae.tiling and max(
            latents.shape[-2:]) > tile else decode(latents)
        images = jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0, 1)
        return jnp.transpose(images, (0, 2, 3, 1))


def tiled_decode(decode, z, tile: int, sample_tile: int, overlap: float = 0.25):
    """diffusers' `AutoencoderKL.tiled_decode`: latents z (B, C, h, w) decoded in tiles of `tile` latents that
    overlap by `overlap` of theirs, each tile blended linearly into the (already blended) tiles above and to its
    left over `overlap` of a decoded tile (`sample_tile` pixels), and cropped. Pixels (B, 3, H, W)."""
    stride, blend = int(tile * (1 - overlap)), int(sample_tile * overlap)
    kept = sample_tile - blend
    rows = []
    for i in range(0, z.shape[2], stride):
        row = []
        for j in range(0, z.shape[3], stride):
            decoded = decode(z[:, :, i:i + tile, j:j + tile])
            if rows:
                decoded = blended(rows[-1][len(row)], decoded, blend, axis=2)
            if row:
                decoded = blended(row[-1], decoded, blend, axis=3)
            row.append(decoded)
        rows.append(row)
    return jnp.concatenate([jnp.concatenate([t[:, :, :kept, :kept] for t in row], axis=3) for row in rows], axis=2)


def blended(a, b, extent: int, axis: int):
    """b with its first `extent` lines along `axis` faded in from a's last ones: a (1 - y / extent) + b y / extent."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    shape = [1] * b.ndim
    shape[axis] = extent
    ramp = (jnp.arange(extent, dtype=jnp.float32) / extent).reshape(shape)
    head = jax.lax.slice_in_dim(a, a.shape[axis] - extent, a.shape[axis], axis=axis) * (1 - ramp) + \
        jax.lax.slice_in_dim(b, 0, extent, axis=axis) * ramp
    return jnp.concatenate([head.astype(b.dtype), jax.lax.slice_in_dim(b, extent, b.shape[axis], axis=axis)], axis)
