"""FreeU (Si et al. 2023): amplify the backbone's features and damp the low frequencies of the skip connections in
the two deepest up blocks, as diffusers' `enable_freeu` / `apply_freeu` (the SD 1.x values s1=0.9, s2=0.2, b1=1.2,
b2=1.4; SDXL's 0.6, 0.4, 1.1, 1.2)."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np

from .core import Hook, refuse_on_mmdit


@flax.struct.dataclass
class FreeU(Hook):
    s1: float  # skip scale of up block 0's lowest frequencies
    s2: float  # and of up block 1's
    b1: float  # backbone scale of up block 0's first half of channels
    b2: float

    def check_model(self, denoiser):
        refuse_on_mmdit(denoiser, "freeu", "it scales the backbone features and the skip connections of a UNet's "
                        "up blocks")

    def up_inputs(self, site, x, skip):  # NHWC
        if site.block not in (0, 1):
            return x, skip
        b, s = (self.b1, self.s1) if site.block == 0 else (self.b2, self.s2)
        half = x.shape[-1] // 2
        x = jnp.concatenate([x[..., :half] * jnp.asarray(b, x.dtype), x[..., half:]], axis=-1)
        return x, fourier_filter(skip, threshold=1, scale=s)


def freeu(s1, s2, b1, b2) -> FreeU:
    """The FreeU hook; its four factors are traced."""
    factors = [jnp.asarray(v, jnp.float32) for v in (s1, s2, b1, b2)]
    for name, value in zip(("s1", "s2", "b1", "b2"), factors):
        if not isinstance(value, jax.core.Tracer) and not np.isfinite(value).all():  # NaN images otherwise
            raise ValueError(f"freeu: {name} must be a finite number, got {value}")
    return FreeU(*factors)


def fourier_filter(x, threshold, scale):
    """diffusers' `fourier_filter` on NHWC: the centred (2 threshold)² lowest spatial frequencies times `scale`."""
    h, w = x.shape[1:3]
    mask = np.ones((h, w), np.float32)
    mask[h // 2 - threshold:h // 2 + threshold, w // 2 - threshold:w // 2 + threshold] = 0  # torch's slice rules
    low = jnp.asarray(1 - mask)[None, :, :, None]
    freq = jnp.fft.fftshift(jnp.fft.fftn(x.astype(jnp.float32), axes=(1, 2)), axes=(1, 2))
    freq = freq * (jnp.asarray(mask)[None, :, :, None] + low * scale)
    out = jnp.fft.ifftn(jnp.fft.ifftshift(freq, axes=(1, 2)), axes=(1, 2)).real
    return out.astype(x.dtype)
