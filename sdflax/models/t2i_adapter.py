"""T2IAdapter: a small ResNet that turns a control image (sketch, depth, pose, ...) into one feature map per UNet
encoder level, which the UNet adds to its own features (Mou et al. 2023, "T2I-Adapter"), as diffusers builds it: the
full adapter (SD 1.x / 2.x), its SDXL variant and the light adapter. `combine_adapter_states` is diffusers'
MultiAdapter: several adapters' features, weighted and summed per level."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from .config import ConfigError, config_from_dict, config_source
from .layers import Kernels, conv, resolve_kernels
from .pretrained import Pretrained

ADAPTER_TYPES = ("full_adapter", "full_adapter_xl", "light_adapter")


@dataclasses.dataclass(frozen=True)
class T2IAdapterConfig:
    """diffusers' T2IAdapter config.json: the control image's channels, each level's width, the residual blocks per
    level, the pixel unshuffle's factor and the architecture."""

    in_channels: int = 3
    channels: tuple = (320, 640, 1280, 1280)
    num_res_blocks: int = 2
    downscale_factor: int = 8
    adapter_type: str = "full_adapter"

    @classmethod
    def from_dict(cls, config):
        cfg = config_from_dict(cls, config)
        problem = cfg.problem()
        if problem:
            raise ConfigError(f"{config_source(config)}T2IAdapterConfig: {problem}")
        return cfg

    def problem(self) -> str | None:
        """What makes this config no adapter diffusers can build and run, or None."""
        if self.adapter_type not in ADAPTER_TYPES:
            return f"adapter_type={self.adapter_type!r:.100}; it is one of {', '.join(ADAPTER_TYPES)}"
        if not self.channels or any(c <= 0 for c in self.channels):
            return f"channels={list(self.channels)}; it needs one positive width per level"
        if self.downscale_factor < 1:
            return f"downscale_factor={self.downscale_factor}; it is a positive pixel unshuffle factor"
        if self.adapter_type == "light_adapter" and min(self.channels) < 4:
            return f"channels={list(self.channels)}; a light adapter's blocks work at a quarter width, so each is >= 4"
        if self.adapter_type == "full_adapter_xl":
            # diffusers' XL blocks from the fourth on keep their input's width: a change there cannot run.
            for i in range(3, len(self.channels)):
                if self.channels[i] != self.channels[i - 1]:
                    return (f"channels={list(self.channels)}; a full_adapter_xl's levels from the fourth on keep the "
                            f"width before them (channels[{i}] = channels[{i - 1}])")
        return None

    @property
    def total_downscale_factor(self):
        """Control-image pixels per pixel of the last (smallest) feature map, as diffusers counts them."""
        levels = len(self.channels)
        doublings = {"full_adapter": levels - 1, "full_adapter_xl": 1, "light_adapter": levels}[self.adapter_type]
        return self.downscale_factor * 2 ** doublings

    def blocks(self):
        """(width, halves the size first) per level, as diffusers' FullAdapter / FullAdapterXL / LightAdapter."""
        c = self.channels
        if self.adapter_type == "full_adapter":
            return [(width, i > 0) for i, width in enumerate(c)]
        if self.adapter_type == "full_adapter_xl":
            return [(width, i == 2) for i, width in enumerate(c)]
        return [(c[0], False), *((width, True) for width in c[1:]), (c[-1], True)]


def pixel_unshuffle(x, factor):
    """torch's nn.PixelUnshuffle: (B, C, H*r, W*r) -> (B, C*r*r, H, W), channel c*r*r + i*r + j holding the pixels
    at offset (i, j) of each r x r patch."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // factor, factor, w // factor, factor)
    return x.transpose(0, 1, 3, 5, 2, 4).reshape(b, c * factor * factor, h // factor, w // factor)


def average_pool_ceil(x):
    """torch's AvgPool2d(2, stride=2, ceil_mode=True) on NHWC: an odd side's last window holds one row or column,
    and is the mean of what it holds."""
    b, h, w, c = x.shape
    pad = ((0, 0), (0, h % 2), (0, w % 2), (0, 0))
    out_h, out_w = (h + 1) // 2, (w + 1) // 2
    sums = jnp.pad(x, pad).reshape(b, out_h, 2, out_w, 2, c).sum((2, 4), dtype=jnp.float32)
    counts = np.pad(np.ones((h, w), np.float32), pad[1:3]).reshape(out_h, 2, out_w, 2).sum((1, 3))
    return (sums / counts[:, :, None]).astype(x.dtype)


class AdapterBlock(nn.Module):
    """One level: a 2x2 average pool when it halves the size, then diffusers' AdapterBlock (a 1x1 in_conv when the
    width changes, residual blocks of a 3x3 conv, ReLU and a 1x1 conv) or LightAdapterBlock (1x1 convs into and out
    of a quarter width, residual blocks of two 3x3 convs)."""

    width: int
    down: bool
    num_res_blocks: int
    light: bool
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x):
        convolution = lambda features, kernel, name: conv(features, kernel, name=name, dtype=self.dtype,  # noqa: E731
                                                          kernels=self.kernels)
        if self.down:
            x = average_pool_ceil(x)
        inner = self.width // 4 if self.light else self.width
        if self.light or x.shape[-1] != self.width:
            x = convolution(inner, 1, "in_conv")(x)
        for j in range(self.num_res_blocks):
            h = nn.relu(convolution(inner, 3, f"resnets_{j}_block1")(x))
            x = x + convolution(inner, 3 if self.light else 1, f"resnets_{j}_block2")(h)
        return convolution(self.width, 1, "out_conv")(x) if self.light else x


class T2IAdapter(Pretrained, nn.Module):
    """Features for the UNet's encoder from a control image (B, in_channels, H, W) in [0, 1], H and W multiples of
    `downscale_factor` (the image is pixel-unshuffled by it first).

    `apply(params, image)` -> a tuple of NCHW features, one per level, as diffusers' T2IAdapter returns them:
    full_adapter: channels[i] at 1 / (downscale_factor * 2**i) of the image's size (a size halves rounding up);
    full_adapter_xl: the first two levels at 1 / downscale_factor, the rest at half that; light_adapter:
    len(channels) + 1 levels, the last repeating the last width at half the size before it.
    """

    config: T2IAdapterConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)
    config_class = T2IAdapterConfig

    @property
    def downscale_factor(self):
        """The first pixel unshuffle's factor: the image's sides are multiples of it."""
        return self.config.downscale_factor

    @property
    def total_downscale_factor(self):
        return self.config.total_downscale_factor

    def dummy_inputs(self):
        side = self.config.downscale_factor
        return (jnp.zeros((1, self.config.in_channels, side, side)),)

    @nn.compact
    def __call__(self, image):
        cfg, dtype = self.config, self.dtype
        if problem := cfg.problem():
            raise ValueError(f"T2IAdapterConfig: {problem}")
        if image.ndim != 4 or image.shape[1] != cfg.in_channels:
            raise ValueError(f"image {tuple(image.shape)}: this T2IAdapter takes (B, {cfg.in_channels}, H, W) images")
        if image.shape[2] % cfg.downscale_factor or image.shape[3] % cfg.downscale_factor:
            raise ValueError(f"image {tuple(image.shape)}: its height and width must be multiples of the adapter's "
                             f"downscale_factor {cfg.downscale_factor}; resize it")
        x = jnp.transpose(pixel_unshuffle(image.astype(dtype), cfg.downscale_factor), (0, 2, 3, 1))  # -> NHWC
        if cfg.adapter_type != "light_adapter":
            x = conv(cfg.channels[0], name="adapter_conv_in", dtype=dtype, kernels=self.kernels)(x)
        features = []
        for i, (width, down) in enumerate(cfg.blocks()):
            x = AdapterBlock(width, down, cfg.num_res_blocks, cfg.adapter_type == "light_adapter", dtype,
                             kernels=self.kernels, name=f"adapter_body_{i}")(x)
            features.append(jnp.transpose(x, (0, 3, 1, 2)))  # NHWC -> NCHW
        return tuple(features)


def combine_adapter_states(states_list, weights=None):
    """diffusers' MultiAdapter on its adapters' outputs: per level, the sum of each adapter's feature times its
    weight (default 1/n each), in the features' dtype. Adapters combine only when their features have one shape
    per level: the same levels, widths and downscale factors, on images of one size."""
    n = len(states_list)
    if n < 2:
        raise ValueError(f"combine_adapter_states: {n} adapters' features; it combines two or more (use one "
                         "adapter's features as they are)")
    weights = [1 / n] * n if weights is None else weights
    if np.shape(weights) != (n,):
        raise ValueError(f"combine_adapter_states: weights of shape {np.shape(weights)} for {n} adapters; give "
                         "one weight per adapter")
    shapes = [tuple(tuple(feature.shape) for feature in states) for states in states_list]
    for i, adapter_shapes in enumerate(shapes[1:], 1):
        if adapter_shapes != shapes[0]:
            raise ValueError(f"combine_adapter_states: adapter {i}'s features are {list(adapter_shapes)}, adapter "
                             f"0's {list(shapes[0])}; combine adapters with the same levels, widths and downscale "
                             "factors, on images of one size")
    weights = jnp.asarray(weights, jnp.float32)
    combined = []
    for level in zip(*states_list):
        total = weights[0] * level[0]
        for weight, feature in zip(weights[1:], level[1:]):
            total = total + weight * feature
        combined.append(total.astype(level[0].dtype))
    return tuple(combined)
