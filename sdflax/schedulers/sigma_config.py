"""The config fields of the samplers whose σ schedule is chosen by a flag (`common.sigma_schedule`): Euler, Euler
ancestral, LMS, Heun, DPM2, DPM++ 2S ancestral, DPM++ SDE, DPM++ 2M (SDE), DPM++ 3M SDE, UniPC and DEIS. Each
config inherits them from here and declares only its own."""

from __future__ import annotations

import dataclasses

from . import common

# Where the last step lands (`common.with_final_sigma`): σ = 0, or the smallest training σ.
FINAL_SIGMAS_TYPES = ("zero", "sigma_min")


def check_one_schedule(config) -> None:
    """Raise if a config sets more than one of the σ schedules' flags (common.SIGMA_FLAGS; absent ones are off)."""
    if len(flags := [f for f in common.SIGMA_FLAGS if getattr(config, f, False)]) > 1:
        raise ValueError(f"{' and '.join(flags)} are both set: choose one σ schedule ({type(config).__name__})")


@dataclasses.dataclass(frozen=True)
class SigmaScheduleConfig(common.ScheduleConfig):
    """The spacing and the σ schedule (common.SIGMA_SCHEDULES) every one of these samplers takes, with diffusers'
    defaults: `linspace` spacing is the default of all its σ samplers."""

    timestep_spacing: str = "linspace"
    use_karras_sigmas: bool = False  # at most one of these five (common.SIGMA_SCHEDULES)
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    use_kl_optimal_sigmas: bool = False  # sdflax's (A1111's "KL Optimal"); diffusers has no such flag
    align_your_steps: str | None = None  # sdflax's Align Your Steps: common.AYS_FAMILIES

    def __post_init__(self):
        super().__post_init__()
        if self.align_your_steps not in common.AYS_FAMILIES:
            raise ValueError(f"align_your_steps={self.align_your_steps!r}; allowed: {common.AYS_FAMILIES}")
        check_one_schedule(self)


@dataclasses.dataclass(frozen=True)
class SigmaRangeConfig(SigmaScheduleConfig):
    """And the end points the Karras / exponential / beta σ span where a config carries them; by default the
    sampler's own (the spaced schedule's, or the training schedule's for UniPC). diffusers' Heun, KDPM2 and
    DPMSolverSDE classes have no such arguments but read `config.sigma_min` / `sigma_max` when present, and
    `from_config` keeps them from a compatible class's config (Euler's) as hidden entries."""

    sigma_min: float | None = None
    sigma_max: float | None = None
