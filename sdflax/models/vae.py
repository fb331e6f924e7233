"""AutoencoderKL: the Stable Diffusion VAE (Kingma & Welling 2014; Rombach et al. 2022), encoder and decoder."""

from __future__ import annotations

import dataclasses

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import config_from_dict
from .pretrained import Pretrained
from .layers import (Downsample2D, GroupNorm, Kernels, ResnetBlock2D, Upsample2D, conv, multi_head_attention,
                     resolve_kernels)


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    sample_size: int = 512
    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 4
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None  # SD 3.x: latents are (z - shift) * scale for the denoiser (pipelines apply it)
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True
    force_upcast: bool = True

    @classmethod
    def from_dict(cls, config):
        levels = len(config_from_dict(cls, config).block_out_channels)  # the values checked first
        return config_from_dict(cls, config, unsupported={
            "act_fn": "silu",
            "down_block_types": ("DownEncoderBlock2D",) * levels,
            "up_block_types": ("UpDecoderBlock2D",) * levels,
            "latents_mean": None,
            "latents_std": None,
        })

    @property
    def scale_factor(self):
        """Pixels per latent: 2 ** (levels - 1)."""
        return 2 ** (len(self.block_out_channels) - 1)


@flax.struct.dataclass
class DiagonalGaussian:
    """q(z | x) = N(mean, exp(logvar)), NCHW."""

    mean: jax.Array
    logvar: jax.Array

    @property
    def std(self):
        return jnp.exp(0.5 * self.logvar)

    def sample(self, key):
        return self.mean + self.std * jax.random.normal(key, self.mean.shape, self.mean.dtype)

    def mode(self):
        return self.mean


class SpatialSelfAttention(nn.Module):
    """x + attention(GroupNorm(x)) with one head over the H*W pixels: diffusers' VAE `Attention` (group_norm,
    to_q/to_k/to_v with bias, to_out_0)."""

    groups: int
    dtype: jnp.dtype
    kernels: Kernels

    @nn.compact
    def __call__(self, x):  # (B, H, W, C)
        b, h, w, c = x.shape
        tokens = GroupNorm(self.groups, 1e-6, self.dtype, name="group_norm")(x).reshape(b, h * w, c)
        out = multi_head_attention(tokens, tokens, 1, c, qkv_bias=True, upcast=True, dtype=self.dtype,
                                   kernels=self.kernels)
        return x + out.reshape(x.shape)


class MidBlock(nn.Module):
    """ResNet, single-head self-attention over all pixels, ResNet."""

    config: VAEConfig
    dtype: jnp.dtype
    kernels: Kernels

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        c = x.shape[-1]
        resnet = lambda name: ResnetBlock2D(c, cfg.norm_num_groups, 1e-6, self.dtype, kernels=self.kernels,  # noqa
                                            name=name)
        x = resnet("resnets_0")(x)
        if cfg.mid_block_add_attention:
            x = SpatialSelfAttention(cfg.norm_num_groups, self.dtype, self.kernels, name="attentions_0")(x)
        return resnet("resnets_1")(x)


class Encoder(nn.Module):
    config: VAEConfig
    dtype: jnp.dtype
    kernels: Kernels

    @nn.compact
    def __call__(self, x):  # (B, H, W, 3) -> (B, H/f, W/f, 2 * latent)
        cfg, dtype, kernels = self.config, self.dtype, self.kernels
        x = conv(cfg.block_out_channels[0], name="conv_in", dtype=dtype, kernels=kernels)(x)
        for i, out in enumerate(cfg.block_out_channels):
            for j in range(cfg.layers_per_block):
                x = ResnetBlock2D(out, cfg.norm_num_groups, 1e-6, dtype, kernels=kernels,
                                  name=f"down_blocks_{i}_resnets_{j}")(x)
            if i < len(cfg.block_out_channels) - 1:
                x = Downsample2D(out, 0, dtype, kernels=kernels, name=f"down_blocks_{i}_downsamplers_0")(x)
        x = MidBlock(cfg, dtype, kernels, name="mid_block")(x)
        x = nn.silu(GroupNorm(cfg.norm_num_groups, 1e-6, dtype, name="conv_norm_out")(x))
        return conv(2 * cfg.latent_channels, name="conv_out", dtype=dtype, kernels=kernels)(x)


class Decoder(nn.Module):
    config: VAEConfig
    dtype: jnp.dtype
    kernels: Kernels

    @nn.compact
    def __call__(self, z):  # (B, h, w, latent) -> (B, h*f, w*f, 3)
        cfg, dtype, kernels = self.config, self.dtype, self.kernels
        channels = cfg.block_out_channels[::-1]
        x = conv(channels[0], name="conv_in", dtype=dtype, kernels=kernels)(z)
        x = MidBlock(cfg, dtype, kernels, name="mid_block")(x)
        for i, out in enumerate(channels):
            for j in range(cfg.layers_per_block + 1):
                x = ResnetBlock2D(out, cfg.norm_num_groups, 1e-6, dtype, kernels=kernels,
                                  name=f"up_blocks_{i}_resnets_{j}")(x)
            if i < len(channels) - 1:
                x = Upsample2D(out, dtype, kernels=kernels, name=f"up_blocks_{i}_upsamplers_0")(x)
        x = nn.silu(GroupNorm(cfg.norm_num_groups, 1e-6, dtype, name="conv_norm_out")(x))
        return conv(cfg.out_channels, name="conv_out", dtype=dtype, kernels=kernels)(x)


class AutoencoderKL(Pretrained, nn.Module):
    """`encode`: image (B, 3, H, W) in [-1, 1] -> DiagonalGaussian over latents (B, 4, H/f, W/f).
    `decode`: latents (B, 4, H/f, W/f) -> image (B, 3, H, W), raw decoder output (about [-1, 1]).
    Latents here are unscaled: multiply samples by `config.scaling_factor` for the UNet, as diffusers does."""

    config: VAEConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)
    # the pipelines decode pictures past `config.sample_size` in blended tiles (`vae.clone(tiling=True)`, diffusers'
    # `enable_tiling()`; sdflax.pipeline.vae.tiled_decode)
    tiling: bool = False
    config_class = VAEConfig

    def dummy_inputs(self):
        size = self.config.scale_factor
        return (jnp.zeros((1, self.config.in_channels, size, size)),)

    def setup(self):
        cfg = self.config
        self.encoder = Encoder(cfg, self.dtype, self.kernels)
        self.decoder = Decoder(cfg, self.dtype, self.kernels)
        one_by_one = lambda features: conv(features, kernel=1, dtype=self.dtype, kernels=self.kernels)  # noqa: E731
        self.quant_conv = one_by_one(2 * cfg.latent_channels) if cfg.use_quant_conv else None
        self.post_quant_conv = one_by_one(cfg.latent_channels) if cfg.use_post_quant_conv else None

    def encode(self, images):
        moments = self.encoder(jnp.transpose(images, (0, 2, 3, 1)).astype(self.dtype))
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        moments = jnp.transpose(moments, (0, 3, 1, 2)).astype(jnp.float32)
        mean, logvar = jnp.split(moments, 2, axis=1)
        return DiagonalGaussian(mean, jnp.clip(logvar, -30.0, 20.0))

    def decode(self, latents):
        z = jnp.transpose(latents, (0, 2, 3, 1)).astype(self.dtype)
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return jnp.transpose(self.decoder(z), (0, 3, 1, 2))

    def __call__(self, images, key=None):
        posterior = self.encode(images)
        return self.decode(posterior.sample(key) if key is not None else posterior.mode())
