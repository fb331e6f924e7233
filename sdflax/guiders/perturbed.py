"""Guiders that run the UNet once more with some of its layers perturbed and move the prediction away from that
worse model: diffusers' PerturbedAttentionGuidance (PAG, Ahn et al. 2024), SmoothedEnergyGuidance (SEG, Hong 2024),
SkipLayerGuidance (SLG, SD 3.5) and AutoGuidance (Karras et al. 2024, whose worse model is the unconditional one).
Their layer configs, and the perturbations of those layers, are `sdflax.hooks.perturbed_layers`'.

The perturbed copy is one more chunk of the UNet's batch, [uncond; cond; cond perturbed]; AutoGuidance perturbs
the unconditional chunk of [uncond; cond]. Where diffusers' code departs from what its guiders describe, sdflax
follows the description and its tests compare with diffusers mended: without classifier-free guidance diffusers
runs the perturbed pass unperturbed on the unconditional inputs (PAG alone gives CFG); its SEG never blurs
(`prepare_models` does not count the batches), swaps the finite and the infinite blur (diffusers PR 14187) and
ignores `seg_blur_threshold_inf`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax.numpy as jnp

from ..hooks import pag
from ..hooks.perturbed_layers import (LayerSkipConfig, PerturbedLayers, SmoothedEnergyGuidanceConfig, layer_configs,
                                      smoothed_queries)
from .base import Guider, cfg, check_interval, off_at, positional, rescale, shown, static

__all__ = ["AutoGuidance", "LayerSkipConfig", "PerturbedAttentionGuidance", "SkipLayerGuidance",
           "SmoothedEnergyGuidance", "SmoothedEnergyGuidanceConfig", "smoothed_queries"]


@dataclasses.dataclass(frozen=True)
class Arguments:
    """The names diffusers gives a perturbing guider's own arguments: its layers and layer configs, and the scale
    and interval of its perturbed guidance (none for AutoGuidance, whose perturbed prediction is CFG's)."""

    layers: str
    config: str
    scale: str = ""
    start: str = ""
    stop: str = ""


class PerturbsLayers(Guider):
    """What the guiders here share: their configs, which layers they perturb, and diffusers' SLG `forward`. A
    subclass declares diffusers' arguments and names them in `arguments`."""

    arguments = Arguments("", "")
    config_class = LayerSkipConfig
    forced = {}  # flags the guider sets in every config, as diffusers does
    perturbed_chunk = -1  # the chunk the perturbations apply to: the conditional copy at the end
    query_blur = None  # SEG's (σ, threshold) of the smoothed queries

    def __post_init__(self):
        names, name = self.arguments, type(self).__name__
        layers, configs = getattr(self, names.layers), getattr(self, names.config)
        if layers is not None and not isinstance(layers, (int, list, tuple)):
            raise ValueError(f"{name}: {names.layers}={shown(layers)} must be None, a block index or a list of them")
        if not all(isinstance(c, (dict, self.config_class)) or hasattr(c, "to_dict")
                   for c in (configs if isinstance(configs, (list, tuple)) else [configs] * (configs is not None))):
            raise ValueError(f"{name}: {names.config}={shown(configs)} must be a {self.config_class.__name__}, a dict "
                             "of its fields, or a list of them")
        try:
            given = layer_configs(self.config_class, layers, configs, names.layers, names.config)
        except ValueError as e:  # its messages name the argument; they say which guider here
            raise ValueError(f"{name}: {e}") from None
        object.__setattr__(self, names.config, tuple(dataclasses.replace(c, **self.forced) for c in given))
        if self.extra_predictions:
            check_interval(type(self).__name__, getattr(self, names.start), getattr(self, names.stop),
                           names=(names.start, names.stop))
        super().__post_init__()

    def guide(self, pred_cond, pred_uncond, *perturbed, step, num_steps):
        """diffusers' SLG `forward`: CFG where on, plus s (ε(c) − ε_perturbed(c)) where the perturbed guidance is
        on: `int(start n) < step < int(stop n)` (strictly after the start, unlike CFG) and s ≠ 0. AutoGuidance: CFG
        from its perturbed unconditional prediction."""
        original = self.use_original_formulation
        cfg_on = self.in_interval(step, num_steps) & ~off_at(self.guidance_scale, original)
        guided = cfg(pred_cond, pred_uncond, self.guidance_scale, original)
        if not perturbed:
            return rescale(jnp.where(cfg_on, guided, pred_cond), pred_cond, self.guidance_rescale)
        names = self.arguments
        scale, start, stop = getattr(self, names.scale), getattr(self, names.start), getattr(self, names.stop)
        perturbed_on = self.perturbed_window(step, num_steps, start, stop) & (jnp.asarray(scale) != 0)
        shift = scale * (pred_cond - perturbed[0])
        alone = (pred_cond if original else perturbed[0]) + shift
        pred = jnp.where(cfg_on, jnp.where(perturbed_on, guided + shift, guided),
                         jnp.where(perturbed_on, alone, pred_cond))
        return rescale(pred, pred_cond, self.guidance_rescale)

    def perturbed_window(self, step, num_steps, start, stop):
        return (int(start * num_steps) < step) & (step < int(stop * num_steps))

    @property
    def num_chunks(self) -> int:
        return 2 + len(self.extra_predictions)

    @property
    def perturbation(self) -> PerturbedLayers:
        """The layers this guider's configs name, perturbed on its chunk of the UNet's batch."""
        return PerturbedLayers(getattr(self, self.arguments.config), self.arguments.config, self.num_chunks,
                               self.perturbed_chunk, self.query_blur)

    def check_layers(self, sites):
        self.perturbation.check_layers(sites)

    def condition(self, cond, settings):
        if not (self.enabled and self.extra_predictions):
            return cond
        return pag.with_perturbed_copy(cond, settings)

    def attend(self, site, attend, q, k, v):
        return self.perturbation.attend(site, attend, q, k, v) if self.enabled else attend(q, k, v)

    def queries(self, site, q):
        return self.perturbation.queries(site, q) if self.enabled else q

    def wrap_unet(self, unet_fn):
        return self.perturbation.wrap_unet(unet_fn) if self.enabled else unet_fn


@flax.struct.dataclass(kw_only=True)
class PerturbedAttentionGuidance(PerturbsLayers):
    """PAG: the perturbed copy's self-attention scores in the chosen layers replaced by the identity (each token
    gives its own value); ε̂ = CFG + s (ε(c) − ε_perturbed(c))."""

    guidance_scale: Any = positional(7.5)
    perturbed_guidance_scale: Any = 2.8
    perturbed_guidance_start: float = static(0.01)
    perturbed_guidance_stop: float = static(0.2)
    perturbed_guidance_layers: Any = static(None)
    perturbed_guidance_config: Any = static(None)

    extra_predictions = ("pred_cond_skip",)
    arguments = Arguments(layers="perturbed_guidance_layers", config="perturbed_guidance_config",
                          scale="perturbed_guidance_scale", start="perturbed_guidance_start",
                          stop="perturbed_guidance_stop")
    forced = dict(skip_attention=False, skip_attention_scores=True, skip_ff=False)  # diffusers' (with a warning)


@flax.struct.dataclass(kw_only=True)
class SkipLayerGuidance(PerturbsLayers):
    """SLG: the perturbed copy skips the chosen layers (LayerSkipConfig: whole transformer blocks by default);
    ε̂ = CFG + s (ε(c) − ε_skip(c))."""

    guidance_scale: Any = positional(7.5)
    skip_layer_guidance_scale: Any = 2.8
    skip_layer_guidance_start: float = static(0.01)
    skip_layer_guidance_stop: float = static(0.2)
    skip_layer_guidance_layers: Any = static(None)
    skip_layer_config: Any = static(None)

    extra_predictions = ("pred_cond_skip",)
    arguments = Arguments(layers="skip_layer_guidance_layers", config="skip_layer_config",
                          scale="skip_layer_guidance_scale", start="skip_layer_guidance_start",
                          stop="skip_layer_guidance_stop")


@flax.struct.dataclass(kw_only=True)
class PipelineSkipLayerGuidance(SkipLayerGuidance):
    """SkipLayerGuidance as diffusers' StableDiffusion3Pipeline runs it (`skip_guidance_layers=`): its window is
    n start < step < n stop unrounded, where the guider's rounds n start and n stop down."""

    def perturbed_window(self, step, num_steps, start, stop):
        return (step > num_steps * start) & (step < num_steps * stop)


@flax.struct.dataclass(kw_only=True)
class SmoothedEnergyGuidance(PerturbsLayers):
    """SEG: the perturbed copy's self-attention queries in the chosen layers blurred (`smoothed_queries`: a
    Gaussian of `seg_blur_sigma` tokens, their mean above `seg_blur_threshold_inf`);
    ε̂ = CFG + s (ε(c) − ε_seg(c))."""

    guidance_scale: Any = positional(7.5)
    seg_guidance_scale: Any = 2.8
    seg_blur_sigma: Any = 9999999.0
    seg_blur_threshold_inf: Any = 9999.0
    seg_guidance_start: float = static(0.0)
    seg_guidance_stop: float = static(1.0)
    seg_guidance_layers: Any = static(None)
    seg_guidance_config: Any = static(None)

    extra_predictions = ("pred_cond_seg",)
    positive_arguments = ("seg_blur_sigma",)  # a Gaussian of width 0 or below divides by zero
    arguments = Arguments(layers="seg_guidance_layers", config="seg_guidance_config", scale="seg_guidance_scale",
                          start="seg_guidance_start", stop="seg_guidance_stop")
    config_class = SmoothedEnergyGuidanceConfig

    @property
    def query_blur(self):
        return self.seg_blur_sigma, self.seg_blur_threshold_inf


@flax.struct.dataclass(kw_only=True)
class AutoGuidance(PerturbsLayers):
    """AutoGuidance as diffusers runs it: the unconditional prediction made by the UNet with the chosen layers
    skipped (the worse model), then CFG: ε̂ = ε_skip(∅) + s (ε(c) − ε_skip(∅))."""

    guidance_scale: Any = positional(7.5)
    auto_guidance_layers: Any = static(None)
    auto_guidance_config: Any = static(None)
    dropout: Any = static(None)  # diffusers': the dropout of the configs it makes from auto_guidance_layers

    arguments = Arguments(layers="auto_guidance_layers", config="auto_guidance_config")
    perturbed_chunk = 0  # the unconditional chunk

    def __post_init__(self):
        super().__post_init__()  # auto_guidance_layers, which dropout is for, are refused there
        if self.dropout is not None:
            raise ValueError(f"AutoGuidance: dropout={shown(self.dropout)} applies to the configs made from "
                             "auto_guidance_layers, which sdflax does not take: give it in each auto_guidance_config "
                             "(LayerSkipConfig(dropout=1.0)), or leave dropout out")
