"""ReduxImageEncoder: Flux.1 Redux's image embedder (Black Forest Labs 2024), as diffusers builds it: SigLIP's
last hidden states, each token widened by redux_up, SiLU, and brought to T5's width by redux_down, become extra
text tokens of the Flux transformer."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from .config import config_from_dict
from .layers import Dense, Kernels, resolve_kernels
from .pretrained import Pretrained

UP = 3  # redux_up's width, in T5 widths


@dataclasses.dataclass(frozen=True)
class ReduxImageEncoderConfig:
    redux_dim: int = 1152  # SigLIP so400m's width
    txt_in_features: int = 4096  # T5-XXL's

    @classmethod
    def from_dict(cls, config):
        return config_from_dict(cls, config)


class ReduxImageEncoder(Pretrained, nn.Module):
    """SigLIP states (B, N, redux_dim) -> image tokens (B, N, txt_in_features)."""

    config: ReduxImageEncoderConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)  # unused: Pretrained's constructor
    config_class = ReduxImageEncoderConfig

    def dummy_inputs(self):
        return (jnp.zeros((1, 1, self.config.redux_dim), self.dtype),)

    @nn.compact
    def __call__(self, x):
        width = self.config.txt_in_features
        h = nn.silu(Dense(UP * width, dtype=self.dtype, name="redux_up")(x.astype(self.dtype)))
        return Dense(width, dtype=self.dtype, name="redux_down")(h)
