"""T5EncoderModel: the encoder of T5 (Raffel et al. 2020) as transformers builds it, SD 3.5's third text encoder
(T5 v1.1 XXL): pre-norm blocks with RMS norms, unscaled attention with a learned relative position bias, and a gated
GELU feed-forward.

transformers clamps the hidden states of float16 models to keep them finite; sdflax computes in float32 or bfloat16,
whose range needs no clamp, so there is none here (T5 in float16 overflows without it: load it in bfloat16).
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .config import ConfigError, config_from_dict, config_source
from .layers import Dense, Embed, Kernels, ReadsParams, apply_probs, resolve_kernels
from .pretrained import Pretrained

ACTIVATIONS = {  # transformers' ACT2FN names
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class T5Config:
    """transformers' T5Config fields that the encoder reads, with its defaults (T5 v1.0's; v1.1 files set them)."""

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"  # "<act>" or "gated-<act>"
    dense_act_fn: str | None = None  # None: from feed_forward_proj, "gated-gelu" meaning "gelu_new" (transformers')

    def __post_init__(self):
        if self.dense_act_fn is None:
            act = "gelu_new" if self.feed_forward_proj == "gated-gelu" else self.feed_forward_proj.split("-")[-1]
            object.__setattr__(self, "dense_act_fn", act)

    @property
    def is_gated_act(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @classmethod
    def from_dict(cls, config):
        where = config_source(config)
        cfg = config_from_dict(cls, config)
        parts = cfg.feed_forward_proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise ConfigError(f"{where}T5Config: feed_forward_proj={cfg.feed_forward_proj!r:.100} is not "
                              "'<activation>' or 'gated-<activation>' (e.g. 'gated-gelu', 'relu')")
        if cfg.dense_act_fn not in ACTIVATIONS:
            raise ConfigError(f"{where}T5Config: activation {cfg.dense_act_fn!r:.100} (dense_act_fn / "
                              f"feed_forward_proj); sdflax knows {sorted(ACTIVATIONS)}")
        if small := [f"{name}={getattr(cfg, name)}" for name in ("d_model", "d_kv", "d_ff") if getattr(cfg, name) < 1]:
            raise ConfigError(f"{where}T5Config: {', '.join(small)}: sizes must be positive")
        buckets, distance = cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
        if buckets < 4 or distance <= buckets // 4:
            raise ConfigError(f"{where}T5Config: relative_attention_num_buckets={buckets} and "
                              f"relative_attention_max_distance={distance}: need at least 4 buckets and a distance "
                              "over a quarter of them (T5 uses 32 and 128)")
        return cfg


def relative_position_buckets(query_length: int, key_length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """(query_length, key_length) bucket ids of key position - query position, bidirectional, as transformers'
    `T5Attention._relative_position_bucket`: half the buckets for each direction, exact below a quarter of them,
    logarithmic up to `max_distance`. In float32 as torch computes it, so the buckets at the boundaries agree."""
    relative = np.arange(key_length)[None, :] - np.arange(query_length)[:, None]
    half = num_buckets // 2
    exact = half // 2
    distance = np.abs(relative)
    log_ratio = np.log(np.maximum(distance, exact).astype(np.float32) / np.float32(exact))  # short ones: exact
    large = exact + (log_ratio / np.float32(math.log(max_distance / exact)) * np.float32(half - exact)).astype(np.int64)
    large = np.minimum(large, half - 1)
    return (relative > 0) * half + np.where(distance < exact, distance, large)


class T5LayerNorm(ReadsParams, nn.Module):
    """RMS norm without bias or mean subtraction, its statistics in float32 (transformers' T5LayerNorm)."""

    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * normed.astype(self.dtype)


class T5Block(nn.Module):
    """Self-attention and feed-forward, each pre-norm and residual; the first block owns the position bias table."""

    config: T5Config
    dtype: jnp.dtype
    has_relative_attention_bias: bool = False

    @nn.compact
    def __call__(self, x, position_bias, mask_bias):  # x (B, T, D); position_bias (1, H, T, T) or None here
        cfg = self.config
        dense = lambda features, name: Dense(features, use_bias=False, dtype=self.dtype, name=name)  # noqa: E731
        norm = lambda name: T5LayerNorm(cfg.layer_norm_epsilon, self.dtype, name=name)  # noqa: E731
        if self.has_relative_attention_bias:
            buckets = relative_position_buckets(x.shape[1], x.shape[1], cfg.relative_attention_num_buckets,
                                                cfg.relative_attention_max_distance)
            table = Embed(cfg.relative_attention_num_buckets, cfg.num_heads, dtype=self.dtype,
                          name="layer_0_SelfAttention_relative_attention_bias")
            position_bias = table(jnp.asarray(buckets)).astype(jnp.float32).transpose(2, 0, 1)[None]

        h = norm("layer_0_layer_norm")(x)
        split = lambda t: t.reshape(*t.shape[:2], cfg.num_heads, cfg.d_kv)  # noqa: E731
        q, k, v = (split(dense(cfg.num_heads * cfg.d_kv, f"layer_0_SelfAttention_{n}")(h)) for n in "qkv")
        # T5 folds the 1/sqrt(d) scale into its initialisation: the logits are q·k unscaled, plus the bias.
        logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) + position_bias
        if mask_bias is not None:
            logits = logits + mask_bias
        attn = apply_probs(jax.nn.softmax(logits, axis=-1), v)
        x = x + dense(cfg.d_model, "layer_0_SelfAttention_o")(attn.reshape(*x.shape[:2], -1))

        h = norm("layer_1_layer_norm")(x)
        act = ACTIVATIONS[cfg.dense_act_fn]
        if cfg.is_gated_act:
            gate = act(dense(cfg.d_ff, "layer_1_DenseReluDense_wi_0")(h))
            h = gate * dense(cfg.d_ff, "layer_1_DenseReluDense_wi_1")(h)
        else:
            h = act(dense(cfg.d_ff, "layer_1_DenseReluDense_wi")(h))
        return x + dense(cfg.d_model, "layer_1_DenseReluDense_wo")(h), position_bias


class T5EncoderModel(Pretrained, nn.Module):
    """Token ids (B, T) -> last_hidden_state (B, T, d_model); `attention_mask` (B, T), 1 for tokens and 0 for
    padding, hides the padding from attention (SD 3.5 passes none: its padding is attended to)."""

    config: T5Config
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)  # unused: the attention has a bias
    config_class = T5Config

    def dummy_inputs(self):
        return (jnp.zeros((1, 8), jnp.int32),)

    @nn.compact
    def __call__(self, input_ids, attention_mask=None):
        cfg = self.config
        x = Embed(cfg.vocab_size, cfg.d_model, dtype=self.dtype, name="shared")(jnp.asarray(input_ids, jnp.int32))
        mask_bias = None
        if attention_mask is not None:  # transformers' additive mask: the float32 minimum on hidden keys
            keep = jnp.asarray(attention_mask).astype(bool)[:, None, None, :]
            mask_bias = jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min)
        position_bias = None
        for i in range(cfg.num_layers):
            x, position_bias = T5Block(cfg, self.dtype, i == 0, name=f"encoder_block_{i}")(x, position_bias, mask_bias)
        return T5LayerNorm(cfg.layer_norm_epsilon, self.dtype, name="encoder_final_layer_norm")(x)
