"""Where the σ samplers may place their n noise levels between σ_max and σ_min, besides at the spaced timesteps
(diffusers' use_karras_sigmas / use_exponential_sigmas / use_beta_sigmas, and sdflax's use_kl_optimal_sigmas): each
a function (sigma_min, sigma_max, n) -> σ float64, descending."""

from __future__ import annotations

import functools
import math

import numpy as np


# Align Your Steps (Sabour et al. 2024): ten steps optimised per model family, as diffusers' `AysSchedules` (the
# same keys). Timesteps for `with_schedule(timesteps=...)` / a pipeline's `timesteps=` with DPM++ 2M or Euler; σ
# (ending at 0) for Euler's `sigmas=`.
AYS_SCHEDULES = {
    "StableDiffusionTimesteps": (999, 850, 736, 645, 545, 455, 343, 233, 124, 24),
    "StableDiffusionSigmas": (14.615, 6.475, 3.861, 2.697, 1.886, 1.396, 0.963, 0.652, 0.399, 0.152, 0.0),
    "StableDiffusionXLTimesteps": (999, 845, 730, 587, 443, 310, 193, 116, 53, 13),
    "StableDiffusionXLSigmas": (14.615, 6.315, 3.771, 2.181, 1.342, 0.862, 0.555, 0.380, 0.234, 0.113, 0.0),
    "StableDiffusionVideoSigmas": (700.00, 54.5, 15.886, 7.977, 4.248, 1.789, 0.981, 0.403, 0.173, 0.034, 0.0),
}


# Align Your Steps as a σ schedule for any step count: these eleven noise levels (diffusers' ten-step σ above, and
# the smallest, 0.029, where they end), interpolated in log σ to n + 1 points when n is not 10, the last replaced by
# the scheduler's final σ (0): ComfyUI's `AlignYourStepsScheduler`, which A1111's "Align Your Steps" follows.
AYS_LEVELS = {family: (*AYS_SCHEDULES[key][:-1], 0.029)
              for family, key in (("sd1", "StableDiffusionSigmas"), ("sdxl", "StableDiffusionXLSigmas"))}


def ays_sigmas(family: str, n: int) -> np.ndarray:
    """The n σ a sampler starts its steps from (the final one is the scheduler's), float64, descending."""
    levels = np.asarray(AYS_LEVELS[family], np.float64)
    if len(levels) != n + 1:  # log-linear in the level's position, as ComfyUI's `loglinear_interp`
        ys = np.interp(np.linspace(0, 1, n + 1), np.linspace(0, 1, len(levels)), np.log(levels[::-1]))
        levels = np.exp(ys)[::-1]
    return levels[:-1]


def karras_sigmas(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
    """σ_i = (σ_max^{1/ρ} + i/(n-1) (σ_min^{1/ρ} - σ_max^{1/ρ}))^ρ, Karras et al. 2022 eq. 5, descending."""
    sigma_min, sigma_max = float(sigma_min), float(sigma_max)  # float64 math, as diffusers' `.item()` end points
    ramp = np.linspace(0, 1, n)
    min_inv_rho, max_inv_rho = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho


def exponential_sigmas(sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    """σ_i = exp(log σ_max + i/(n-1) (log σ_min - log σ_max)): even steps in log σ, i.e. in the half log-SNR λ
    (k-diffusion's `get_sigmas_exponential`), descending."""
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), n))


def beta_sigmas(sigma_min: float, sigma_max: float, n: int, alpha: float = 0.6, beta: float = 0.6) -> np.ndarray:
    """σ_i = σ_min + F⁻¹(1 - i/(n-1)) (σ_max - σ_min), F the Beta(α, β) CDF ("Beta Sampling is All You Need",
    arXiv:2407.12173); with α = β = 0.6 the steps crowd at both ends of the schedule. Descending."""
    sigma_min, sigma_max = float(sigma_min), float(sigma_max)
    return sigma_min + beta_ppf(1 - np.linspace(0, 1, n), alpha, beta) * (sigma_max - sigma_min)


def kl_optimal_sigmas(sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    """σ_i = tan((1 - i/(n-1)) atan σ_max + i/(n-1) atan σ_min): even steps in atan σ, the schedule that is
    KL-optimal for a Gaussian data distribution (Sabour et al. 2024, "Align Your Steps", appendix), A1111's and
    ComfyUI's "KL Optimal". Descending."""
    ramp = np.linspace(0, 1, n)
    return np.tan((1 - ramp) * math.atan(float(sigma_max)) + ramp * math.atan(float(sigma_min)))


def betainc(x, a: float, b: float) -> np.ndarray:
    """The regularized incomplete beta function I_x(a, b) = ∫_0^x t^{a-1} (1-t)^{b-1} dt / B(a, b), float64.

    Its continued fraction (Abramowitz & Stegun 26.5.8) by the modified Lentz method, which converges fast for
    x < (a+1)/(a+b+2); I_x(a, b) = 1 - I_{1-x}(b, a) covers the rest.
    """
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)  # log B(a, b), symmetric in a, b
    x = np.asarray(x, np.float64)
    flip = x > (a + 1) / (a + b + 2)
    x = np.where(flip, 1 - x, x)
    a, b = np.where(flip, b, a), np.where(flip, a, b)
    with np.errstate(divide="ignore"):  # x = 0: log 0 = -inf, front = 0
        front = np.exp(a * np.log(x) + b * np.log1p(-x) - log_beta) / a  # x^a (1-x)^b / (a B(a, b))
    # I = front / (1 + d_1 / (1 + d_2 / (1 + ...))), d_{2m+1} = -(a+m)(a+b+m) x / ((a+2m)(a+2m+1)),
    # d_{2m} = m (b-m) x / ((a+2m-1)(a+2m)); Lentz keeps the ratios c, d of successive convergents.
    tiny = 1e-300
    f, c, d = np.ones_like(x), np.ones_like(x), np.zeros_like(x)
    for k in range(1, 1000):
        m = k // 2
        if k % 2:
            coef = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:
            coef = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1 + coef * d
        d = 1 / np.where(np.abs(d) < tiny, tiny, d)
        c = 1 + coef / c
        c = np.where(np.abs(c) < tiny, tiny, c)
        f = f * (c * d)
        if k % 2 == 0 and np.all(np.abs(c * d - 1) < 2.5e-16):
            break
    value = front / f
    return np.where(flip, 1 - value, value)


def beta_ppf(p, a: float, b: float) -> np.ndarray:
    """The Beta(a, b) quantile x = I⁻¹_p(a, b) in float64, as scipy.stats.beta.ppf that diffusers calls: Newton's
    method on I_x - p (dI/dx = x^{a-1} (1-x)^{b-1} / B(a, b)) inside a bisection bracket that catches the steps
    leaving it, to full precision. The ends map to exactly 0 and 1."""
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    p = np.asarray(p, np.float64)
    inside = (p > 0) & (p < 1)
    target = np.where(inside, p, 0.5)  # the ends are set below; keep log(x), log(1-x) finite meanwhile
    lo, hi = np.zeros_like(p), np.ones_like(p)
    x = np.full_like(p, 0.5)
    for _ in range(100):
        f = betainc(x, a, b) - target
        lo, hi = np.where(f < 0, x, lo), np.where(f < 0, hi, x)
        density = np.exp((a - 1) * np.log(x) + (b - 1) * np.log1p(-x) - log_beta)
        newton = x - f / density
        step = np.where((lo < newton) & (newton < hi), newton, 0.5 * (lo + hi))
        if np.all(np.abs(step - x) <= 2 * np.spacing(x)):  # converged, to a rounding of I_x
            x = step
            break
        x = step
    return np.where(inside, x, np.where(p >= 1, 1.0, 0.0))


SCHEDULES = {"karras": karras_sigmas, "exponential": exponential_sigmas, "beta": beta_sigmas,
             "kl_optimal": kl_optimal_sigmas,  # AYS: its levels, whatever the end points
             **{f"ays_{family}": functools.partial(lambda family, lo, hi, n: ays_sigmas(family, n), family)
                for family in AYS_LEVELS}}


def schedule_sigmas(schedule: str, sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    """n σ from sigma_max down to sigma_min, float64, placed by `schedule` (a key of SCHEDULES)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"sigma schedule {schedule!r}; allowed: {tuple(SCHEDULES)}")
    return SCHEDULES[schedule](sigma_min, sigma_max, n)
