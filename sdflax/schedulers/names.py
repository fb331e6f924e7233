"""A1111 / k-diffusion sampler names ("DPM++ 2M SDE Karras", "Euler a") <-> sdflax's schedulers and the config
values each name fixes, as diffusers' scheduler overview maps them. A name is a sampler, optionally followed by a
σ schedule ("Karras", "Exponential", "Beta") or "SGM Uniform" (trailing spacing, which turbo models need; it
differs from Stability's sgm_uniform by at most one timestep of rounding)."""

from __future__ import annotations

import dataclasses
import typing

# A1111 sampler -> (sdflax kind, the config values the name implies)
SAMPLERS = {
    "Euler": ("euler", {}),
    "Euler a": ("euler_ancestral", {}),
    "LMS": ("lms", {}),
    "Heun": ("heun", {}),
    "DPM2": ("dpm2", {}),
    "DPM2 a": ("dpm2_ancestral", {}),
    "DPM++ 2S a": ("dpmpp_2s_ancestral", {}),
    "DPM++ 2M": ("dpmpp_2m", {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "DPM++ SDE": ("dpmpp_sde", {}),
    "DPM++ 2M SDE": ("dpmpp_2m_sde", {"solver_type": "midpoint"}),
    "DPM++ 2M SDE Heun": ("dpmpp_2m_sde", {"solver_type": "heun"}),
    "DPM++ 3M SDE": ("dpmpp_3m_sde", {}),
    "UniPC": ("unipc", {}),
    "DEIS": ("deis", {}),  # diffusers' DEISMultistepScheduler; A1111 has none
    "DDIM": ("ddim", {}),
    "PLMS": ("pndm", {"skip_prk_steps": True}),
    "DDPM": ("ddpm", {}),
    "LCM": ("lcm", {}),
    "TCD": ("tcd", {}),
}
SIGMA_SCHEDULES = {"Karras": "use_karras_sigmas", "Exponential": "use_exponential_sigmas", "Beta": "use_beta_sigmas"}
SGM_UNIFORM = "SGM Uniform"

_SAMPLERS = {name.lower(): name for name in SAMPLERS}
_SUFFIXES = {suffix.lower(): suffix for suffix in (*SIGMA_SCHEDULES, SGM_UNIFORM)}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(typing.get_type_hints(cls)["config"])}


def resolve(name: str, schedulers: dict) -> tuple[str, dict] | None:
    """(sdflax kind, config values) for an A1111 name (case and spacing ignored), None if `name` is not one.
    `schedulers` is SCHEDULERS. A σ schedule the sampler does not have is an error."""
    words = " ".join(str(name).split()).lower()
    sampler, suffix = _SAMPLERS.get(words), None
    if sampler is None:
        for key, canonical in _SUFFIXES.items():
            if words.endswith(" " + key) and words[:-len(key) - 1] in _SAMPLERS:
                sampler, suffix = _SAMPLERS[words[:-len(key) - 1]], canonical
    if sampler is None:
        return None
    kind, values = SAMPLERS[sampler]
    fields = _fields(schedulers[kind])
    values = {**values, **{flag: False for flag in SIGMA_SCHEDULES.values() if flag in fields}}
    if suffix == SGM_UNIFORM:
        values["timestep_spacing"] = "trailing"
    elif suffix is not None:
        flag = SIGMA_SCHEDULES[suffix]
        if flag not in fields:
            having = sorted(n for n, (k, _) in SAMPLERS.items() if flag in _fields(schedulers[k]))
            raise ValueError(f"scheduler {name!r}: {sampler} has no {suffix} σ schedule; samplers with one: "
                             f"{', '.join(having)}")
        values[flag] = True
    return kind, values


def a1111_name(scheduler, schedulers: dict) -> str | None:
    """The A1111 name of a scheduler object (its sampler and σ schedule), None for one A1111 has no name for."""
    config = scheduler.config
    for sampler, (kind, values) in SAMPLERS.items():
        if type(scheduler) is schedulers[kind] and all(getattr(config, k, v) == v for k, v in values.items()):
            suffix = next((s for s, flag in SIGMA_SCHEDULES.items() if getattr(config, flag, False)), None)
            return sampler if suffix is None else f"{sampler} {suffix}"
    return None
