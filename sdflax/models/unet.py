"""UNet2DConditionModel: the Stable Diffusion 1.x / 2.x / XL denoiser (Rombach et al. 2022; Podell et al. 2023),
as diffusers builds it."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from .config import ConfigError, config_from_dict, config_source
from .pretrained import Pretrained
from .layers import (Attention, Dense, Downsample2D, GroupNorm, Kernels, LayerNorm, ResnetBlock2D, Upsample2D, conv,
                     resolve_kernels, timestep_embedding)

# The blocks sdflax builds; diffusers' others (Simple*, KDownBlock2D, AttnDownBlock2D, ...) compute otherwise.
DOWN_BLOCK_TYPES = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCK_TYPES = ("CrossAttnUpBlock2D", "UpBlock2D")


@dataclasses.dataclass(frozen=True)
class UNetEncoderConfig:
    """The fields of the UNet's encoder half (timestep embedding, conv_in, down blocks, mid block), which the UNet
    and ControlNet share."""

    in_channels: int = 4
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple = ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)
    block_out_channels: tuple = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    downsample_padding: int = 1
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int = 1280
    transformer_layers_per_block: int | tuple = 1
    attention_head_dim: int | tuple = 8
    num_attention_heads: int | tuple | None = None
    use_linear_projection: bool = False
    upcast_attention: bool = False
    # SDXL's micro-conditioning: the pooled text embedding and sinusoidally embedded size/crop ids, through
    # an MLP added to the timestep embedding.
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    projection_class_embeddings_input_dim: int | None = None

    block_types = (("down_block_types", DOWN_BLOCK_TYPES),)  # the config keys naming blocks, and what they may be

    @classmethod
    def from_dict(cls, config):
        cfg = config_from_dict(cls, config, unsupported=_UNSUPPORTED)
        name = config_source(config) + cls.__name__
        for key, supported in cls.block_types:
            types = getattr(cfg, key)
            unknown = [t for t in types if t not in supported]
            if unknown:
                raise ConfigError(f"{name}: {key} has {unknown[0]!r:.100}; sdflax supports "
                                  f"{', '.join(supported)}")
            if len(types) != len(cfg.block_out_channels):
                raise ConfigError(f"{name}: {len(types)} {key} for {len(cfg.block_out_channels)} "
                                  "block_out_channels; give one per block")
        if cfg.addition_embed_type not in (None, "text_time"):
            raise ConfigError(f"{name}: addition_embed_type={cfg.addition_embed_type!r}; sdflax supports only "
                              "None and 'text_time' (SDXL)")
        if cfg.addition_embed_type and not (cfg.addition_time_embed_dim and cfg.projection_class_embeddings_input_dim):
            raise ConfigError(f"{name}: addition_embed_type='text_time' needs addition_time_embed_dim and "
                              "projection_class_embeddings_input_dim")
        if any(isinstance(d, tuple) for d in cfg.per_block(cfg.transformer_layers_per_block)):
            raise ConfigError(f"{name}: transformer_layers_per_block per layer (nested lists) is not supported; "
                              "give an int or one int per block")
        return cfg

    def per_block(self, value):
        return value if isinstance(value, tuple) else (value,) * len(self.block_out_channels)

    @property
    def heads(self):
        # diffusers' historical naming: `attention_head_dim` holds the number of heads when
        # `num_attention_heads` is unset (SD 1.x: 8 heads of 40/80/160 channels).
        return self.per_block(self.num_attention_heads or self.attention_head_dim)


@dataclasses.dataclass(frozen=True)
class UNetConfig(UNetEncoderConfig):
    sample_size: int = 64
    out_channels: int = 4
    center_input_sample: bool = False
    up_block_types: tuple = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3

    block_types = (("down_block_types", DOWN_BLOCK_TYPES), ("up_block_types", UP_BLOCK_TYPES))


_UNSUPPORTED = {
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "only_cross_attention": False,
    "dual_cross_attention": False,
    "mid_block_scale_factor": 1,
    "act_fn": "silu",
    "class_embed_type": None,
    "num_class_embeds": None,
    "encoder_hid_dim": None,
    "resnet_time_scale_shift": "default",
    "resnet_skip_time_act": False,
    "resnet_out_scale_factor": 1.0,
    "time_embedding_type": "positional",
    "time_embedding_dim": None,
    "time_embedding_act_fn": None,
    "timestep_post_act": None,
    "time_cond_proj_dim": None,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "attention_type": "default",
    "cross_attention_norm": None,
    "reverse_transformer_layers_per_block": None,
    "layers_per_block_list": None,
}


class BasicTransformerBlock(nn.Module):
    """Self-attention, cross-attention to the text, GEGLU feed-forward; pre-LayerNorm, residual each."""

    heads: int
    head_dim: int
    upcast: bool
    dtype: jnp.dtype
    kernels: Kernels

    @nn.compact
    def __call__(self, x, context):
        dim = x.shape[-1]
        attn = lambda name: Attention(self.heads, self.head_dim, upcast=self.upcast, dtype=self.dtype,  # noqa: E731
                                      kernels=self.kernels, name=name)
        norm = lambda name: LayerNorm(1e-5, dtype=self.dtype, name=name)  # noqa: E731
        x = x + attn("attn1")(norm("norm1")(x))
        x = x + attn("attn2")(norm("norm2")(x), context)
        hidden, gate = jnp.split(Dense(dim * 8, dtype=self.dtype, name="ff_net_0_proj")(norm("norm3")(x)), 2, -1)
        return x + Dense(dim, dtype=self.dtype, name="ff_net_2")(hidden * nn.gelu(gate, approximate=False))


class Transformer2DModel(nn.Module):
    """GroupNorm, project in (1x1 conv or linear), transformer blocks over the H*W tokens, project out, residual."""

    heads: int
    layers: int
    config: UNetEncoderConfig
    dtype: jnp.dtype
    kernels: Kernels

    @nn.compact
    def __call__(self, x, context):
        b, h, w, c = x.shape
        linear = self.config.use_linear_projection
        project = lambda name: (Dense(c, dtype=self.dtype, name=name) if linear  # noqa: E731
                                else conv(c, kernel=1, name=name, dtype=self.dtype, kernels=self.kernels))
        hidden = GroupNorm(self.config.norm_num_groups, 1e-6, self.dtype, name="norm")(x)
        hidden = project("proj_in")(hidden).reshape(b, h * w, c)
        for i in range(self.layers):
            hidden = BasicTransformerBlock(self.heads, c // self.heads, self.config.upcast_attention, self.dtype,
                                           self.kernels, name=f"transformer_blocks_{i}")(hidden, context)
        return x + project("proj_out")(hidden.reshape(b, h, w, c))


class UNetEncoder:
    """The UNet's encoder half, mixed into the UNet and into ControlNet (its trainable copy): the timestep embedding,
    the down blocks and the mid block. Called from the model's compact `__call__`, so the submodules are the
    model's own, named as in the diffusers checkpoints. The model has `config`, `dtype` and `kernels`."""

    def dummy_inputs(self, *middle):
        """The smallest inputs: latents as deep as the down blocks go, one timestep, one text token, then `middle`
        (the model's own arguments), then SDXL's text_embeds and time_ids."""
        cfg = self.config
        size = 2 ** (len(cfg.block_out_channels) - 1)
        inputs = (jnp.zeros((1, cfg.in_channels, size, size)), jnp.zeros((1,)),
                  jnp.zeros((1, 1, cfg.cross_attention_dim)), *middle)
        if cfg.addition_embed_type:  # only the concatenated width fixes add_embedding's kernel: one time id
            text_dim = cfg.projection_class_embeddings_input_dim - cfg.addition_time_embed_dim
            inputs += (jnp.zeros((1, text_dim)), jnp.zeros((1, 1)))
        return inputs

    def block(self, cls):
        """`cls`, or its `nn.remat` when the model checkpoints gradients (training): each block's activations are
        recomputed in the backward pass instead of kept. The params tree is the same."""
        return nn.remat(cls) if getattr(self, "gradient_checkpointing", False) else cls

    def resnet(self, out, name):
        cfg = self.config
        return self.block(ResnetBlock2D)(out, cfg.norm_num_groups, cfg.norm_eps, self.dtype, kernels=self.kernels,
                                         name=name)

    def embed_time(self, timesteps, batch, text_embeds=None, time_ids=None):
        """(B,) or () timesteps -> (B, 4 * C0): MLP(sinusoidal(t)), plus SDXL's text_time embedding."""
        cfg, dtype, features = self.config, self.dtype, self.config.block_out_channels[0] * 4
        timesteps = jnp.broadcast_to(jnp.asarray(timesteps), (batch,))
        temb = timestep_embedding(timesteps, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift)
        temb = Dense(features, dtype=dtype, name="time_embedding_linear_1")(temb.astype(dtype))
        temb = Dense(features, dtype=dtype, name="time_embedding_linear_2")(nn.silu(temb))
        if cfg.addition_embed_type == "text_time":
            return temb + self._text_time_embedding(text_embeds, time_ids, features)
        if text_embeds is not None or time_ids is not None:
            raise ValueError(f"text_embeds / time_ids given, but this {type(self).__name__}'s config has no "
                             "addition_embed_type (they condition SDXL models only)")
        return temb

    def _text_time_embedding(self, text_embeds, time_ids, features):
        """diffusers' add_embedding: MLP(concat(text_embeds, sinusoidal(time_ids) per id)), SDXL's size/crop
        conditioning (Podell et al. 2023, §2.2)."""
        cfg = self.config
        if text_embeds is None or time_ids is None:
            raise ValueError(f"this {type(self).__name__} (addition_embed_type='text_time', SDXL) needs text_embeds "
                             "(B, D) and time_ids (B, n): the pooled text embedding and the size/crop ids "
                             "(StableDiffusionXL passes them)")
        time_ids = jnp.asarray(time_ids)
        time_ids = jnp.broadcast_to(time_ids, (text_embeds.shape[0], time_ids.shape[-1]))  # (n,) or (B, n)
        time_embeds = timestep_embedding(time_ids.reshape(-1), cfg.addition_time_embed_dim, cfg.flip_sin_to_cos,
                                         cfg.freq_shift).reshape(time_ids.shape[0], -1)
        expected = cfg.projection_class_embeddings_input_dim
        if text_embeds.shape[-1] + time_embeds.shape[-1] != expected:
            raise ValueError(f"text_embeds {text_embeds.shape} and {time_ids.shape[1]} time ids of "
                             f"{cfg.addition_time_embed_dim} give {text_embeds.shape[-1] + time_embeds.shape[-1]} "
                             f"features; this {type(self).__name__} expects "
                             f"projection_class_embeddings_input_dim={expected}")
        emb = jnp.concatenate([text_embeds.astype(jnp.float32), time_embeds], axis=-1).astype(self.dtype)
        emb = Dense(features, dtype=self.dtype, name="add_embedding_linear_1")(emb)
        return Dense(features, dtype=self.dtype, name="add_embedding_linear_2")(nn.silu(emb))

    def down_blocks(self, x, temb, context, until=None, intrablock=None):
        """conv_in's NHWC output -> (the deepest features, the skips): conv_in's output, each down resnet's (with
        its attention), each downsampler's, in diffusers' down_block_res_samples order. With `until` = s, only
        the layers up to skip s run (DeepCache's shallow branch). `intrablock`: a T2I-Adapter's features (a list,
        consumed here in order), one added to each down block's output as diffusers adds them: inside a
        cross-attention block before its downsampler, after a plain block (its last skip included)."""
        cfg = self.config
        heads, depths = cfg.heads, cfg.per_block(cfg.transformer_layers_per_block)
        skips = [x]
        for i, (kind, out) in enumerate(zip(cfg.down_block_types, cfg.block_out_channels)):
            for j in range(cfg.layers_per_block):
                if until is not None and len(skips) > until:
                    return x, skips
                x = self.resnet(out, f"down_blocks_{i}_resnets_{j}")(x, temb)
                if kind == "CrossAttnDownBlock2D":
                    x = self.block(Transformer2DModel)(heads[i], depths[i], cfg, self.dtype, self.kernels,
                                                       name=f"down_blocks_{i}_attentions_{j}")(x, context)
                    if j == cfg.layers_per_block - 1 and intrablock:
                        x = x + _residual(intrablock.pop(0), x, "down_intrablock_additional_residuals")
                skips.append(x)
            if i < len(cfg.block_out_channels) - 1:
                if until is not None and len(skips) > until:
                    return x, skips
                x = Downsample2D(out, cfg.downsample_padding, self.dtype, kernels=self.kernels,
                                 name=f"down_blocks_{i}_downsamplers_0")(x)
                skips.append(x)
            if kind != "CrossAttnDownBlock2D" and intrablock:  # diffusers adds it in place: to the skip too
                x = skips[-1] = x + _residual(intrablock.pop(0), x, "down_intrablock_additional_residuals")
        return x, skips

    def mid_block(self, x, temb, context):
        """resnet, transformer, resnet at the deepest level."""
        cfg = self.config
        depth = cfg.per_block(cfg.transformer_layers_per_block)[-1]
        x = self.resnet(cfg.block_out_channels[-1], "mid_block_resnets_0")(x, temb)
        x = self.block(Transformer2DModel)(cfg.heads[-1], depth, cfg, self.dtype, self.kernels,
                                           name="mid_block_attentions_0")(x, context)
        return self.resnet(cfg.block_out_channels[-1], "mid_block_resnets_1")(x, temb)


class UNet2DConditionModel(UNetEncoder, Pretrained, nn.Module):
    """eps / v prediction from noisy latents (B, C, h, w), timesteps (B,) or (), and text states (B, 77, D).

    SDXL (`addition_embed_type="text_time"`) also takes diffusers' `added_cond_kwargs` as keywords:
    `text_embeds` (B, D_pooled) and `time_ids` (B, n), e.g. (original h, w, crop top, left, target h, w).
    ControlNet's outputs enter as in diffusers, both or neither: `down_block_additional_residuals`, one (B, C, h, w)
    array per skip connection (conv_in's output, each down resnet's, each downsampler's), added to the skips once
    the down blocks are done, and `mid_block_additional_residual`, added to the mid block's output. A
    T2I-Adapter's features enter as `down_intrablock_additional_residuals`, one per down block (`down_blocks`).

    DeepCache (Ma et al. 2023, `sdflax.hooks.deep_cache`) runs the UNet by halves, through `deep` and `shallow`.
    """

    config: UNetConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)
    gradient_checkpointing: bool = False  # `block`: sdflax.train's TrainConfig.gradient_checkpointing
    config_class = UNetConfig

    def __call__(self, sample, timesteps, encoder_hidden_states, text_embeds=None, time_ids=None,
                 down_block_additional_residuals=None, mid_block_additional_residual=None,
                 down_intrablock_additional_residuals=None):
        return self._run(sample, timesteps, encoder_hidden_states, text_embeds, time_ids,
                         down_block_additional_residuals, mid_block_additional_residual,
                         down_intrablock_additional_residuals=down_intrablock_additional_residuals)[0]

    def deep(self, *inputs, branch: int, **keywords):
        """The whole UNet on `__call__`'s inputs -> (prediction, features): the NHWC features entering the up layer
        that takes skip connection `branch` (static), which `shallow` reuses."""
        return self._run(*inputs, branch=branch, **keywords)

    def shallow(self, *inputs, branch: int, features, **keywords):
        """Only the layers down to skip `branch` and up from it, `deep`'s `features` standing in for the deeper
        ones -> the prediction."""
        return self._run(*inputs, branch=branch, features=features, **keywords)[0]

    @nn.compact
    def _run(self, sample, timesteps, encoder_hidden_states, text_embeds=None, time_ids=None,
            down_block_additional_residuals=None, mid_block_additional_residual=None, branch=None, features=None,
            down_intrablock_additional_residuals=None):
        """-> (prediction, the features at `branch`); with `features`, only the shallow branch runs."""
        cfg, dtype, kernels = self.config, self.dtype, self.kernels
        shallow = features is not None
        channels = cfg.block_out_channels
        if (down_block_additional_residuals is None) != (mid_block_additional_residual is None):
            raise ValueError("down_block_additional_residuals and mid_block_additional_residual go together, as "
                             "ControlNet gives them; got only one")
        context = encoder_hidden_states.astype(dtype)
        temb = self.embed_time(timesteps, sample.shape[0], text_embeds, time_ids)

        x = jnp.transpose(sample, (0, 2, 3, 1)).astype(dtype)  # NCHW -> NHWC
        if cfg.center_input_sample:
            x = 2 * x - 1.0
        x = conv(channels[0], name="conv_in", dtype=dtype, kernels=kernels)(x)
        intrablock = down_intrablock_additional_residuals
        intrablock = None if intrablock is None else list(intrablock)  # consumed in order by the down blocks
        x, skips = self.down_blocks(x, temb, context, until=branch if shallow else None, intrablock=intrablock)
        if down_block_additional_residuals is not None:
            if not shallow and len(down_block_additional_residuals) != len(skips):
                raise ValueError(f"down_block_additional_residuals: expected {len(skips)} arrays, one per skip "
                                 f"connection, got {len(down_block_additional_residuals)}")
            skips = [skip + _residual(r, skip, f"down_block_additional_residuals[{i}]")
                     for i, (skip, r) in enumerate(zip(skips, down_block_additional_residuals))]

        if not shallow:
            x = self.mid_block(x, temb, context)
            if intrablock and tuple(intrablock[0].shape[2:]) == x.shape[1:3] and intrablock[0].shape[1] == x.shape[3]:
                x = x + _residual(intrablock.pop(0), x, "down_intrablock_additional_residuals")  # T2I-Adapter-XL's
            if mid_block_additional_residual is not None:
                x = x + _residual(mid_block_additional_residual, x, "mid_block_additional_residual")

        up_heads = cfg.heads[::-1]
        up_depths = cfg.per_block(cfg.transformer_layers_per_block)[::-1]
        # the up layers in order, k = 0, 1, ...: layer k takes skip n - 1 - k; DeepCache's features enter at `entry`
        n = len(cfg.up_block_types) * (cfg.layers_per_block + 1)
        if branch is not None and not 0 <= branch < n:
            raise ValueError(f"branch {branch}: this UNet's skip connections are 0 to {n - 1} (DeepCache's branch "
                             "names one)")
        entry = None if branch is None else n - 1 - branch
        k = 0
        for i, (kind, out) in enumerate(zip(cfg.up_block_types, channels[::-1])):
            for j in range(cfg.layers_per_block + 1):
                k += 1
                if shallow and k - 1 < entry:  # a deep layer: its output is in the cached features
                    continue
                if k - 1 == entry:  # the deep layers' output: cached here, or taken from the cache
                    x, features = (features, features) if shallow else (x, x)
                x, skip = self.up_inputs(x, skips.pop(), i)
                x = self.resnet(out, f"up_blocks_{i}_resnets_{j}")(jnp.concatenate([x, skip], axis=-1), temb)
                if kind == "CrossAttnUpBlock2D":
                    x = self.block(Transformer2DModel)(up_heads[i], up_depths[i], cfg, dtype, kernels,
                                                       name=f"up_blocks_{i}_attentions_{j}")(x, context)
            if i < len(channels) - 1 and not (shallow and k - 1 < entry):
                x = Upsample2D(out, dtype, kernels=kernels, name=f"up_blocks_{i}_upsamplers_0")(x, skips[-1].shape[1:3])

        x = nn.silu(GroupNorm(cfg.norm_num_groups, cfg.norm_eps, dtype, name="conv_norm_out")(x))
        x = conv(cfg.out_channels, name="conv_out", dtype=dtype, kernels=kernels)(x)
        x = jnp.transpose(x, (0, 3, 1, 2))  # NHWC -> NCHW
        return x, features

    def up_inputs(self, x, skip, block):
        """What an up layer of up block `block` concatenates: the backbone features x and the skip connection's,
        both NHWC. A hook point of `sdflax.hooks` (FreeU rescales both here)."""
        return x, skip


def _residual(residual, target, name):
    """An NCHW residual as the NHWC `target`'s summand: transposed, in its dtype, after a shape check."""
    expected = (target.shape[0], target.shape[3], *target.shape[1:3])
    if tuple(jnp.shape(residual)) != expected:
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(jnp.shape(residual))}")
    return jnp.transpose(residual, (0, 2, 3, 1)).astype(target.dtype)
