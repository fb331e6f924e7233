"""Guiders by name, with their arguments in words a command line can carry: `guider_from_name("apg",
momentum=-0.5)` is `AdaptiveProjectedGuidance(adaptive_projected_guidance_momentum=-0.5)`, and a layer config
as "FQN:INDICES" (`guider_from_name("pag", config="mid_block.attentions.0.transformer_blocks:0")`)."""

from __future__ import annotations

from .apg import AdaptiveProjectedGuidance, AdaptiveProjectedMixGuidance
from .base import arguments
from .cfg import (ClassifierFreeGuidance, ClassifierFreeZeroStarGuidance, MagnitudeAwareGuidance,
                  TangentialClassifierFreeGuidance)
from .fdg import FrequencyDecoupledGuidance
from .perturbed import AutoGuidance, PerturbedAttentionGuidance, SkipLayerGuidance, SmoothedEnergyGuidance

GUIDERS = {
    "cfg": ClassifierFreeGuidance,
    "apg": AdaptiveProjectedGuidance,
    "apg_mix": AdaptiveProjectedMixGuidance,
    "cfg_zero_star": ClassifierFreeZeroStarGuidance,
    "tcfg": TangentialClassifierFreeGuidance,
    "mag": MagnitudeAwareGuidance,
    "fdg": FrequencyDecoupledGuidance,
    "pag": PerturbedAttentionGuidance,
    "seg": SmoothedEnergyGuidance,
    "slg": SkipLayerGuidance,
    "autoguidance": AutoGuidance,
}


def guider_class(name: str):
    """A short name ("apg") or diffusers' class name ("AdaptiveProjectedGuidance") -> the class."""
    by_class = {cls.__name__.lower(): cls for cls in GUIDERS.values()}
    cls = GUIDERS.get(name.lower().replace("-", "_")) or by_class.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown guider {name!r:.60}: one of {', '.join(GUIDERS)} (or diffusers' class names)")
    return cls


def argument_name(cls, key: str) -> str:
    """The constructor argument `key` names: itself, or the one argument whose name ends in `_key`
    ("momentum" -> "adaptive_projected_guidance_momentum")."""
    fields = arguments(cls)
    if key in fields:
        return key
    matches = [name for name in fields if name.endswith("_" + key)]
    if len(matches) != 1:
        problem = "matches several" if matches else "is not one"
        raise ValueError(f"{cls.__name__}: {key!r:.60} {problem} of its arguments: "
                         f"{', '.join(matches or fields)}")
    return matches[0]


def guider_from_name(name: str, **arguments):
    """The guider `name` names, with `arguments` by their names or unique name endings."""
    cls = guider_class(name)
    resolved = {}
    for key, value in arguments.items():
        full = argument_name(cls, key)
        if full in resolved:
            raise ValueError(f"{cls.__name__}: {full} given twice")
        resolved[full] = layer_config(cls, full, value) if isinstance(value, str) else value
    try:
        return cls(**resolved)
    except TypeError as e:
        raise ValueError(f"{cls.__name__}: {e}") from None


def layer_config(cls, name: str, text: str) -> dict:
    """A layer config's words, "FQN" or "FQN:I,J" (indices 0 by default) -> {"fqn": FQN, "indices": [I, J]}: what
    the guiders that perturb layers take as `*_config`. Only those arguments take words."""
    fqn, _, indices = text.partition(":")
    parts = [part.strip() for part in indices.split(",")] if indices else ["0"]
    if not name.endswith("_config") or not fqn or not all(part.lstrip("-").isdigit() for part in parts):
        what = ("a layer list and its indices, e.g. mid_block.attentions.0.transformer_blocks:0"
                if name.endswith("_config") else "a number, true, false, none or numbers separated by commas")
        raise ValueError(f"{cls.__name__}: {name}={text!r:.60}: expected {what}")
    return {"fqn": fqn.strip(), "indices": [int(part) for part in parts]}
