"""The UNet surgery of the guiders that perturb layers (`sdflax.guiders.perturbed`): which layers their configs
name, and the perturbations applied there to one chunk of the UNet's batch.

A config picks layers as diffusers' hooks pick them: `fqn` names a list of modules by its checkpoint name
("mid_block.attentions.0.transformer_blocks", "mid_block.attentions", "up_blocks") and `indices` its entries; the
perturbation applies under each `{fqn}.{i}`: to its self-attention layers (scores replaced by the identity, the
layer skipped, the queries smoothed), to its feed-forwards, or, attention and feed-forward skipped, to the
transformer block `{fqn}.{i}` whole. diffusers' `fqn="auto"`, which the `*_layers` arguments use, finds such lists
in DiT models only: on a UNet diffusers raises, and sdflax says what to write instead.

Attention is perturbed at the hook points every hook sees (`attend`, `queries`); whole blocks, self-attention
layers and feed-forwards are skipped by intercepting the UNet's modules (`wrap_unet`), which have no hook point.
On SD 3's transformer (`fqn="transformer_blocks"`) diffusers' "self-attention" is every attention of a block, the
joint one (`attn`) and SD 3.5 Medium's second (`attn2`): identity scores give the values of the whole [image; text]
sequence, a skipped attention gives both streams' inputs, SEG smooths the image stream's queries before the
RMSNorm, a skipped feed-forward is `ff` and `ff_context`, and a skipped block passes both streams.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from ..models.flux import FluxTransformer2DModel
from ..models.flux_blocks import FluxSingleTransformerBlock
from ..models.layers import Attention
from ..models.mmdit import SD3Transformer2DModel
from ..models.mmdit_blocks import JointAttention, JointTransformerBlock
from ..models.unet import BasicTransformerBlock, UNet2DConditionModel
from .core import LayerError, checkpoint_name, layer_list, self_attention_names

__all__ = ["LayerSkipConfig", "PerturbedLayers", "SmoothedEnergyGuidanceConfig", "layer_configs",
           "smoothed_queries"]

EXAMPLE_STACK = "mid_block.attentions.0.transformer_blocks"


class LayerConfig:
    """What diffusers' layer configs share: `indices` of the list of modules `fqn` names, and dict round trips."""

    def __post_init__(self):
        indices = (self.indices,) if isinstance(self.indices, int) else tuple(self.indices)
        if not indices or not all(isinstance(i, int) for i in indices):
            raise ValueError(f"indices={indices!r:.60}: give entries of the list `fqn` names, e.g. [0] or [0, 2]")
        object.__setattr__(self, "indices", indices)

    @classmethod
    def from_dict(cls, data):
        return cls(**data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LayerSkipConfig(LayerConfig):
    """diffusers' LayerSkipConfig: what to skip under the modules `{fqn}.{i}`, i in `indices`. `dropout` must be
    1.0: diffusers' other values drop outputs at random with torch's generator."""

    indices: tuple
    fqn: str = "auto"
    skip_attention: bool = True
    skip_attention_scores: bool = False
    skip_ff: bool = True
    dropout: float = 1.0

    def kinds(self) -> tuple:
        if self.skip_attention and self.skip_ff:
            return ("block",)
        return tuple(kind for kind, on in (("attention", self.skip_attention), ("scores", self.skip_attention_scores),
                                           ("ff", self.skip_ff)) if on)


@dataclasses.dataclass(frozen=True)
class SmoothedEnergyGuidanceConfig(LayerConfig):
    """diffusers' SmoothedEnergyGuidanceConfig: the queries of the self-attention layers under `{fqn}.{i}` are
    smoothed. A UNet's query projection is `to_q`, diffusers' default (None)."""

    indices: tuple
    fqn: str = "auto"
    _query_proj_identifiers: Any = None

    def __post_init__(self):
        super().__post_init__()
        if self._query_proj_identifiers is not None:
            if "to_q" not in self._query_proj_identifiers:
                raise ValueError(f"_query_proj_identifiers={self._query_proj_identifiers!r:.60} names no query "
                                 "projection of a UNet: leave it None (to_q)")
            object.__setattr__(self, "_query_proj_identifiers", tuple(self._query_proj_identifiers))

    def kinds(self) -> tuple:
        return ("blur",)


def layer_configs(kind, layers, given, layers_argument, config_argument):
    """A guider's `*_config` argument (one config, a dict, diffusers' own config, or a list of them) as a tuple
    of `kind`; `layers` (diffusers' `*_layers`, which use fqn="auto") refused. The arguments' names are for the
    errors."""
    example = f"{config_argument}={kind.__name__}(indices=[0], fqn='{EXAMPLE_STACK}')"
    if layers is not None:
        raise ValueError(f"{layers_argument}={layers!r:.40}: diffusers looks these indices up in a DiT's list of "
                         f"transformer blocks (fqn='auto'), which a UNet has not (diffusers raises); name the list: "
                         f"{example}")
    if given is None:
        raise ValueError(f"{config_argument}: give {example} (or a list of such configs)")
    items = given if isinstance(given, (list, tuple)) else [given]
    items = [item.to_dict() if hasattr(item, "to_dict") and not isinstance(item, kind) else item for item in items]
    items = tuple(item if isinstance(item, kind) else kind.from_dict(item) for item in items)
    for item in items:
        if item.fqn == "auto":
            raise ValueError(f"{config_argument}: fqn='auto' finds transformer blocks in DiT models only (diffusers "
                             f"raises on a UNet); name the list of modules, e.g. {example}")
        if isinstance(item, LayerSkipConfig) and item.dropout != 1.0:
            raise ValueError(f"{config_argument}: dropout={item.dropout} drops outputs at random in diffusers (torch's "
                             "F.dropout in training mode), which sdflax does not reproduce: use dropout=1.0 (skip)")
        if isinstance(item, LayerSkipConfig) and item.skip_attention and item.skip_attention_scores:
            raise ValueError(f"{config_argument}: skip_attention and skip_attention_scores are both True: choose one")
    return items


def replace_chunk(x, chunks, index, new):
    """A (chunks * B, ...) array with chunk `index`'s rows replaced by `new` (B, ...). The layers run on every
    row, so that other hooks see the chunks they expect."""
    parts = jnp.split(x, chunks)
    parts[index] = new.astype(x.dtype)
    return jnp.concatenate(parts)


def in_unet(module) -> bool:
    """Whether `module` belongs to the denoiser, a UNet or SD 3's or Flux's transformer (not to a ControlNet, whose
    layers have the same names)."""
    while isinstance(module.parent, nn.Module):
        module = module.parent
    return isinstance(module, (UNet2DConditionModel, SD3Transformer2DModel, FluxTransformer2DModel))


@dataclasses.dataclass(frozen=True)
class PerturbedLayers:
    """The layers `configs` name, perturbed on chunk `chunk` of the UNet's `chunks`; `setting` is the argument
    that named them, for the errors. `query_blur` is SEG's (σ, threshold) of the smoothed queries, traced."""

    configs: tuple
    setting: str
    chunks: int
    chunk: int
    query_blur: tuple | None = None

    def layers(self) -> tuple:
        """(module name, kinds) for each entry the configs name."""
        return tuple((f"{config.fqn}.{i}", config.kinds()) for config in self.configs for i in config.indices)

    def perturbs(self, kind, name) -> bool:
        return any(kind in kinds and (name == prefix or name.startswith(prefix + "."))
                   for prefix, kinds in self.layers())

    def check_layers(self, sites):
        stacks = {name.rsplit(".", 2)[0] for name in self_attention_names(sites)}
        for prefix, kinds in self.layers():
            if not any(name.startswith(prefix + ".") for name in sites):
                raise LayerError(f"{self.setting}: {prefix!r:.80} is no module of this UNet with attention "
                                 f"layers in it: give fqn and indices of a list such as {layer_list(stacks)}")
            if "block" in kinds and prefix + ".attn1" not in sites and prefix + ".attn" not in sites:
                raise LayerError(f"{self.setting}: {prefix!r:.80} is no transformer block, which skipping both "
                                 f"attention and feed-forward skips: give fqn of a list such as {layer_list(stacks)}")

    def queries(self, site, q):
        """The queries as to_q gives them, this chunk's smoothed."""
        if not (site.perturbable and self.perturbs("blur", site.name)):
            return q
        own = jnp.split(q, site.chunks)[self.chunk]
        return replace_chunk(q, site.chunks, self.chunk, smoothed_queries(own, *self.query_blur))

    def attend(self, site, attend, q, k, v):
        """The hook point's attention, with this chunk's scores the identity."""
        out = attend(q, k, v)
        if site.perturbable and self.perturbs("scores", site.name):  # identity scores: each token gives its value
            out = replace_chunk(out, site.chunks, self.chunk, jnp.split(v, site.chunks)[self.chunk])
        return out

    def wrap_unet(self, unet_fn):
        """`unet_fn` with the skipped modules intercepted, or as it is where the configs skip none."""
        skips = {kind for _, kinds in self.layers() for kind in kinds} & {"attention", "ff", "block"}
        if not skips:
            return unet_fn

        def perturbed(*args, **kwargs):
            with nn.intercept_methods(functools.partial(self.skip_layers, {})):
                return unet_fn(*args, **kwargs)

        return perturbed

    def skip_layers(self, ff_inputs, next_fun, args, kwargs, context):
        """The interceptor of the UNet's modules that skips them on the perturbed chunk: a transformer block or a
        self-attention layer gives its input (an MMDiT's: each stream its own), a feed-forward its input (kept from
        its first Dense, `*_net_0_proj`, for its last, `*_net_2`)."""
        module, chunks, index = context.module, self.chunks, self.chunk
        if context.method_name != "__call__" or not in_unet(module):
            return next_fun(*args, **kwargs)
        name = checkpoint_name(module.path)

        def passed(out, given):  # the chunk's rows of `out` replaced by those of the input `given`
            return out if out is None else replace_chunk(out, chunks, index, jnp.split(given, chunks)[index])

        if isinstance(module, (JointTransformerBlock, FluxSingleTransformerBlock)) and self.perturbs("block", name):
            # (context, x): both streams pass
            context, x = next_fun(*args, **kwargs)
            return passed(context, args[1]), passed(x, args[0])  # the last block's context is None
        if isinstance(module, JointAttention) and self.perturbs("attention", name):
            out = next_fun(*args, **kwargs)  # (x, context) of the joint attention, x of attn2
            if isinstance(out, tuple):
                return passed(out[0], args[0]), passed(out[1], args[1])
            return passed(out, args[0])
        if (isinstance(module, BasicTransformerBlock) and self.perturbs("block", name)
                or isinstance(module, Attention) and name.endswith("attn1") and self.perturbs("attention", name)):
            return passed(next_fun(*args, **kwargs), args[0])
        block = checkpoint_name(module.path[:-1])
        feed_forward, _, layer = (module.name or "").partition("_net_")  # ff or an MMDiT's ff_context; 0_proj or 2
        if feed_forward in ("ff", "ff_context") and layer in ("0_proj", "2") and self.perturbs("ff", block):
            key = f"{block}.{feed_forward}"
            if layer == "0_proj":
                ff_inputs[key] = args[0]
                return next_fun(*args, **kwargs)
            return passed(next_fun(*args, **kwargs), ff_inputs.pop(key))
        return next_fun(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def reflect_taps(size: int):
    """(offsets, taps): diffusers' widest kernel on an axis of `size` (size + 1 - size % 2 wide, odd) and taps[o, i, j]
    = 1 where entry i's tap at offset o reads entry j of the axis reflect-padded (F.pad's "reflect")."""
    half = (size - (size % 2 - 1)) // 2
    offsets = np.arange(-half, half + 1)
    read = np.arange(size)[None, :] + offsets[:, None]
    read = np.where(read < 0, -read, np.where(read > size - 1, 2 * (size - 1) - read, read))
    taps = np.zeros((len(offsets), size, size), np.float32)
    taps[np.arange(len(offsets))[:, None], np.arange(size)[None, :], read] = 1.0
    return offsets.astype(np.float32), taps


def smoothed_queries(q, sigma, threshold):
    """SEG's smoothing of (B, T, heads, d) queries as diffusers' `_gaussian_blur_2d` computes it, its branches as
    documented: the first s² tokens (s = ⌊√T⌋) as an s × s image, each channel blurred by a Gaussian of `sigma`
    (kernel ⌈6σ⌉ + 1 rounded to odd, at most s + 1 - s % 2; reflect padding), or replaced by its mean where
    sigma > threshold. `sigma` and `threshold` are traced."""
    b, t, heads, d = q.shape
    s = int(math.sqrt(t))
    image = q[:, :s * s].reshape(b, s, s, heads, d).astype(jnp.float32)
    offsets, taps = reflect_taps(s)
    sigma = jnp.asarray(sigma, jnp.float32)
    width = jnp.ceil(6 * sigma)
    width = jnp.minimum(width + 1 - width % 2, len(offsets))
    weights = jnp.where(jnp.abs(offsets) <= (width - 1) / 2, jnp.exp(-0.5 * jnp.square(offsets / sigma)), 0.0)
    blur = jnp.einsum("o,oij->ij", weights / weights.sum(), taps)
    blurred = jnp.einsum("ij,bjk...,lk->bil...", blur, image, blur)
    mean = jnp.broadcast_to(image.mean((1, 2), keepdims=True), image.shape)
    smoothed = jnp.where(sigma > threshold, mean, blurred).astype(q.dtype)
    return jnp.concatenate([smoothed.reshape(b, s * s, heads, d), q[:, s * s:]], axis=1)
