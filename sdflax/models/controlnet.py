"""ControlNetModel: a trainable copy of the UNet's encoder that reads a condition image (edges, depth, pose, ...) and
gives residuals for the UNet's skips and mid block (Zhang et al. 2023, "Adding Conditional Control to Text-to-Image
Diffusion Models"), as diffusers builds it."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from .config import ConfigError, config_source
from .layers import Kernels, conv, resolve_kernels
from .pretrained import Pretrained
from .unet import UNetEncoder, UNetEncoderConfig

CHANNEL_ORDERS = ("rgb", "bgr")


@dataclasses.dataclass(frozen=True)
class ControlNetConfig(UNetEncoderConfig):
    """The UNet encoder's fields, and the condition image's: its channels, its encoder's widths, its order."""

    conditioning_channels: int = 3
    conditioning_embedding_out_channels: tuple = (16, 32, 96, 256)
    controlnet_conditioning_channel_order: str = "rgb"  # "bgr": the image's channels are flipped first
    global_pool_conditions: bool = False  # residuals averaged over space (the shuffle ControlNet)

    @classmethod
    def from_dict(cls, config):
        cfg = super().from_dict(config)
        if cfg.controlnet_conditioning_channel_order not in CHANNEL_ORDERS:
            raise ConfigError(f"{config_source(config)}ControlNetConfig: controlnet_conditioning_channel_order="
                              f"{cfg.controlnet_conditioning_channel_order!r:.100}; it is 'rgb' or 'bgr'")
        if not cfg.conditioning_embedding_out_channels:
            raise ConfigError(f"{config_source(config)}ControlNetConfig: conditioning_embedding_out_channels is empty; "
                              "the condition encoder needs at least one level")
        return cfg

    @property
    def condition_scale(self):
        """Condition-image pixels per latent: the condition encoder's stride-2 convs, 2 ** (levels - 1)."""
        return 2 ** (len(self.conditioning_embedding_out_channels) - 1)


class ControlNetConditioningEmbedding(nn.Module):
    """The condition encoder E(c) (§3.2): the image (B, H, W, C) down to latent size, 3x3 convs with SiLU (one at
    stride 2 per level), then conv_out, a zero convolution at the start of training, to conv_in's channels."""

    channels: tuple
    out_channels: int
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x):
        convolution = lambda features, name, stride=1: conv(features, stride=stride, name=name,  # noqa: E731
                                                            dtype=self.dtype, kernels=self.kernels)
        x = nn.silu(convolution(self.channels[0], "conv_in")(x))
        for i, (c_in, c_out) in enumerate(zip(self.channels[:-1], self.channels[1:])):
            x = nn.silu(convolution(c_in, f"blocks_{2 * i}")(x))
            x = nn.silu(convolution(c_out, f"blocks_{2 * i + 1}", stride=2)(x))
        return convolution(self.out_channels, "conv_out")(x)


class ControlNetModel(UNetEncoder, Pretrained, nn.Module):
    """Residuals for the UNet from latents (B, C, h, w), timesteps (B,) or (), text states (B, T, D) and a condition
    image `controlnet_cond` (B, conditioning_channels, H, W) in [0, 1], H = h * config.condition_scale.

    `apply(params, sample, timesteps, encoder_hidden_states, controlnet_cond, conditioning_scale=1.0,
    text_embeds=None, time_ids=None, guess_mode=False)` -> (down, mid): `down` one NCHW array per UNet skip
    connection, in the order of the UNet's `down_block_additional_residuals`, and `mid` the NCHW
    `mid_block_additional_residual`. Each is a zero convolution (1x1) of the copied encoder's features (§3.1),
    times `conditioning_scale` (traced). `guess_mode` (static) scales them from 0.1 (the first skip) to 1 (the mid
    block) on a log scale, as diffusers does for ControlNets run without a prompt. SDXL ControlNets
    (`addition_embed_type="text_time"`) take `text_embeds` and `time_ids` as the UNet does.
    """

    config: ControlNetConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)
    config_class = ControlNetConfig
    def dummy_inputs(self):
        cfg = self.config
        pixels = 2 ** (len(cfg.block_out_channels) - 1) * cfg.condition_scale
        return super().dummy_inputs(jnp.zeros((1, cfg.conditioning_channels, pixels, pixels)), 1.0)

    def _condition_encoder(self, **kwargs):
        cfg = self.config
        return ControlNetConditioningEmbedding(cfg.conditioning_embedding_out_channels, cfg.block_out_channels[0],
                                               self.dtype, kernels=self.kernels, **kwargs)

    @nn.compact
    def __call__(self, sample, timesteps, encoder_hidden_states, controlnet_cond, conditioning_scale=1.0,
                 text_embeds=None, time_ids=None, guess_mode=False):
        cfg, dtype, kernels = self.config, self.dtype, self.kernels
        if controlnet_cond.shape[1] != cfg.conditioning_channels:
            raise ValueError(f"controlnet_cond {tuple(controlnet_cond.shape)}: this ControlNet takes "
                             f"{cfg.conditioning_channels}-channel images, NCHW")
        context = encoder_hidden_states.astype(dtype)
        temb = self.embed_time(timesteps, sample.shape[0], text_embeds, time_ids)

        x = conv(cfg.block_out_channels[0], name="conv_in", dtype=dtype, kernels=kernels)(
            jnp.transpose(sample, (0, 2, 3, 1)).astype(dtype))  # NCHW -> NHWC
        image = jnp.transpose(controlnet_cond, (0, 2, 3, 1)).astype(dtype)
        if cfg.controlnet_conditioning_channel_order == "bgr":
            image = image[..., ::-1]
        condition = self._condition_encoder(name="controlnet_cond_embedding")(image)
        if condition.shape[1:3] != x.shape[1:3]:
            raise ValueError(f"controlnet_cond {tuple(controlnet_cond.shape)} encodes to {condition.shape[1]}x"
                             f"{condition.shape[2]}, the latents are {x.shape[1]}x{x.shape[2]}: the condition image "
                             f"is {cfg.condition_scale} times the latents' size (the picture's size)")
        x, skips = self.down_blocks(x + condition, temb, context)
        x = self.mid_block(x, temb, context)

        zero_conv = lambda features, name: conv(features, kernel=1, name=name, dtype=dtype,  # noqa: E731
                                                kernels=kernels)
        outputs = [zero_conv(skip.shape[-1], f"controlnet_down_blocks_{i}")(skip) for i, skip in enumerate(skips)]
        outputs.append(zero_conv(x.shape[-1], "controlnet_mid_block")(x))
        scale = jnp.reshape(conditioning_scale, jnp.shape(conditioning_scale) + (1, 1, 1))  # () or (B,)
        if guess_mode and not cfg.global_pool_conditions:
            scales = jnp.logspace(-1, 0, len(outputs), dtype=jnp.float32)
        else:
            scales = jnp.ones(len(outputs), jnp.float32)
        outputs = [out * (s * scale).astype(dtype) for out, s in zip(outputs, scales)]
        if cfg.global_pool_conditions:  # diffusers' (B, C, 1, 1) means, broadcast as the UNet's sum would
            outputs = [jnp.broadcast_to(out.mean((1, 2), keepdims=True, dtype=jnp.float32).astype(dtype), out.shape)
                       for out in outputs]
        outputs = [jnp.transpose(out, (0, 3, 1, 2)) for out in outputs]  # NHWC -> NCHW
        return tuple(outputs[:-1]), outputs[-1]

    @classmethod
    def from_single_file(cls, path, config=None, dtype=jnp.float32, attention="auto", revision=None):
        """(controlnet, params) from a ControlNet file in the original layout (control_v11p_sd15_canny.pth or
        .safetensors; ControlNet 1.0 files' `control_model.*`). The architecture is read off the tensors for SD
        1.x / 2.x nets; `config` (a diffusers ControlNet folder or hub id) gives it otherwise (SDXL nets, the
        shuffle net's global pooling). Pickled .pth files are read without running their code."""
        from ..loading.single_file import load_controlnet

        return load_controlnet(cls, path, config, dtype, attention, revision)

    @classmethod
    def from_unet(cls, unet, conditioning_channels=3, conditioning_embedding_out_channels=(16, 32, 96, 256)):
        """A ControlNet shaped as `unet`'s encoder (its config, dtype and kernels); its params start from
        `params_from_unet`."""
        fields = {f.name: getattr(unet.config, f.name) for f in dataclasses.fields(UNetEncoderConfig)}
        config = ControlNetConfig(**fields, conditioning_channels=conditioning_channels,
                                  conditioning_embedding_out_channels=tuple(conditioning_embedding_out_channels))
        return cls(config, dtype=unet.dtype, kernels=unet.kernels)

    def params_from_unet(self, unet_params, seed=0):
        """The params training starts from (§3.1): the UNet's encoder weights copied, the zero convolutions
        (controlnet_down_blocks, controlnet_mid_block, the condition encoder's conv_out) at zero, so the ControlNet
        first adds nothing, and the condition encoder's other convs drawn as torch draws them (diffusers' from_unet):
        U(±1/√fan_in), from numpy's generator for `seed` (host-side, no compile)."""
        unet_params = traverse_util.flatten_dict(unet_params.get("params", unet_params))
        shapes = traverse_util.flatten_dict(self.param_shapes())
        rng = np.random.default_rng(seed)
        params = {}
        for path, shape in shapes.items():
            if path[0] == "controlnet_cond_embedding" and path[1] != "conv_out":
                kernel = shapes[(*path[:-1], "kernel")].shape  # (3, 3, in, out)
                bound = 1 / np.sqrt(np.prod(kernel[:-1]))
                value = rng.uniform(-bound, bound, shape.shape)
            elif path[0].startswith("controlnet_"):
                value = np.zeros(shape.shape)
            elif path not in unet_params or unet_params[path].shape != shape.shape:
                found = "missing" if path not in unet_params else f"of shape {unet_params[path].shape}"
                raise ValueError(f"unet_params: {'/'.join(path)} is {found}, the ControlNet needs {shape.shape}; "
                                 "are these the params of the UNet it was made from?")
            else:
                value = unet_params[path]
            params[path] = jnp.asarray(value, self.dtype)  # as from_pretrained loads them
        return traverse_util.unflatten_dict(params)
