"""Flux.1's single-stream block and rotary positions, as diffusers builds them (`transformer_flux.py`). Its
double-stream block is the MMDiT's `JointTransformerBlock` with qk RMSNorm and rotary positions (`mmdit_blocks.py`).

diffusers orders Flux's joint sequence [text; image]; here it is [image; text], the MMDiT's order, which the hooks
read (`JointAttention.attend`'s first `image_tokens` are the image's). Each token carries its own rotary angles and
attention is equivariant to the order of its tokens, so the outputs are the same, split back in the same order.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from .layers import Dense, Kernels
from .mmdit_blocks import EPS, JointAttention, RMSNorm, layer_norm, modulate, rotate

ROPE_THETA = 10000
MLP_RATIO = 4  # the single-stream block's MLP width, in model widths
FLOAT16_MAX = 65504.0


def rotary_tables(ids, axes_dims, theta=ROPE_THETA):
    """diffusers' FluxPosEmbed: the (cos, sin) of each token's angles, (L, sum(axes_dims) / 2) float32 each, from its
    position ids (L, axes): axis i turns by its position times the axes_dims[i] / 2 frequencies θ^(-2j / dᵢ)."""
    positions = ids.astype(jnp.float32)
    angles = jnp.concatenate([positions[:, i, None] * (1.0 / theta ** (np.arange(0, d, 2) / d)).astype(np.float32)
                              for i, d in enumerate(axes_dims)], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def clip_float16(x):
    """diffusers clips Flux's streams to float16's range after its blocks, in float16 only."""
    return jnp.clip(x, -FLOAT16_MAX, FLOAT16_MAX) if x.dtype == jnp.float16 else x


class SingleStreamAttention(JointAttention):
    """diffusers' FluxAttention with `pre_only` (the single-stream blocks'): to_q/to_k/to_v of the joint sequence
    [image; text], RMSNorm and rotary positions on queries and keys, and no output projection (the block projects it
    with its MLP's). A JointAttention to the hooks: `attend` sees the joint sequence, whose first `image_tokens` are
    the image's, and `queries` the image tokens' queries as to_q gives them."""

    @nn.compact
    def __call__(self, x, image_tokens, rope):  # x: (B, N + T, D) -> (B, N + T, heads * head_dim)
        n, inner = image_tokens, self.heads * self.head_dim
        dense = lambda name: Dense(inner, dtype=self.dtype, name=name)  # noqa: E731
        split = lambda t: t.reshape(*t.shape[:2], self.heads, self.head_dim)  # noqa: E731
        q = split(dense("to_q")(x))
        q = jnp.concatenate([self.queries(q[:, :n]), q[:, n:]], axis=1)
        q = rotate(RMSNorm(EPS, self.dtype, name="norm_q")(q), rope)
        k = rotate(RMSNorm(EPS, self.dtype, name="norm_k")(split(dense("to_k")(x))), rope)
        out = self.attend(q, k, split(dense("to_v")(x)), image_tokens=n)
        return out.reshape(*out.shape[:2], inner)


class FluxSingleTransformerBlock(nn.Module):
    """(image (B, N, D), text (B, T, D), temb (B, D), rope) -> (text, image), as diffusers'
    FluxSingleTransformerBlock: one adaLN-Zero modulation (shift, scale, gate) of the joint sequence, its attention
    and a tanh-GELU MLP side by side, projected together (proj_out), gated and added."""

    heads: int
    head_dim: int
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x, context, temb, rope):
        n, dim = x.shape[1], x.shape[-1]
        dense = lambda features, name: Dense(features, dtype=self.dtype, name=name)  # noqa: E731
        joint = jnp.concatenate([x, context], axis=1)
        shift, scale, gate = jnp.split(dense(3 * dim, "norm_linear")(nn.silu(temb)), 3, axis=-1)
        normed = modulate(layer_norm(joint, self.dtype), shift, scale)
        mlp = nn.gelu(dense(MLP_RATIO * dim, "proj_mlp")(normed), approximate=True)
        attention = SingleStreamAttention(self.heads, self.head_dim, qkv_bias=True, qk_norm="rms_norm",
                                          dtype=self.dtype, kernels=self.kernels, name="attn")(normed, n, rope)
        joint = clip_float16(joint + gate[:, None] * dense(dim, "proj_out")(jnp.concatenate([attention, mlp], -1)))
        return joint[:, n:], joint[:, :n]
