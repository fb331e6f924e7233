"""diffusers' guiders (`diffusers.guiders`), with the same class names and constructor arguments, as pure pieces
of the one scan: `pipeline.with_guider(ClassifierFreeGuidance(guidance_scale=5.0, start=0.1))`. Each is imported on
first use (sdflax/lazy.py)."""

from ..lazy import by_module, exports

MODULES = by_module({
    ".apg": ("AdaptiveProjectedGuidance", "AdaptiveProjectedMixGuidance"),
    ".base": ("Guider",),
    ".cfg": ("ClassifierFreeGuidance", "ClassifierFreeZeroStarGuidance", "MagnitudeAwareGuidance",
             "TangentialClassifierFreeGuidance"),
    ".fdg": ("FrequencyDecoupledGuidance",),
    ".names": ("GUIDERS", "guider_from_name"),
    ".perturbed": ("AutoGuidance", "LayerSkipConfig", "PerturbedAttentionGuidance", "SkipLayerGuidance",
                   "SmoothedEnergyGuidance", "SmoothedEnergyGuidanceConfig"),
})
__getattr__, __dir__ = exports(__name__, MODULES)
__all__ = sorted(MODULES)
