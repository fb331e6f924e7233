"""IP-Adapter's image projections (Ye et al. 2023): a CLIP image embedding, or the image encoder's penultimate
hidden states, become the tokens that the UNet's decoupled cross-attention reads beside the text's. Equal to
diffusers' ImageProjection and IPAdapterFullImageProjection, and to its resamplers IPAdapterPlusImageProjection and
SD 3.5's IPAdapterTimeImageProjection (one `Resampler`, modulated by the timestep with `timestep_in_dim`), with their
parameter names."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from .layers import Dense, Kernels, LayerNorm, ReadsParams, dot_product_attention, resolve_kernels, timestep_embedding

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's


def gelu(x):
    return jax.nn.gelu(x, approximate=False)  # diffusers' GELU(approximate="none")


class ImageProjection(nn.Module):
    """IP-Adapter: the image embedding (N, E) -> (N, num_image_text_embeds, cross_attention_dim)."""

    image_embed_dim: int = 768
    cross_attention_dim: int = 768
    num_image_text_embeds: int = 4
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, image_embeds):
        tokens, dim = self.num_image_text_embeds, self.cross_attention_dim
        x = Dense(tokens * dim, dtype=self.dtype, name="image_embeds")(image_embeds)
        return LayerNorm(LAYER_NORM_EPS, dtype=self.dtype, name="norm")(x.reshape(x.shape[0], tokens, dim))


class IPAdapterFullImageProjection(nn.Module):
    """IP-Adapter Full Face: each hidden state (N, T, E) -> (N, T, cross_attention_dim) by an MLP and a LayerNorm."""

    image_embed_dim: int = 1024
    cross_attention_dim: int = 1024
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden_states):
        x = gelu(Dense(self.image_embed_dim, dtype=self.dtype, name="ff_net_0_proj")(hidden_states))
        x = Dense(self.cross_attention_dim, dtype=self.dtype, name="ff_net_2")(x)
        return LayerNorm(LAYER_NORM_EPS, dtype=self.dtype, name="norm")(x)


class ResamplerAttention(nn.Module):
    """diffusers' Attention as the resampler builds it: no biases, output as wide as the queries."""

    heads: int
    dim_head: int
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x, context):  # x: (N, Q, H) queries; context: (N, S, H)
        inner = self.heads * self.dim_head
        dense = lambda features, name: Dense(features, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        split = lambda t: t.reshape(*t.shape[:2], self.heads, self.dim_head)  # noqa: E731
        q = split(dense(inner, "to_q")(x))
        k, v = split(dense(inner, "to_k")(context)), split(dense(inner, "to_v")(context))
        out = dot_product_attention(q, k, v, kernels=self.kernels)
        return dense(x.shape[-1], "to_out_0")(out.reshape(*out.shape[:2], inner))


class ResamplerBlock(nn.Module):
    """One resampler layer: the latents attend to [ln0(features), ln1(latents)], then a bias-free GELU MLP; given a
    timestep embedding (SD 3.5's), the latents are adaLN-modulated by it before each (shift, scale)."""

    dim_head: int
    heads: int
    ffn_ratio: float
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x, latents, temb=None):  # x (N, T, H) projected features, latents (N, Q, H), temb (N, H)
        dim = latents.shape[-1]
        norm = lambda name: LayerNorm(LAYER_NORM_EPS, dtype=self.dtype, name=name)  # noqa: E731
        if temb is None:  # IP-Adapter Plus: diffusers' ff is Sequential(LayerNorm, FeedForward)
            attention_mod = mlp_mod = None
            mlp_norm, ff = "ff_0", "ff_1_net"
        else:
            shift_msa, scale_msa, shift_mlp, scale_mlp = jnp.split(
                Dense(4 * dim, dtype=self.dtype, name="adaln_proj")(nn.silu(temb)), 4, axis=-1)
            attention_mod, mlp_mod = (shift_msa, scale_msa), (shift_mlp, scale_mlp)
            mlp_norm, ff = "adaln_norm", "ff_net"
        modulated = modulate(norm("ln1")(latents), attention_mod)
        context = jnp.concatenate([norm("ln0")(x), modulated], axis=1)
        latents = latents + ResamplerAttention(self.heads, self.dim_head, self.dtype, kernels=self.kernels,
                                               name="attn")(modulated, context)
        h = modulate(norm(mlp_norm)(latents), mlp_mod)
        h = gelu(Dense(int(dim * self.ffn_ratio), use_bias=False, dtype=self.dtype, name=f"{ff}_0_proj")(h))
        return latents + Dense(dim, use_bias=False, dtype=self.dtype, name=f"{ff}_2")(h)


def modulate(x, shift_scale):
    """adaLN: x * (1 + scale) + shift over the tokens; None: x."""
    if shift_scale is None:
        return x
    shift, scale = shift_scale
    return x * (1 + scale[:, None]) + shift[:, None]


class Resampler(ReadsParams, nn.Module):
    """IP-Adapter Plus's perceiver resampler (diffusers' IPAdapterPlusImageProjection): hidden states
    (N, T, embed_dim) -> (N, num_queries, output_dim). With `timestep_in_dim`, SD 3.5 Large's (InstantX's,
    diffusers' IPAdapterTimeImageProjection): SigLIP's penultimate states and the timesteps (N,) -> (tokens, the
    timestep embedding (N, hidden_dim)), the features shifted and every layer modulated by that embedding."""

    embed_dim: int = 768
    output_dim: int = 1024
    hidden_dim: int = 1280
    depth: int = 4
    dim_head: int = 64
    heads: int = 16
    num_queries: int = 8
    ffn_ratio: float = 4
    timestep_in_dim: int | None = None  # SD 3.5's: the sinusoidal timestep features' width
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)

    @nn.compact
    def __call__(self, x, timestep=None):
        dense = lambda features, name: Dense(features, dtype=self.dtype, name=name)  # noqa: E731
        temb = None
        if self.timestep_in_dim is not None:
            t = timestep_embedding(jnp.broadcast_to(jnp.asarray(timestep), (x.shape[0],)), self.timestep_in_dim,
                                   flip_sin_to_cos=True, freq_shift=0).astype(self.dtype)
            temb = dense(self.hidden_dim, "time_embedding_linear_2")(nn.silu(dense(self.hidden_dim,
                                                                                "time_embedding_linear_1")(t)))
        latents = self.param("latents", nn.initializers.normal(self.hidden_dim ** -0.5),
                             (1, self.num_queries, self.hidden_dim))
        latents = jnp.broadcast_to(latents.astype(self.dtype), (x.shape[0], *latents.shape[1:]))
        x = dense(self.hidden_dim, "proj_in")(x.astype(self.dtype))
        if temb is not None:
            x = x + temb[:, None]
        for i in range(self.depth):
            latents = ResamplerBlock(self.dim_head, self.heads, self.ffn_ratio, self.dtype, kernels=self.kernels,
                                     name=f"layers_{i}")(x, latents, temb)
        latents = dense(self.output_dim, "proj_out")(latents)
        latents = LayerNorm(LAYER_NORM_EPS, dtype=self.dtype, name="norm_out")(latents)
        return latents if temb is None else (latents, temb)
