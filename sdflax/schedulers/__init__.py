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
from typing import Any, Mapping

from .cfg_pp import DPMPP2MCFGPPScheduler, EulerAncestralCFGPPScheduler, EulerCFGPPScheduler
from .ddim import DDIMConfig, DDIMScheduler, DDIMState
from .ddpm import DDPMConfig, DDPMScheduler, DDPMState
from .deis import DEISConfig, DEISScheduler, DEISState
from .dpm2 import DPM2AncestralConfig, DPM2AncestralScheduler, DPM2Config, DPM2Scheduler, DPM2State
from .dpm_solver import DPMSolverConfig, DPMSolverScheduler, DPMSolverState
from .dpm_solver import DPMPP2MSDEConfig, DPMPP2MSDEScheduler
from .dpmpp_2s_ancestral import DPMpp2SAncestralConfig, DPMpp2SAncestralScheduler, DPMpp2SAncestralState
from .dpmpp_3m_sde import DPMPP3MSDEConfig, DPMPP3MSDEScheduler, DPMPP3MSDEState
from .dpmpp_sde import DPMSolverSDEConfig, DPMSolverSDEScheduler, DPMSolverSDEState
from .euler import EulerConfig, EulerScheduler, EulerState
from .euler_ancestral import EulerAncestralConfig, EulerAncestralScheduler, EulerAncestralState
from .flow_match_euler import FlowMatchEulerConfig, FlowMatchEulerScheduler, FlowMatchEulerState
from .heun import HeunConfig, HeunScheduler, HeunState
from .lcm import LCMConfig, LCMScheduler, LCMState
from .lms import LMSConfig, LMSScheduler, LMSState
from .pndm import PNDMConfig, PNDMScheduler, PNDMState
from . import names
from .protocol import Scheduler, SchedulerState
from .sigma_schedules import AYS_SCHEDULES
from .tcd import TCDConfig, TCDScheduler, TCDState
from .unipc import UniPCConfig, UniPCScheduler, UniPCState

SCHEDULERS = {
    "pndm": PNDMScheduler,
    "ddim": DDIMScheduler,
    "euler": EulerScheduler,
    "euler_ancestral": EulerAncestralScheduler,
    "dpmpp_2m": DPMSolverScheduler,
    "lms": LMSScheduler,
    "heun": HeunScheduler,
    "dpm2": DPM2Scheduler,
    "dpm2_ancestral": DPM2AncestralScheduler,
    "dpmpp_2s_ancestral": DPMpp2SAncestralScheduler,
    "dpmpp_sde": DPMSolverSDEScheduler,
    "ddpm": DDPMScheduler,
    "lcm": LCMScheduler,
    "tcd": TCDScheduler,
    "dpmpp_2m_sde": DPMPP2MSDEScheduler,
    "dpmpp_3m_sde": DPMPP3MSDEScheduler,
    "unipc": UniPCScheduler,
    "deis": DEISScheduler,
    "euler_cfg_pp": EulerCFGPPScheduler,
    "euler_ancestral_cfg_pp": EulerAncestralCFGPPScheduler,
    "dpmpp_2m_cfg_pp": DPMPP2MCFGPPScheduler,
    "flow_match_euler": FlowMatchEulerScheduler,
}

# diffusers' class names (`_class_name` in scheduler_config.json), and their Flax twins where they existed.
DIFFUSERS_NAMES = {
    "PNDMScheduler": PNDMScheduler,
    "DDIMScheduler": DDIMScheduler,
    "EulerDiscreteScheduler": EulerScheduler,
    "EulerAncestralDiscreteScheduler": EulerAncestralScheduler,
    "DPMSolverMultistepScheduler": DPMSolverScheduler,
    "LMSDiscreteScheduler": LMSScheduler,
    "HeunDiscreteScheduler": HeunScheduler,
    "KDPM2DiscreteScheduler": DPM2Scheduler,
    "KDPM2AncestralDiscreteScheduler": DPM2AncestralScheduler,
    "DPMSolverSDEScheduler": DPMSolverSDEScheduler,
    "DDPMScheduler": DDPMScheduler,
    "LCMScheduler": LCMScheduler,
    "TCDScheduler": TCDScheduler,
    "UniPCMultistepScheduler": UniPCScheduler,
    "DEISMultistepScheduler": DEISScheduler,
    "FlowMatchEulerDiscreteScheduler": FlowMatchEulerScheduler,
}

_BY_NAME = {name.lower(): cls for name, cls in SCHEDULERS.items()}
for _name, _cls in DIFFUSERS_NAMES.items():
    _BY_NAME[_name.lower()] = _cls  # EulerDiscreteScheduler
    _BY_NAME["flax" + _name.lower()] = _cls  # FlaxEulerDiscreteScheduler
for _cls in SCHEDULERS.values():
    _BY_NAME[_cls.__name__.lower()] = _cls  # EulerScheduler


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
    cls = _BY_NAME.get(str(kind).lower())
    if flow_model and a1111 is not None and cls is EulerScheduler:
        cls = FlowMatchEulerScheduler  # A1111's and Forge's "Euler" on a flow model (SD 3.x): the flow's Euler
        if config.get("align_your_steps"):  # its levels are SD 1.x's and SDXL's σ (up to 14.6); a flow's σ end at 1
            raise ValueError(f"scheduler {kind_given!r}: Align Your Steps' noise levels are SD 1.x's and SDXL's, not "
                             "a flow model's (SD 3.x): use Euler, or Euler with Karras, Exponential, Beta or KL "
                             "Optimal")
    if cls is None:
        raise ValueError(f"unknown scheduler {kind!r}; known: {', '.join(sorted(SCHEDULERS))}, diffusers' class "
                         f"names, or A1111's ({', '.join(names.SAMPLERS)}, each optionally followed by "
                         f"{', '.join(names.SIGMA_SCHEDULES)} or {names.SGM_UNIFORM})")
    config_class = typing.get_type_hints(cls)["config"]
    known = {field.name for field in dataclasses.fields(config_class)} | set(getattr(config_class, "unsupported", {}))
    if unknown := sorted(set(overrides or {}) - known):  # a checkpoint's own keys may be other tools'; a user's not
        raise ValueError(f"scheduler_config: {cls.__name__} takes no {', '.join(map(repr, unknown))} (a misspelling? "
                         f"it would be ignored); its settings: {', '.join(sorted(known))}")
    return cls.from_config(config)


def a1111_name(scheduler) -> str | None:
    """A1111's name for a scheduler ("DPM++ 2M Karras"), None where A1111 has none."""
    return names.a1111_name(scheduler, SCHEDULERS)


__all__ = [
    "AYS_SCHEDULES",
    "DPMPP2MCFGPPScheduler",
    "EulerAncestralCFGPPScheduler",
    "EulerCFGPPScheduler",
    "DDIMConfig",
    "DDIMScheduler",
    "DDIMState",
    "DDPMConfig",
    "DDPMScheduler",
    "DDPMState",
    "DEISConfig",
    "DEISScheduler",
    "DEISState",
    "DPM2AncestralConfig",
    "DPM2AncestralScheduler",
    "DPM2Config",
    "DPM2Scheduler",
    "DPM2State",
    "DPMPP2MSDEConfig",
    "DPMPP2MSDEScheduler",
    "DPMPP3MSDEConfig",
    "DPMPP3MSDEScheduler",
    "DPMPP3MSDEState",
    "DPMSolverConfig",
    "DPMSolverScheduler",
    "DPMSolverSDEConfig",
    "DPMSolverSDEScheduler",
    "DPMSolverSDEState",
    "DPMSolverState",
    "DPMpp2SAncestralConfig",
    "DPMpp2SAncestralScheduler",
    "DPMpp2SAncestralState",
    "EulerAncestralConfig",
    "EulerAncestralScheduler",
    "EulerAncestralState",
    "EulerConfig",
    "EulerScheduler",
    "EulerState",
    "FlowMatchEulerConfig",
    "FlowMatchEulerScheduler",
    "FlowMatchEulerState",
    "HeunConfig",
    "HeunScheduler",
    "HeunState",
    "LCMConfig",
    "LCMScheduler",
    "LCMState",
    "LMSConfig",
    "LMSScheduler",
    "LMSState",
    "PNDMConfig",
    "PNDMScheduler",
    "PNDMState",
    "SCHEDULERS",
    "Scheduler",
    "SchedulerState",
    "TCDConfig",
    "TCDScheduler",
    "TCDState",
    "UniPCConfig",
    "UniPCScheduler",
    "UniPCState",
    "a1111_name",
    "scheduler_from_config",
]
