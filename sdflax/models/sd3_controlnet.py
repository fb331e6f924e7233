"""SD3ControlNetModel: the ControlNets of SD 3.x as diffusers builds them (`controlnets/controlnet_sd3.py`). A copy
of the MMDiT's first blocks reads the latents plus the control image's latents (through a zero-initialised patch
embedding, `pos_embed_input`) and gives one sample per block, each through a zero-initialised linear layer
(`controlnet_blocks`), which the transformer adds to its image tokens (`SD3Transformer2DModel`'s
`block_controlnet_hidden_states`).

InstantX's SD 3 nets are joint blocks with their own patch embedding and text projection; Stability's SD 3.5 Large
nets (canny, depth, blur) are single-stream blocks (`joint_attention_dim=None`: no text) that take the
transformer's patch embedding (`use_pos_embed=False`) and the prompt's pooled embedding
(`force_zeros_for_pooled_projection=False`; InstantX's see zeros there).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from .config import ConfigError, config_from_dict, config_source
from .layers import Dense, Kernels, resolve_kernels
from .mmdit import MMDiTConfig, PatchEmbed, embed_time_and_text
from .mmdit_blocks import JointAttention, JointTransformerBlock, feed_forward, layer_norm, modulate
from .pretrained import Pretrained

NULLABLE = ("joint_attention_dim", "pos_embed_max_size", "pos_embed_type", "qk_norm")  # None means something


@dataclasses.dataclass(frozen=True)
class SD3ControlNetConfig(MMDiTConfig):
    joint_attention_dim: int | None = 4096  # None: single-stream blocks without text (SD 3.5 Large's nets)
    pos_embed_max_size: int | None = 96
    extra_conditioning_channels: int = 0  # control latents beyond the latent channels (the inpainting net's mask)
    pos_embed_type: str | None = "sincos"  # None: the patch embedding has no position table
    use_pos_embed: bool = True  # False: it takes the transformer's patch embedding of the latents
    force_zeros_for_pooled_projection: bool = True  # the pipelines' rule: zeros for its pooled input, no VAE shift

    @classmethod
    def from_dict(cls, config):
        extra = config.get("extra_conditioning_channels", 0)  # may be 0, unlike the other *_channels
        cfg = config_from_dict(cls, {k: v for k, v in config.items() if k != "extra_conditioning_channels"})
        cfg = dataclasses.replace(cfg, **{name: None for name in NULLABLE if name in config and config[name] is None})
        name = config_source(config) + cls.__name__
        if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
            raise ConfigError(f"{name}: extra_conditioning_channels={extra!r:.100} must be a whole number >= 0")
        cfg = dataclasses.replace(cfg, extra_conditioning_channels=extra)
        if cfg.pos_embed_type not in (None, "sincos"):
            raise ConfigError(f"{name}: pos_embed_type={cfg.pos_embed_type!r:.100}; it is 'sincos' or None")
        if cfg.use_pos_embed and cfg.pos_embed_type and cfg.pos_embed_max_size is None:
            raise ConfigError(f"{name}: pos_embed_max_size=None (an uncropped position embedding) is not supported; "
                              "SD 3's ControlNets set it")
        cfg.check_blocks(name)
        return cfg

    @property
    def control_channels(self):
        """The channels of its control latents (`controlnet_cond`)."""
        return self.in_channels + self.extra_conditioning_channels


class SD3SingleTransformerBlock(nn.Module):
    """diffusers' SD3SingleTransformerBlock: the image tokens alone (B, N, D), adaLN-Zero, self-attention and a
    feed-forward; SD 3.5 Large's ControlNets."""

    heads: int
    head_dim: int
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x, temb):
        chunks = Dense(6 * x.shape[-1], dtype=self.dtype, name="norm1_linear")(nn.silu(temb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(chunks, 6, axis=-1)
        attention = JointAttention(self.heads, self.head_dim, qkv_bias=True, dtype=self.dtype, kernels=self.kernels,
                                   name="attn")
        x = x + gate_msa[:, None] * attention(modulate(layer_norm(x, self.dtype), shift_msa, scale_msa))
        normed = modulate(layer_norm(x, self.dtype), shift_mlp, scale_mlp)
        return x + gate_mlp[:, None] * feed_forward("ff", normed, self.dtype)


class SD3ControlNetModel(Pretrained, nn.Module):
    """(latents (B, C, H, W), or with `use_pos_embed=False` the transformer's patch tokens (B, N, D); control latents
    (B, control_channels, H, W); conditioning_scale; text states (B, T, joint_attention_dim) or None; pooled
    (B, pooled_projection_dim); timesteps (B,) or ()) -> num_layers block samples (B, N, D), each times the scale,
    as diffusers' SD3ControlNetModel.forward."""

    config: SD3ControlNetConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)
    config_class = SD3ControlNetConfig

    def dummy_inputs(self):
        cfg, p = self.config, self.config.patch_size
        x = jnp.zeros((1, cfg.in_channels, p, p)) if cfg.use_pos_embed else jnp.zeros((1, 1, cfg.inner_dim))
        context = None if cfg.joint_attention_dim is None else jnp.zeros((1, 1, cfg.joint_attention_dim))
        return (x, jnp.zeros((1, cfg.control_channels, p, p)), 1.0, context, jnp.zeros((1, cfg.pooled_projection_dim)),
                jnp.zeros((1,)))

    @nn.compact
    def __call__(self, hidden_states, controlnet_cond, conditioning_scale, encoder_hidden_states, pooled_projections,
                 timestep):
        cfg, dtype, p = self.config, self.dtype, self.config.patch_size
        nhwc = lambda x: jnp.transpose(x, (0, 2, 3, 1)).astype(dtype)  # noqa: E731
        patches = lambda name, max_size: PatchEmbed(  # noqa: E731
            p, cfg.inner_dim, max_size, cfg.sample_size // p, dtype, kernels=self.kernels, name=name)
        if cfg.use_pos_embed:
            x = patches("pos_embed", cfg.pos_embed_max_size if cfg.pos_embed_type else None)(nhwc(hidden_states))
        else:
            x = hidden_states.astype(dtype)
        temb = embed_time_and_text(timestep, pooled_projections, x.shape[0], cfg.inner_dim, dtype)
        context = None
        if cfg.joint_attention_dim is not None:
            if encoder_hidden_states is None:
                raise ValueError("this ControlNet has joint blocks (joint_attention_dim set): give "
                                 "encoder_hidden_states, the prompt's text states")
            context = Dense(cfg.caption_projection_dim, dtype=dtype, name="context_embedder")(
                encoder_hidden_states.astype(dtype))
        x = x + patches("pos_embed_input", None)(nhwc(controlnet_cond))

        samples = []
        for i in range(cfg.num_layers):
            name = f"transformer_blocks_{i}"
            if context is None:
                x = SD3SingleTransformerBlock(cfg.num_attention_heads, cfg.attention_head_dim, dtype,
                                              kernels=self.kernels, name=name)(x, temb)
            else:
                context, x = JointTransformerBlock(
                    cfg.num_attention_heads, cfg.attention_head_dim, qk_norm=cfg.qk_norm,
                    dual_attention=i in cfg.dual_attention_layers, dtype=dtype, kernels=self.kernels,
                    name=name)(x, context, temb)
            sample = Dense(cfg.inner_dim, dtype=dtype, name=f"controlnet_blocks_{i}")(x)
            samples.append(sample * jnp.asarray(conditioning_scale, jnp.float32).astype(dtype))
        return tuple(samples)
