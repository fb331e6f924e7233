"""SiglipVisionModel: SigLIP's image tower (Zhai et al. 2023) as transformers builds it, a ViT without a class
token: biased patch embedding, learned positions, CLIP's pre-LN encoder layers, a final LayerNorm and, with
`vision_use_head`, an attention-pooling head (a learned probe attends to the tokens). Flux Redux reads its last
hidden state, SD 3.5 Large's IP-Adapter its penultimate layer's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from .clip import ACTIVATIONS, EncoderLayer
from .clip_vision import PatchEmbedding
from .config import ConfigError, config_from_dict, config_source
from .layers import Dense, Embed, Kernels, LayerNorm, ReadsParams, dot_product_attention, resolve_kernels
from .pretrained import Pretrained


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    vision_use_head: bool = True

    @classmethod
    def from_dict(cls, config):
        nested = config.get("vision_config") if isinstance(config, Mapping) else None
        config = nested if isinstance(nested, Mapping) else config  # a full SiglipConfig nests the vision tower's
        cfg = config_from_dict(cls, config)
        where = f"{config_source(config)}SiglipVisionConfig: "
        if cfg.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"{where}hidden_act={cfg.hidden_act!r:.100}; sdflax knows {sorted(ACTIVATIONS)}")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ConfigError(f"{where}hidden_size={cfg.hidden_size} is not a multiple of num_attention_heads="
                              f"{cfg.num_attention_heads}")
        if cfg.patch_size > cfg.image_size:
            raise ConfigError(f"{where}patch_size={cfg.patch_size} is larger than image_size={cfg.image_size}")
        return cfg

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size


@flax.struct.dataclass
class SiglipVisionOutput:
    last_hidden_state: jax.Array  # (B, grid², D), after post_layernorm
    pooler_output: jax.Array | None = None  # (B, D): the attention-pooling head's, None without it
    hidden_states: tuple | None = None  # the embeddings, then every layer's output (no LayerNorm): L + 1 items


class PoolingAttention(ReadsParams, nn.Module):
    """torch.nn.MultiheadAttention as the head holds it: q, k and v from one (3D, D) in_proj_weight, then out_proj."""

    heads: int
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, queries, tokens):  # queries (B, Q, D), tokens (B, N, D)
        dim = queries.shape[-1]
        weight = self.param("in_proj_weight", nn.initializers.lecun_normal(), (3 * dim, dim)).astype(self.dtype)
        bias = self.param("in_proj_bias", nn.initializers.zeros, (3 * dim,)).astype(self.dtype)
        (wq, wk, wv), (bq, bk, bv) = jnp.split(weight, 3), jnp.split(bias, 3)
        split = lambda t: t.reshape(*t.shape[:2], self.heads, dim // self.heads)  # noqa: E731
        q, k, v = split(queries @ wq.T + bq), split(tokens @ wk.T + bk), split(tokens @ wv.T + bv)
        out = dot_product_attention(q, k, v, kernels=self.kernels).reshape(queries.shape)
        return Dense(dim, dtype=self.dtype, name="out_proj")(out)


class SiglipVisionModel(Pretrained, nn.Module):
    """Pixels (B, C, H, W) at the config's image_size, normalised as SigLIP's image processor does (mean and std
    0.5) -> SiglipVisionOutput."""

    config: SiglipVisionConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)
    config_class = SiglipVisionConfig
    # a two-tower checkpoint's (SiglipModel's: google/siglip-so400m-patch14-384) tensors of the text tower, which
    # this model skips, as transformers' SiglipVisionModel.from_pretrained does
    other_tower = ("text_model.", "logit_scale", "logit_bias")

    def dummy_inputs(self):
        cfg = self.config
        return (jnp.zeros((1, cfg.num_channels, cfg.image_size, cfg.image_size), self.dtype),)

    @nn.compact
    def __call__(self, pixel_values, output_hidden_states=False):
        cfg = self.config
        pixel_values = jnp.asarray(pixel_values)
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}: this SigLIP vision model takes "
                             f"(B, {', '.join(map(str, expected))}) (siglip_image_inputs(images, size="
                             f"{cfg.image_size}) makes them)")
        x = self.embeddings(pixel_values)
        hidden_states = [x]
        for i in range(cfg.num_hidden_layers):
            x = EncoderLayer(cfg, self.dtype, self.kernels, causal=False, name=f"encoder_layers_{i}")(x)
            hidden_states.append(x)
        x = LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, name="post_layernorm")(x)
        pooled = None
        if cfg.vision_use_head:
            pooled = PoolingHead(cfg, self.dtype, kernels=self.kernels, name="head")(x)
        return SiglipVisionOutput(x, pooled, tuple(hidden_states) if output_hidden_states else None)

    def embeddings(self, pixels):
        """The patches, each with its learned position embedding: (B, grid², D)."""
        cfg = self.config
        patches = PatchEmbedding(cfg.hidden_size, cfg.patch_size, self.dtype, use_bias=True,
                                 name="embeddings_patch_embedding")(pixels)
        positions = Embed(cfg.grid ** 2, cfg.hidden_size, dtype=self.dtype, name="embeddings_position_embedding")
        return patches + positions(jnp.arange(patches.shape[1]))[None]


class PoolingHead(ReadsParams, nn.Module):
    """transformers' SiglipMultiheadAttentionPoolingHead: a learned probe attends to the tokens, then a residual
    MLP: (B, N, D) -> (B, D)."""

    config: SiglipVisionConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        probe = self.param("probe", nn.initializers.normal(1.0), (1, 1, cfg.hidden_size)).astype(self.dtype)
        probe = jnp.broadcast_to(probe, (x.shape[0], 1, cfg.hidden_size))
        h = PoolingAttention(cfg.num_attention_heads, self.dtype, kernels=self.kernels, name="attention")(probe, x)
        dense = lambda features, name: Dense(features, dtype=self.dtype, name=name)  # noqa: E731
        mlp = dense(cfg.hidden_size, "mlp_fc2")(ACTIVATIONS[cfg.hidden_act](dense(
            cfg.intermediate_size, "mlp_fc1")(LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, name="layernorm")(h))))
        return (h + mlp)[:, 0]
