"""Noise schedulers as pure functions, matching diffusers: PNDM (Liu et al. 2022), DDIM (Song et al. 2021), Euler and
Euler ancestral (Karras et al. 2022), LMS, and DPM-Solver++ 2M (Lu et al. 2022); DDPM (Ho et al. 2020), LCM (Luo et al.
2023) and TCD (Zheng et al. 2024); UniPC (Zhao et al. 2023), DEIS (Zhang & Chen 2023), DPM-Solver++ 2M SDE and
3M SDE (Lu et al. 2022; Crowson's k-diffusion); the two-evaluation Heun (Karras et al. 2022), DPM2 and DPM2
ancestral (k-diffusion), DPM++ 2S ancestral and DPM++ SDE (Lu et al. 2022); CFG++ (Chung et al. 2024) for Euler,
Euler a and DPM++ 2M; Euler on a rectified flow (Esser et al. 2024, Stable Diffusion 3). Each follows `Scheduler`
(protocol.py); `scheduler.check_steps(n)` raises early for a step count `set_timesteps(n)` would refuse, and
`scheduler.with_schedule(timesteps=, sigmas=)` runs a given schedule (`AYS_SCHEDULES`: Align Your Steps')."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from ..lazy import by_module, exports
from . import names

MODULES = by_module({
    ".cfg_pp": ("DPMPP2MCFGPPScheduler", "EulerAncestralCFGPPScheduler", "EulerCFGPPScheduler"),
    ".ddim": ("DDIMConfig", "DDIMScheduler", "DDIMState"),
    ".ddpm": ("DDPMConfig", "DDPMScheduler", "DDPMState"),
    ".deis": ("DEISConfig", "DEISScheduler", "DEISState"),
    ".dpm2": ("DPM2AncestralConfig", "DPM2AncestralScheduler", "DPM2Config", "DPM2Scheduler", "DPM2State"),
    ".dpm_solver": ("DPMSolverConfig", "DPMSolverScheduler", "DPMSolverState", "DPMPP2MSDEConfig",
                    "DPMPP2MSDEScheduler"),
    ".dpmpp_2s_ancestral": ("DPMpp2SAncestralConfig", "DPMpp2SAncestralScheduler", "DPMpp2SAncestralState"),
    ".dpmpp_3m_sde": ("DPMPP3MSDEConfig", "DPMPP3MSDEScheduler", "DPMPP3MSDEState"),
    ".dpmpp_sde": ("DPMSolverSDEConfig", "DPMSolverSDEScheduler", "DPMSolverSDEState"),
    ".euler": ("EulerConfig", "EulerScheduler", "EulerState"),
    ".euler_ancestral": ("EulerAncestralConfig", "EulerAncestralScheduler", "EulerAncestralState"),
    ".flow_match_euler": ("FlowMatchEulerConfig", "FlowMatchEulerScheduler", "FlowMatchEulerState"),
    ".heun": ("HeunConfig", "HeunScheduler", "HeunState"),
    ".lcm": ("LCMConfig", "LCMScheduler", "LCMState"),
    ".lms": ("LMSConfig", "LMSScheduler", "LMSState"),
    ".pndm": ("PNDMConfig", "PNDMScheduler", "PNDMState"),
    ".protocol": ("Scheduler", "SchedulerState"),
    ".sigma_schedules": ("AYS_SCHEDULES",),
    ".tcd": ("TCDConfig", "TCDScheduler", "TCDState"),
    ".unipc": ("UniPCConfig", "UniPCScheduler", "UniPCState"),
})
__getattr__, __dir__ = exports(__name__, MODULES)


class Registry(Mapping):
    """A name -> scheduler class mapping whose classes are imported when read: choosing one scheduler loads one
    module."""

    def __init__(self, class_names: Mapping[str, str]):
        self.class_names = dict(class_names)

    def __getitem__(self, name):
        return __getattr__(self.class_names[name])

    def __iter__(self):
        return iter(self.class_names)

    def __len__(self):
        return len(self.class_names)


SCHEDULERS = Registry({
    "pndm": "PNDMScheduler",
    "ddim": "DDIMScheduler",
    "euler": "EulerScheduler",
    "euler_ancestral": "EulerAncestralScheduler",
    "dpmpp_2m": "DPMSolverScheduler",
    "lms": "LMSScheduler",
    "heun": "HeunScheduler",
    "dpm2": "DPM2Scheduler",
    "dpm2_ancestral": "DPM2AncestralScheduler",
    "dpmpp_2s_ancestral": "DPMpp2SAncestralScheduler",
    "dpmpp_sde": "DPMSolverSDEScheduler",
    "ddpm": "DDPMScheduler",
    "lcm": "LCMScheduler",
    "tcd": "TCDScheduler",
    "dpmpp_2m_sde": "DPMPP2MSDEScheduler",
    "dpmpp_3m_sde": "DPMPP3MSDEScheduler",
    "unipc": "UniPCScheduler",
    "deis": "DEISScheduler",
    "euler_cfg_pp": "EulerCFGPPScheduler",
    "euler_ancestral_cfg_pp": "EulerAncestralCFGPPScheduler",
    "dpmpp_2m_cfg_pp": "DPMPP2MCFGPPScheduler",
    "flow_match_euler": "FlowMatchEulerScheduler",
})

# diffusers' class names (`_class_name` in scheduler_config.json), and their Flax twins where they existed.
DIFFUSERS_NAMES = Registry({
    "PNDMScheduler": "PNDMScheduler",
    "DDIMScheduler": "DDIMScheduler",
    "EulerDiscreteScheduler": "EulerScheduler",
    "EulerAncestralDiscreteScheduler": "EulerAncestralScheduler",
    "DPMSolverMultistepScheduler": "DPMSolverScheduler",
    "LMSDiscreteScheduler": "LMSScheduler",
    "HeunDiscreteScheduler": "HeunScheduler",
    "KDPM2DiscreteScheduler": "DPM2Scheduler",
    "KDPM2AncestralDiscreteScheduler": "DPM2AncestralScheduler",
    "DPMSolverSDEScheduler": "DPMSolverSDEScheduler",
    "DDPMScheduler": "DDPMScheduler",
    "LCMScheduler": "LCMScheduler",
    "TCDScheduler": "TCDScheduler",
    "UniPCMultistepScheduler": "UniPCScheduler",
    "DEISMultistepScheduler": "DEISScheduler",
    "FlowMatchEulerDiscreteScheduler": "FlowMatchEulerScheduler",
})

_BY_NAME = {name.lower(): cls for name, cls in SCHEDULERS.class_names.items()}  # -> the class's name
for _name, _cls in DIFFUSERS_NAMES.class_names.items():
    _BY_NAME[_name.lower()] = _cls  # EulerDiscreteScheduler
    _BY_NAME["flax" + _name.lower()] = _cls  # FlaxEulerDiscreteScheduler
for _cls in SCHEDULERS.class_names.values():
    _BY_NAME[_cls.lower()] = _cls  # EulerScheduler


def scheduler_from_config(config: Mapping[str, Any], kind: str | None = None,
                          overrides: Mapping[str, Any] | None = None):
    """Build a scheduler from a diffusers scheduler_config.json dict; `kind` defaults to its `_class_name`. `kind`
    may be sdflax's name ("dpmpp_2m"), a diffusers class name, or an A1111 name ("DPM++ 2M Karras", whose values
    replace the config's: "Euler" means no Karras σ, where sdflax's "euler" keeps the config's choice; with a
    flow-matching config, as SD 3's, "Euler" is the flow's Euler); `overrides` replace both."""
    if kind is None:
        kind = config.get("_class_name")
    kind_given = kind
    a1111_spelling = kind in names.SAMPLERS or str(kind).lower() not in _BY_NAME
    a1111 = names.resolve(kind, SCHEDULERS) if a1111_spelling else None
    if a1111 is not None:
        kind, values = a1111
        config = {**config, **values}
    flow_model = str(config.get("_class_name", "")).lower() == "flowmatcheulerdiscretescheduler"
    config = {**config, **(overrides or {})}
    cls_name = _BY_NAME.get(str(kind).lower())
    if flow_model and a1111 is not None and cls_name == "EulerScheduler":
        cls_name = "FlowMatchEulerScheduler"  # A1111's and Forge's "Euler" on a flow model (SD 3.x): the flow's Euler
        if config.get("align_your_steps"):  # its levels are SD 1.x's and SDXL's σ (up to 14.6); a flow's σ end at 1
            raise ValueError(f"scheduler {kind_given!r}: Align Your Steps' noise levels are SD 1.x's and SDXL's, not "
                             "a flow model's (SD 3.x): use Euler, or Euler with Karras, Exponential, Beta or KL "
                             "Optimal")
    if cls_name is None:
        raise ValueError(f"unknown scheduler {kind!r}; known: {', '.join(sorted(SCHEDULERS))}, diffusers' class "
                         f"names, or A1111's ({', '.join(names.SAMPLERS)}, each optionally followed by "
                         f"{', '.join(names.SIGMA_SCHEDULES)} or {names.SGM_UNIFORM})")
    cls = __getattr__(cls_name)
    config_class = typing.get_type_hints(cls)["config"]
    known = {field.name for field in dataclasses.fields(config_class)} | set(getattr(config_class, "unsupported", {}))
    if unknown := sorted(set(overrides or {}) - known):  # a checkpoint's own keys may be other tools'; a user's not
        raise ValueError(f"scheduler_config: {cls.__name__} takes no {', '.join(map(repr, unknown))} (a misspelling? "
                         f"it would be ignored); its settings: {', '.join(sorted(known))}")
    return cls.from_config(config)


def a1111_name(scheduler) -> str | None:
    """A1111's name for a scheduler ("DPM++ 2M Karras"), None where A1111 has none."""
    return names.a1111_name(scheduler, SCHEDULERS)


__all__ = sorted({*MODULES, "DIFFUSERS_NAMES", "SCHEDULERS", "a1111_name", "scheduler_from_config"})
