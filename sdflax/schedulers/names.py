"""A1111 / k-diffusion sampler names ("DPM++ 2M SDE Karras", "Euler a") <-> sdflax's schedulers and the config
values each name fixes, as diffusers' scheduler overview maps them. A name is a sampler, optionally followed by a
schedule type: a σ schedule ("Karras", "Exponential", "Beta"), "SGM Uniform" (trailing spacing, which turbo models
need; it differs from Stability's sgm_uniform by at most one timestep of rounding) or "Uniform" (none: the same as
the sampler alone)."""

from __future__ import annotations

import dataclasses
import typing

# A1111 sampler -> (sdflax kind, the config values the name implies)
SAMPLERS = {
    "Euler": ("euler", {}),
    "Euler a": ("euler_ancestral", {}),
    "Euler CFG++": ("euler_cfg_pp", {}),  # Forge's names (CFG++, Chung et al. 2024)
    "Euler a CFG++": ("euler_ancestral_cfg_pp", {}),
    "DPM++ 2M CFG++": ("dpmpp_2m_cfg_pp", {}),
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
ALIASES = {"DPM++ 2M SDE (Heun)": "DPM++ 2M SDE Heun"}  # other spellings read as a sampler's name
SIGMA_SCHEDULES = {"Karras": "use_karras_sigmas", "Exponential": "use_exponential_sigmas", "Beta": "use_beta_sigmas",
                   "KL Optimal": "use_kl_optimal_sigmas", "Align Your Steps": "align_your_steps"}
ON, OFF = {"align_your_steps": "auto"}, {"align_your_steps": None}  # where a σ schedule's field is not a flag
SGM_UNIFORM = "SGM Uniform"
UNIFORM = "Uniform"  # A1111's schedule type for none; A1111 1.9+ reads a missing one as the sampler's "Automatic"

_SAMPLERS = {name.lower(): name for name in SAMPLERS} | {alias.lower(): name for alias, name in ALIASES.items()}
_SUFFIXES = {suffix.lower(): suffix for suffix in (*SIGMA_SCHEDULES, SGM_UNIFORM, UNIFORM)}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(typing.get_type_hints(cls)["config"])}


def split(name: str) -> tuple[str, str | None] | None:
    """(A1111 sampler, schedule type or None) of an A1111 name (case and spacing ignored), None if `name` is not
    one."""
    words = " ".join(str(name).split()).lower()
    if words in _SAMPLERS:
        return _SAMPLERS[words], None
    for key, suffix in _SUFFIXES.items():
        if words.endswith(" " + key) and words[:-len(key) - 1] in _SAMPLERS:
            return _SAMPLERS[words[:-len(key) - 1]], suffix
    return None


def resolve(name: str, schedulers: dict) -> tuple[str, dict] | None:
    """(sdflax kind, config values) for an A1111 name (case and spacing ignored), None if `name` is not one.
    `schedulers` is SCHEDULERS. A σ schedule the sampler does not have is an error."""
    parts = split(name)
    if parts is None:
        return None
    sampler, suffix = parts
    kind, values = SAMPLERS[sampler]
    fields = _fields(schedulers[kind])
    values = {**values, **{flag: OFF.get(flag, False) for flag in SIGMA_SCHEDULES.values() if flag in fields}}
    if suffix == SGM_UNIFORM:
        values["timestep_spacing"] = "trailing"
    elif suffix in SIGMA_SCHEDULES:
        flag = SIGMA_SCHEDULES[suffix]
        if flag not in fields:
            having = sorted(n for n, (k, _) in SAMPLERS.items() if flag in _fields(schedulers[k]))
            raise ValueError(f"scheduler {name!r}: {sampler} has no {suffix} σ schedule; samplers with one: "
                             f"{', '.join(having)}")
        values[flag] = ON.get(flag, True)
    return kind, values


def a1111_name(scheduler, schedulers: dict) -> str | None:
    """The A1111 name of a scheduler object (its sampler and schedule type), None for one A1111 has no name for."""
    config = scheduler.config
    if type(scheduler) is schedulers["flow_match_euler"]:  # A1111's and Forge's "Euler" on a flow model (SD 3.x)
        if config.stochastic_sampling or config.invert_sigmas:
            return None
        suffix = next((s for s, flag in SIGMA_SCHEDULES.items() if getattr(config, flag, False)), None)
        return "Euler" if suffix is None else f"Euler {suffix}"
    for sampler, (kind, values) in SAMPLERS.items():
        if type(scheduler) is schedulers[kind] and all(getattr(config, k, v) == v for k, v in values.items()):
            suffix = next((s for s, flag in SIGMA_SCHEDULES.items() if getattr(config, flag, False)), None)
            if suffix is None and getattr(config, "timestep_spacing", None) == "trailing":
                suffix = SGM_UNIFORM
            return sampler if suffix is None else f"{sampler} {suffix}"
    return None


def parameters_sampler(name: str, schedulers: dict) -> tuple[str, str | None]:
    """(`Sampler`, `Schedule type` or None) of A1111's `parameters` line for a scheduler's name: a sampler with σ
    schedules gets its schedule type written out, "Uniform" for none, since A1111 1.9+ reads a missing one as the
    sampler's "Automatic" (Karras for DPM++ 2M, Exponential for DPM++ 2M SDE). A name that is not A1111's is the
    sampler as it is."""
    parts = split(name)
    if parts is None:
        return name, None
    sampler, suffix = parts
    if suffix is None and SIGMA_SCHEDULES["Karras"] in _fields(schedulers[SAMPLERS[sampler][0]]):
        suffix = UNIFORM
    return sampler, suffix
