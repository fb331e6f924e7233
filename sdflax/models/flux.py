"""FluxTransformer2DModel: the rectified-flow transformer of Black Forest Labs' FLUX.1, as diffusers builds it.
Packed latent tokens and projected T5 states run through double-stream blocks (the MMDiT's joint blocks with qk
RMSNorm) and then single-stream blocks over their joint sequence (`flux_blocks.py`), every attention with 3-axis
rotary positions from the tokens' ids, all conditioned on the timestep, the pooled CLIP embedding and, in
guidance-distilled models (FLUX.1-dev), the guidance scale; the image tokens are then modulated and projected."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax.numpy as jnp

from .config import ConfigError, config_from_dict, config_source
from .flux_blocks import FluxSingleTransformerBlock, clip_float16, rotary_tables
from .layers import Dense, Kernels, resolve_kernels, timestep_embedding
from .mmdit_blocks import JointTransformerBlock, layer_norm
from .pretrained import Pretrained

TIMESTEP_CHANNELS = 256  # the sinusoidal features of the timestep and the guidance before their MLPs
TIME_SCALE = 1000  # the model takes t and the guidance scale as the pipeline gives them and embeds 1000 times them


@dataclasses.dataclass(frozen=True)
class FluxTransformerConfig:
    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None  # None: as many as come in
    num_layers: int = 19  # double-stream blocks
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False  # a guidance-distilled model (FLUX.1-dev) embeds the guidance scale
    axes_dims_rope: tuple = (16, 56, 56)  # the head's channels turned by each axis of the position ids

    def __post_init__(self):
        if self.out_channels is None:
            object.__setattr__(self, "out_channels", self.in_channels)

    @classmethod
    def from_dict(cls, config):
        cfg = config_from_dict(cls, config)
        cfg.check(config_source(config) + cls.__name__)
        return cfg

    def check(self, name, patch_sizes=(1,)):
        if self.patch_size not in patch_sizes:
            raise ConfigError(f"{name}: patch_size={self.patch_size}; sdflax builds FLUX.1's patch_size=1 (its "
                              "pipeline packs 2x2 latent patches into each token's channels)")
        axes = self.axes_dims_rope
        if len(axes) != 3 or any(d % 2 for d in axes) or sum(axes) != self.attention_head_dim:
            raise ConfigError(f"{name}: axes_dims_rope={list(axes)} must be three even numbers summing to "
                              f"attention_head_dim={self.attention_head_dim}")

    @property
    def inner_dim(self):
        return self.num_attention_heads * self.attention_head_dim


class FluxTransformer2DModel(Pretrained, nn.Module):
    """The velocity prediction from packed latents (B, L, in_channels), T5 states (B, T, joint_attention_dim), the
    pooled CLIP embedding (B, pooled_projection_dim), timesteps (B,) or () as t / 1000 in [0, 1], position ids of
    the image's tokens (L, 3) and the text's (T, 3) (with a batch axis, its first entry: diffusers' deprecated
    form), and the guidance scale (B,) or () of a guidance-distilled model (None otherwise) -> (B, L, out_channels),
    as diffusers' `FluxTransformer2DModel.forward`, with its ControlNet residuals: `controlnet_block_samples` and
    `controlnet_single_block_samples`, sequences of (B, L, D) added to the image tokens after the double- and
    single-stream blocks (`FluxControlNetModel`'s output), and `controlnet_blocks_repeat` (static) for XLabs' nets.
    `image_prompts`: an IP-Adapter's keys and values for each double-stream block
    (`JointAttention.image_prompt_attention`), or None.

    Attention layers are `mmdit_blocks.JointAttention`s, whose `attend` the hooks intercept by checkpoint name
    (`transformer_blocks.0.attn`, `single_transformer_blocks.0.attn`) over the joint sequence [image; text].
    """

    config: FluxTransformerConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)
    config_class = FluxTransformerConfig

    def dummy_inputs(self):
        cfg = self.config
        return (jnp.zeros((1, 1, cfg.in_channels)), jnp.zeros((1, 1, cfg.joint_attention_dim)),
                jnp.zeros((1, cfg.pooled_projection_dim)), jnp.zeros((1,)), jnp.zeros((1, 3)), jnp.zeros((1, 3)),
                jnp.zeros((1,)) if cfg.guidance_embeds else None)

    def __call__(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                 guidance=None, controlnet_block_samples=None, controlnet_single_block_samples=None,
                 controlnet_blocks_repeat=False, image_prompts=None):
        return self.run_blocks(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                               guidance, controlnet_block_samples, controlnet_single_block_samples,
                               controlnet_blocks_repeat, image_prompts)[0]

    @nn.compact
    def run_blocks(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                   guidance=None, controlnet_block_samples=None, controlnet_single_block_samples=None,
                   controlnet_blocks_repeat=False, image_prompts=None, blocks=None, start=None):
        """`__call__` -> (prediction, (the image's tokens entering the blocks run, the image's and the text's
        tokens they give)); `blocks` (first, stop or None: to the last), static, counting the double-stream blocks
        then the single-stream ones, runs only those, from `start` (image, text tokens) in place of the embedded
        inputs: the first-block cache's halves (`sdflax.hooks.first_block_cache`)."""
        cfg = self.config
        x, context, temb, rope = self.embed(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids,
                                            txt_ids, guidance)
        residuals = {"double": controlnet_block_samples, "single": controlnet_single_block_samples}
        counts = {"double": cfg.num_layers, "single": cfg.num_single_layers}

        def add_residual(kind, i, x):
            """diffusers' ControlNet residuals: n samples spread over the blocks, ceil(blocks / n) each in turn (or,
            `controlnet_blocks_repeat`, XLabs' nets, the samples in turn over and over)."""
            samples = residuals[kind]
            if samples is None:
                return x
            n = len(samples)
            return x + samples[i % n if controlnet_blocks_repeat else i // math.ceil(counts[kind] / n)]

        if start is not None:
            x, context = start
        entering = x
        x, context = self.blocks(x, context, temb, rope, add_residual, blocks, image_prompts)
        # norm_out: AdaLayerNormContinuous, scale then shift
        dense = lambda features, name: Dense(features, dtype=self.dtype, name=name)  # noqa: E731
        scale, shift = jnp.split(dense(2 * cfg.inner_dim, "norm_out_linear")(nn.silu(temb)), 2, axis=-1)
        out = layer_norm(x, self.dtype) * (1 + scale[:, None]) + shift[:, None]
        return dense(cfg.patch_size ** 2 * cfg.out_channels, "proj_out")(out), (entering, (x, context))

    def embed(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, guidance,
              text_prefix=None):
        """(image tokens (B, L, D), text tokens (B, T, D), temb (B, D), rotary tables of [image; text]): what the
        blocks take; `text_prefix` (B, 1, D), a Union ControlNet's mode, goes before the text with ids of zeros."""
        cfg, dtype = self.config, self.dtype
        img_ids, txt_ids = (ids[0] if ids.ndim == 3 else ids for ids in (jnp.asarray(img_ids), jnp.asarray(txt_ids)))
        self.check_inputs(hidden_states, encoder_hidden_states, img_ids, txt_ids, guidance)
        x = Dense(cfg.inner_dim, dtype=dtype, name="x_embedder")(hidden_states.astype(dtype))
        temb = self.embed_time_and_text(timestep, guidance, pooled_projections, x.shape[0])
        context = Dense(cfg.inner_dim, dtype=dtype, name="context_embedder")(encoder_hidden_states.astype(dtype))
        if text_prefix is not None:
            context = jnp.concatenate([text_prefix.astype(dtype), context], axis=1)
            txt_ids = jnp.concatenate([txt_ids[:1], txt_ids])
        # [image; text], not diffusers' [text; image]: the order the hooks read (flux_blocks.py says why it is the same)
        return x, context, temb, rotary_tables(jnp.concatenate([img_ids, txt_ids]), cfg.axes_dims_rope)

    def blocks(self, x, context, temb, rope, after_block, blocks=None, image_prompts=None):
        """The double-stream blocks, then the single-stream ones -> (image, text) tokens; `after_block(kind, i, x)`
        ("double" or "single", the block's index) gives the image tokens the next block takes; `blocks` (first,
        stop or None), counting the double-stream blocks then the single-stream ones, runs only those;
        `image_prompts`: an IP-Adapter's keys and values per double-stream block."""
        cfg, heads, head_dim = self.config, self.config.num_attention_heads, self.config.attention_head_dim
        first, stop = blocks or (0, None)
        for i in range(first, cfg.num_layers + cfg.num_single_layers if stop is None else stop):
            if i < cfg.num_layers:
                context, x = JointTransformerBlock(heads, head_dim, qk_norm="rms_norm", dtype=self.dtype,
                                                   kernels=self.kernels, name=f"transformer_blocks_{i}")(
                    x, context, temb, rope, None if image_prompts is None else image_prompts[i])
                context = clip_float16(context)
                x = after_block("double", i, x)
            else:
                j = i - cfg.num_layers
                context, x = FluxSingleTransformerBlock(heads, head_dim, self.dtype, kernels=self.kernels,
                                                        name=f"single_transformer_blocks_{j}")(x, context, temb, rope)
                x = after_block("single", j, x)
        return x, context

    def check_inputs(self, hidden_states, encoder_hidden_states, img_ids, txt_ids, guidance):
        cfg = self.config
        if hidden_states.shape[-1] != cfg.in_channels:
            raise ValueError(f"hidden_states of shape {hidden_states.shape}: this transformer takes "
                             f"in_channels={cfg.in_channels} channels per token (packed latents (B, L, C))")
        if encoder_hidden_states.shape[-1] != cfg.joint_attention_dim:
            raise ValueError(f"encoder_hidden_states of shape {encoder_hidden_states.shape}: this transformer takes "
                             f"joint_attention_dim={cfg.joint_attention_dim} channels per text token")
        for name, ids, tokens in (("img_ids", img_ids, hidden_states.shape[1]),
                                  ("txt_ids", txt_ids, encoder_hidden_states.shape[1])):
            if ids.shape != (tokens, len(cfg.axes_dims_rope)):
                raise ValueError(f"{name} of shape {ids.shape}: expected ({tokens}, {len(cfg.axes_dims_rope)}), one "
                                 "row of position ids per token")
        if cfg.guidance_embeds and guidance is None:
            raise ValueError("guidance=None: this transformer is guidance-distilled (guidance_embeds, as FLUX.1-dev) "
                             "and embeds the guidance scale: pass it, (B,)")
        if not cfg.guidance_embeds and guidance is not None:
            raise ValueError("guidance given, but this transformer has no guidance embedding (guidance_embeds=False, "
                             "as FLUX.1-schnell): pass guidance=None")

    def embed_time_and_text(self, timestep, guidance, pooled_projections, batch):
        """diffusers' CombinedTimestep(Guidance)TextProjEmbeddings: MLP(sinusoidal(1000 t)) (+ MLP(sinusoidal(1000
        guidance))) + MLP(pooled text) -> (B, D); t and the guidance scaled in the model's dtype, as diffusers."""
        dim, dtype = self.config.inner_dim, self.dtype

        def embed(name, value):  # timestep_embedder or guidance_embedder
            value = jnp.broadcast_to(jnp.asarray(value).astype(dtype) * TIME_SCALE, (batch,))
            features = timestep_embedding(value, TIMESTEP_CHANNELS, flip_sin_to_cos=True, freq_shift=0).astype(dtype)
            hidden = nn.silu(Dense(dim, dtype=dtype, name=f"time_text_embed_{name}_linear_1")(features))
            return Dense(dim, dtype=dtype, name=f"time_text_embed_{name}_linear_2")(hidden)

        temb = embed("timestep_embedder", timestep)
        if guidance is not None:
            temb = temb + embed("guidance_embedder", guidance)
        text = Dense(dim, dtype=dtype, name="time_text_embed_text_embedder_linear_1")(pooled_projections.astype(dtype))
        return temb + Dense(dim, dtype=dtype, name="time_text_embed_text_embedder_linear_2")(nn.silu(text))
