"""diffusers' guiders (`diffusers.guiders`), with the same class names and constructor arguments, as pure pieces
of the one scan: `pipeline.with_guider(ClassifierFreeGuidance(guidance_scale=5.0, start=0.1))`."""

from .apg import AdaptiveProjectedGuidance, AdaptiveProjectedMixGuidance
from .base import Guider
from .cfg import (ClassifierFreeGuidance, ClassifierFreeZeroStarGuidance, MagnitudeAwareGuidance,
                  TangentialClassifierFreeGuidance)
from .fdg import FrequencyDecoupledGuidance
from .names import GUIDERS, guider_from_name
from .perturbed import (AutoGuidance, LayerSkipConfig, PerturbedAttentionGuidance, SkipLayerGuidance,
                        SmoothedEnergyGuidance, SmoothedEnergyGuidanceConfig)

__all__ = ["AdaptiveProjectedGuidance", "AdaptiveProjectedMixGuidance", "AutoGuidance", "ClassifierFreeGuidance",
           "ClassifierFreeZeroStarGuidance", "FrequencyDecoupledGuidance", "GUIDERS", "Guider", "LayerSkipConfig",
           "MagnitudeAwareGuidance", "PerturbedAttentionGuidance", "SkipLayerGuidance", "SmoothedEnergyGuidance",
           "SmoothedEnergyGuidanceConfig", "TangentialClassifierFreeGuidance", "guider_from_name"]
