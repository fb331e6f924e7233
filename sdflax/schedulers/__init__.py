"""Noise schedulers as pure functions: PNDM (Liu et al. 2022) and DDIM (Song et al. 2021), matching diffusers."""

from __future__ import annotations

from typing import Any, Mapping

from .ddim import DDIMConfig, DDIMScheduler, DDIMState
from .pndm import PNDMConfig, PNDMScheduler, PNDMState

SCHEDULERS = {"pndm": PNDMScheduler, "ddim": DDIMScheduler}

_BY_NAME = {name.lower(): cls for name, cls in SCHEDULERS.items()}
for _cls in SCHEDULERS.values():
    _BY_NAME[_cls.__name__.lower()] = _cls  # PNDMScheduler
    _BY_NAME["flax" + _cls.__name__.lower()] = _cls  # FlaxPNDMScheduler


def scheduler_from_config(config: Mapping[str, Any], kind: str | None = None):
    """Build a scheduler from a diffusers scheduler_config.json dict; `kind` defaults to its `_class_name`."""
    if kind is None:
        kind = config.get("_class_name")
    cls = _BY_NAME.get(str(kind).lower())
    if cls is None:
        raise ValueError(f"unknown scheduler {kind!r}; known: {sorted(_BY_NAME)}")
    return cls.from_config(config)


__all__ = [
    "DDIMConfig",
    "DDIMScheduler",
    "DDIMState",
    "PNDMConfig",
    "PNDMScheduler",
    "PNDMState",
    "SCHEDULERS",
    "scheduler_from_config",
]
