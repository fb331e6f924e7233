"""Guiders by name, with their arguments in words a command line can carry: `guider_from_name("apg",
momentum=-0.5)` is `AdaptiveProjectedGuidance(adaptive_projected_guidance_momentum=-0.5)`."""

from __future__ import annotations

import dataclasses

from .apg import AdaptiveProjectedGuidance, AdaptiveProjectedMixGuidance
from .cfg import (ClassifierFreeGuidance, ClassifierFreeZeroStarGuidance, MagnitudeAwareGuidance,
                  TangentialClassifierFreeGuidance)
from .fdg import FrequencyDecoupledGuidance

GUIDERS = {
    "cfg": ClassifierFreeGuidance,
    "apg": AdaptiveProjectedGuidance,
    "apg_mix": AdaptiveProjectedMixGuidance,
    "cfg_zero_star": ClassifierFreeZeroStarGuidance,
    "tcfg": TangentialClassifierFreeGuidance,
    "mag": MagnitudeAwareGuidance,
    "fdg": FrequencyDecoupledGuidance,
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
    fields = [f.name for f in dataclasses.fields(cls)]
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
        resolved[full] = value
    try:
        return cls(**resolved)
    except TypeError as e:
        raise ValueError(f"{cls.__name__}: {e}") from None
