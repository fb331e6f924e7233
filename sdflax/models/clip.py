"""CLIPTextModel: the CLIP text tower (Radford et al. 2021) as transformers builds it, a causal pre-LN transformer.
CLIPTextModelWithProjection (SDXL's second encoder) adds transformers' `text_projection` on the pooled state."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import ConfigError, config_from_dict, config_source
from .layers import Dense, Embed, Kernels, LayerNorm, dot_product_attention, resolve_kernels
from .pretrained import Pretrained

ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # SigLIP's: gelu_new's formula
}


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407
    projection_dim: int = 512  # CLIPTextModelWithProjection only

    @classmethod
    def from_dict(cls, config):
        nested = config.get("text_config") if isinstance(config, Mapping) else None
        config = nested if isinstance(nested, Mapping) else config  # a full CLIPConfig nests the text tower's
        cfg = config_from_dict(cls, config)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"{config_source(config)}CLIPTextConfig: hidden_act={cfg.hidden_act!r:.100}; "
                              f"sdflax knows {sorted(ACTIVATIONS)}")
        return cfg


@flax.struct.dataclass
class CLIPTextOutput:
    last_hidden_state: jax.Array  # (B, T, D), after the final LayerNorm
    pooler_output: jax.Array  # (B, D), the final state at the end-of-text token
    hidden_states: tuple | None = None  # embeddings, then every layer's output (no final LayerNorm): L + 1 items
    text_embeds: jax.Array | None = None  # (B, projection_dim): text_projection(pooler_output), WithProjection only


class EncoderLayer(nn.Module):
    """One pre-LN transformer layer of either CLIP tower (`config` is the text or the vision tower's: the fields
    both have); the text tower's attention is causal, the vision tower's is not."""

    config: CLIPTextConfig
    dtype: jnp.dtype
    kernels: Kernels
    causal: bool = True

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        norm = lambda name: LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, name=name)  # noqa: E731
        dense = lambda features, name: Dense(features, dtype=self.dtype, name=name)  # noqa: E731

        h = norm("layer_norm1")(x)
        split = lambda t: t.reshape(*t.shape[:2], heads, head_dim)  # noqa: E731
        q, k, v = (split(dense(cfg.hidden_size, f"self_attn_{n}_proj")(h)) for n in "qkv")
        attn = dot_product_attention(q, k, v, causal=self.causal, kernels=self.kernels).reshape(x.shape)
        x = x + dense(cfg.hidden_size, "self_attn_out_proj")(attn)

        h = ACTIVATIONS[cfg.hidden_act](dense(cfg.intermediate_size, "mlp_fc1")(norm("layer_norm2")(x)))
        return x + dense(cfg.hidden_size, "mlp_fc2")(h)


class CLIPTextModel(Pretrained, nn.Module):
    """Token ids (B, T) -> CLIPTextOutput."""

    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)
    config_class = CLIPTextConfig
    with_projection = False

    def dummy_inputs(self):
        return (jnp.zeros((1, self.config.max_position_embeddings), jnp.int32),)

    @nn.compact
    def __call__(self, input_ids, output_hidden_states=False):
        cfg = self.config
        input_ids = jnp.asarray(input_ids, jnp.int32)
        embed = lambda n, name: Embed(n, cfg.hidden_size, dtype=self.dtype, name=name)  # noqa: E731
        positions = jnp.arange(input_ids.shape[-1])[None]
        x = embed(cfg.vocab_size, "embeddings_token_embedding")(input_ids)
        x = x + embed(cfg.max_position_embeddings, "embeddings_position_embedding")(positions)

        hidden_states = [x]
        for i in range(cfg.num_hidden_layers):
            x = EncoderLayer(cfg, self.dtype, self.kernels, name=f"encoder_layers_{i}")(x)
            hidden_states.append(x)
        x = LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, name="final_layer_norm")(x)

        # transformers' rule: legacy configs (eos id 2) pool at the largest id, the others at the first eos.
        if cfg.eos_token_id == 2:
            eos_position = jnp.argmax(input_ids, axis=-1)
        else:
            eos_position = jnp.argmax(input_ids == cfg.eos_token_id, axis=-1)
        pooled = jnp.take_along_axis(x, eos_position[:, None, None], axis=1)[:, 0]
        text_embeds = None
        if self.with_projection:
            text_embeds = Dense(cfg.projection_dim, use_bias=False, dtype=self.dtype, name="text_projection")(pooled)
        return CLIPTextOutput(x, pooled, tuple(hidden_states) if output_hidden_states else None, text_embeds)


class CLIPTextModelWithProjection(CLIPTextModel):
    """Token ids (B, T) -> CLIPTextOutput with `text_embeds` (B, projection_dim) (SDXL's text_encoder_2)."""

    with_projection = True
