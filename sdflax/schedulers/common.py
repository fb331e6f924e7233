"""Shared pieces of the DDPM-family schedulers (Ho et al. 2020, "Denoising Diffusion Probabilistic Models"),
and the σ view of the same schedule that the Euler / LMS / DPM-Solver samplers use (Karras et al. 2022)."""

from __future__ import annotations

import dataclasses
import numbers
import typing
from functools import partial
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..models.config import ConfigError, config_from_dict, config_source
from . import sigma_schedules

BETA_SCHEDULES = ("linear", "scaled_linear")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
# How the σ samplers place their n noise levels (`sigma_schedule`): at the spaced timesteps ("spaced"), or between
# σ_max and σ_min by Karras et al.'s ρ = 7 ramp, evenly in log σ, at Beta(0.6, 0.6) quantiles, or evenly in atan σ;
# diffusers' use_karras_sigmas / use_exponential_sigmas / use_beta_sigmas and sdflax's use_kl_optimal_sigmas, at
# most one of which may be set.
SIGMA_SCHEDULES = ("spaced", *sigma_schedules.SCHEDULES)
SIGMA_FLAGS = {"use_karras_sigmas": "karras", "use_exponential_sigmas": "exponential", "use_beta_sigmas": "beta",
               "use_kl_optimal_sigmas": "kl_optimal", "align_your_steps": "ays"}
# align_your_steps: None, or whose levels ("sd1", "sdxl"; "auto": the pipeline's family, SD 1.x's outside one)
AYS_FAMILIES = (None, "auto", *sigma_schedules.AYS_LEVELS)


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """The diffusers scheduler_config.json fields that change the computation (diffusers' defaults)."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    steps_offset: int = 0
    set_alpha_to_one: bool = False
    prediction_type: str = "epsilon"
    timestep_spacing: str = "leading"
    # A schedule given in place of the spacing (`SchedulerBase.with_schedule`, as diffusers' set_timesteps(
    # timesteps=...) and (sigmas=...)); never read from a config file. Static: a new one is a new program.
    custom_timesteps: tuple[float, ...] | None = None  # descending training timesteps, one per step
    custom_sigmas: tuple[float, ...] | None = None  # descending σ, one per step and where the last step lands

    # Subclasses narrow these.
    allowed_prediction_types = PREDICTION_TYPES
    # Subclasses add {field: allowed values} for their own fields, and for diffusers fields we do not implement:
    # those must keep the value that means "off" (checked on the raw dict, so they need no dataclass field).
    choices = {}
    unsupported = {}

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "ScheduleConfig":
        """Pick our fields out of a diffusers config dict; other keys (_class_name, ...) are ignored. Values of
        the wrong type or range are a `ConfigError` naming the file (when `read_config_file` read it)."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"{cls.__name__}: the scheduler config is a {type(config).__name__}, not a JSON object")
        where = config_source(config)
        if config.get("thresholding", False):
            raise ConfigError(f"{where}thresholding=True (dynamic thresholding) is not implemented in sdflax; set it "
                              "to False")
        for field, allowed in cls.unsupported.items():
            if field in config and config[field] not in allowed:
                raise ConfigError(f"{where}{field}={config[field]!r:.100} is not implemented in sdflax's "
                                  f"{cls.__name__}; allowed: {allowed}")
        betas = config.get("trained_betas")
        config = {k: v for k, v in config.items() if k not in ("trained_betas", "custom_timesteps", "custom_sigmas")}
        if betas is not None:
            try:
                values = np.asarray(betas, np.float64).ravel()
            except (TypeError, ValueError):
                values = np.array([np.nan])
            if not (values.size and np.all((values > 0) & (values < 1))):
                raise ConfigError(f"{where}{cls.__name__}: trained_betas={betas!r:.100} is invalid (expected numbers "
                                  "in (0, 1))")
            config["trained_betas"] = tuple(float(b) for b in values)
        try:
            return config_from_dict(cls, config)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:  # __post_init__'s checks of choices
            raise ConfigError(f"{where}{' '.join(str(e).split())[:300]}") from None

    def __post_init__(self):
        for field, allowed in (
            ("beta_schedule", BETA_SCHEDULES),
            ("timestep_spacing", TIMESTEP_SPACINGS),
            ("prediction_type", self.allowed_prediction_types),
            *self.choices.items(),
        ):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"{field}={value!r} is not supported by {type(self).__name__}; allowed: {allowed}")


def alphas_cumprod(config: ScheduleConfig, rescale_zero_snr: bool = False,
                   torch_rounding: bool = False) -> tuple[np.ndarray, np.float32]:
    """ᾱ_t = ∏_{s≤t} (1 - β_s) for t = 0..T-1 as float32 (like diffusers), and ᾱ used after the last step.

    `torch_rounding` reproduces torch's float32 β and ᾱ to the last bit. The σ samplers need that: they start
    at σ_max = √((1-ᾱ)/ᾱ) ≈ 14.6 times the noise, where last-bit differences in ᾱ grow to ~1e-5.
    """
    T = config.num_train_timesteps
    linspace = torch_linspace if torch_rounding else partial(np.linspace, dtype=np.float32)
    if config.trained_betas is not None:
        betas = np.asarray(config.trained_betas, np.float32)
    elif config.beta_schedule == "linear":
        betas = linspace(config.beta_start, config.beta_end, T)
    else:  # scaled_linear: linear in √β (the Stable Diffusion schedule)
        betas = linspace(config.beta_start**0.5, config.beta_end**0.5, T) ** 2
    if rescale_zero_snr:
        betas = rescale_zero_terminal_snr(betas)
    alpha_prod = cumprod(1.0 - betas) if torch_rounding else np.cumprod(1.0 - betas, dtype=np.float32)
    final_alpha_prod = np.float32(1.0) if config.set_alpha_to_one else alpha_prod[0]
    return alpha_prod, final_alpha_prod


def torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """float32 `torch.linspace`, which diffusers builds β with: one fused multiply-add from the nearer end
    (np.linspace differs in the last bit, which σ_max = √((1-ᾱ)/ᾱ) amplifies ~10x through ᾱ's product)."""
    start, end = np.float32(start), np.float32(end)
    if steps == 1:
        return np.array([start], np.float32)
    step = np.float64((end - start) / np.float32(steps - 1))
    i = np.arange(steps, dtype=np.float64)
    from_start, from_end = start + step * i, end - step * (steps - 1 - i)  # exact in float64, like an FMA
    return np.where(i < steps // 2, from_start, from_end).astype(np.float32)


def cumprod(x: np.ndarray) -> np.ndarray:
    """float32 cumulative product accumulated in float64, as torch.cumprod does on CPU."""
    return np.cumprod(x.astype(np.float32), dtype=np.float64).astype(np.float32)


def rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Lin et al. 2023 ("Common Diffusion Noise Schedules and Sample Steps are Flawed"), Algorithm 1:
    shift and scale √ᾱ_t so that √ᾱ_{T-1} = 0 (zero terminal SNR) while √ᾱ_0 is unchanged."""
    sqrt_alpha_prod = np.sqrt(np.cumprod(1.0 - betas, dtype=np.float32))
    first, last = sqrt_alpha_prod[0].copy(), sqrt_alpha_prod[-1].copy()
    sqrt_alpha_prod = (sqrt_alpha_prod - last) * (first / (first - last))
    alpha_prod = sqrt_alpha_prod**2
    alphas = np.concatenate([alpha_prod[:1], alpha_prod[1:] / alpha_prod[:-1]])
    return (1.0 - alphas).astype(np.float32)


def check_steps(config: ScheduleConfig, num_inference_steps) -> None:
    """Raise unless 1 <= n <= T (n distinct training timesteps, at most all T of them) and the first is one:
    `leading` spacing starts at (n-1)⌊T/n⌋ + steps_offset, which is T for n = T and steps_offset = 1 (where
    diffusers' schedulers fail or degenerate: DDIM / PNDM index past ᾱ, LMS divides by 0, DPM-Solver's n + 1
    points have stride 0, Euler clamps t to T - 1)."""
    T, n = config.num_train_timesteps, num_inference_steps
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"num_inference_steps must be an int, got {' '.join(repr(n).split()):.80}")
    custom = custom_steps(config)
    if custom is not None:
        if n != custom:
            raise ValueError(f"num_inference_steps={n}, but the custom schedule has {custom} steps")
        return
    if not 1 <= n <= T:
        raise ValueError(f"num_inference_steps must be in [1, {T}] (num_train_timesteps), got {n}")
    leading = getattr(config, "timestep_spacing", None) == "leading"  # flow schedules have no spacing
    if leading and (first := (n - 1) * (T // n) + config.steps_offset) >= T:
        raise ValueError(
            f"num_inference_steps={n} with timestep_spacing='leading' and steps_offset={config.steps_offset} puts the "
            f"first step at t={first}, past the last training timestep {T - 1}: use fewer steps or another spacing"
        )


def spaced_timesteps(config: ScheduleConfig, num_inference_steps: int, fractional: bool = False,
                     extra_point: bool = False) -> np.ndarray:
    """The n training timesteps to visit, descending (diffusers' `timestep_spacing`): int64, float64 if fractional.

    diffusers' schedulers space alike but for two details, kept here for exact parity: the σ samplers (Euler,
    Euler ancestral, LMS) keep `linspace` timesteps fractional (`fractional`); DPM-Solver spaces n + 1 points for
    `linspace` and `leading` and drops the smallest (`extra_point`). `trailing` is the same for all.
    """
    check_steps(config, num_inference_steps)
    if config.custom_timesteps is not None:  # as given (diffusers casts them to the spacing's dtype)
        timesteps = np.asarray(config.custom_timesteps, np.float64)
        return timesteps if fractional else timesteps.astype(np.int64)
    T, n = config.num_train_timesteps, num_inference_steps
    points = n + 1 if extra_point else n
    if config.timestep_spacing == "trailing":
        # count back from T in equal (fractional) strides, so the first step is at T - 1
        return np.round(np.arange(T, 0, -T / n)).astype(np.int64) - 1
    if config.timestep_spacing == "linspace":  # t_k = k (T-1)/(points-1)
        timesteps = np.linspace(0, T - 1, points)
        if not fractional:
            timesteps = timesteps.round().astype(np.int64)
    else:  # leading: t_k = k ⌊T/points⌋ + steps_offset
        timesteps = np.arange(points, dtype=np.int64) * (T // points) + config.steps_offset
    timesteps = timesteps[::-1]
    return timesteps[:-1] if extra_point else timesteps


def alpha_prod_at(alpha_prod: np.ndarray, final_alpha_prod, timesteps: np.ndarray) -> np.ndarray:
    """ᾱ_t for each t, with ᾱ_t := final_alpha_prod for t < 0 (the step past the end of the chain)."""
    timesteps = np.asarray(timesteps)
    return np.where(timesteps >= 0, alpha_prod[np.maximum(timesteps, 0)], final_alpha_prod).astype(np.float32)


def predict_x0_and_epsilon(model_output, sample, alpha, sigma, prediction_type: str, variance=1.0):
    """(x̂_0, ε̂), float32, from the network output at sample = α x_0 + σ ε: the one conversion every scheduler
    makes (k-diffusion's denoiser wrappers). The UNet sees sample / √variance, variance = α² + σ²: 1 for the
    variance-preserving x_t (α = √ᾱ_t, σ = √(1-ᾱ_t)), 1 + σ² for the σ samplers' x_0 + σ ε (α = 1)."""
    out, x = model_output.astype(jnp.float32), sample.astype(jnp.float32)
    if prediction_type == "epsilon":
        return (x - sigma * out) / alpha, out
    if prediction_type == "sample":
        return out, (x - alpha * out) / sigma
    if prediction_type == "v_prediction":
        # v = (α ε - σ x_0) / √variance on the UNet's unit-variance input (Salimans & Ho 2022)
        rms = jnp.sqrt(variance)
        return alpha * x / variance - sigma / rms * out, alpha / rms * out + sigma * x / variance
    if prediction_type == "flow":  # v = ε - x_0 on a rectified flow, α = 1 - σ (flow_match_euler.py)
        return x - sigma * out, x + alpha * out
    raise ValueError(f"prediction_type={prediction_type!r}; allowed: {(*PREDICTION_TYPES, 'flow')}")


def clip_x0(config, pred_x0):
    """x̂_0 clipped to ±clip_sample_range where the config sets `clip_sample` (diffusers' option, for pixel-space
    models; ε̂ is not recomputed from it, as diffusers)."""
    if not config.clip_sample:
        return pred_x0
    return jnp.clip(pred_x0, -config.clip_sample_range, config.clip_sample_range)


def alpha_sigma(alpha_prod_t):
    """(α, σ) = (√ᾱ_t, √(1-ᾱ_t)): x_t = α x_0 + σ ε (Ho et al. 2020 eq. 4)."""
    return jnp.sqrt(alpha_prod_t), jnp.sqrt(1.0 - alpha_prod_t)


def add_noise(original_samples, noise, alpha_prod_t):
    """q(x_t | x_0) = N(√ᾱ_t x_0, (1-ᾱ_t) I) sampled with `noise` (Ho et al. 2020 eq. 4), in the samples' dtype."""
    x0, eps = original_samples.astype(jnp.float32), noise.astype(jnp.float32)
    return (jnp.sqrt(alpha_prod_t) * x0 + jnp.sqrt(1.0 - alpha_prod_t) * eps).astype(original_samples.dtype)


def step_noise(key, shape) -> jnp.ndarray:
    """Fresh N(0, I) noise of `shape` (B, ...), float32, for a stochastic step: from one PRNG key for the whole
    batch, or from one key per image (B keys), image b's noise then being what a batch of one with key b draws.
    Every sampler that adds noise draws it here."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if key.ndim == (0 if typed else 1):
        return jax.random.normal(key, shape, jnp.float32)
    one = (1, *shape[1:])
    return jax.vmap(lambda k: jax.random.normal(k, one, jnp.float32))(key).reshape(shape)


def draw_step_noise(key, variance_noise, shape, what: str, adds_noise=True):
    """The fresh z ~ N(0, I) of a stochastic step, float32: `variance_noise` as given (tests, parity with diffusers'
    `variance_noise=`), or drawn from `key` by `step_noise`; None where the step adds none (`adds_noise` False).
    `what` says why the step needs noise, for the error."""
    if key is not None and variance_noise is not None:
        raise ValueError("pass either a PRNG `key` or `variance_noise`, not both")
    if not adds_noise:
        return None
    if key is None and variance_noise is None:
        raise ValueError(f"{what}: pass a PRNG `key` or `variance_noise`")
    return step_noise(key, shape) if variance_noise is None else variance_noise.astype(jnp.float32)


# ---- the σ view: x_t / √ᾱ_t = x_0 + σ_t ε (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based
# Generative Models", §2 and Appendix C.2: discrete DDPM schedules seen as a variance-exploding ODE) --------------


def train_sigmas(config: ScheduleConfig, zero_snr: bool = False) -> np.ndarray:
    """σ_t = √((1-ᾱ_t)/ᾱ_t) for t = 0..T-1, float32 from torch-rounded ᾱ, like diffusers' σ samplers."""
    alpha_prod, _ = alphas_cumprod(config, rescale_zero_snr=zero_snr, torch_rounding=True)
    if zero_snr:
        alpha_prod[-1] = 2.0**-24  # as diffusers: keeps σ_{T-1} finite
    return np.sqrt((1.0 - alpha_prod) / alpha_prod).astype(np.float32)


def with_final_sigma(sigmas: np.ndarray, train: np.ndarray, final_sigma: str) -> np.ndarray:
    """σ_0..σ_{n-1} and σ_n, where the last step lands: 0 ("zero") or the smallest training σ ("sigma_min")."""
    return np.append(sigmas, {"zero": 0.0, "sigma_min": train[0]}[final_sigma]).astype(np.float32)


def sigma_schedule(config, karras: bool = False) -> str:
    """Which of SIGMA_SCHEDULES the config asks for: its use_karras_sigmas / use_exponential_sigmas /
    use_beta_sigmas (absent fields are off); `karras=True` is the older spelling of "karras"."""
    if karras:
        return "karras"
    family = getattr(config, "align_your_steps", None)
    if family:
        return f"ays_{'sd1' if family == 'auto' else family}"
    return next((kind for flag, kind in SIGMA_FLAGS.items() if getattr(config, flag, False)), "spaced")


def for_family(scheduler, family: str):
    """`scheduler` with an "auto" Align Your Steps schedule set to a model family's levels ("sd1", "sdxl"): what
    a pipeline does with the scheduler it is given."""
    if getattr(scheduler.config, "align_your_steps", None) != "auto":
        return scheduler
    return dataclasses.replace(scheduler, config=dataclasses.replace(scheduler.config, align_your_steps=family))


def sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """The (fractional) training timestep of each σ: linear interpolation in log σ, as diffusers' `_sigma_to_t`."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma[None, :] - log_sigmas[:, None]  # (T, n)
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=len(log_sigmas) - 2)
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return (1 - w) * low + w * (low + 1)


def discrete_sigma_schedule(config, num_inference_steps: int, karras: bool = False, sigma_min=None, sigma_max=None,
                            final_sigma: str = "zero", zero_snr: bool = False, schedule: str | None = None
                            ) -> tuple[np.ndarray, np.ndarray]:
    """(timesteps float32 (n,), σ float32 (n+1,)), both descending, as diffusers' Euler / LMS `set_timesteps`.

    Timesteps are spaced by `timestep_spacing` (fractional for `linspace`), σ interpolated linearly in t. `schedule`
    (default: the config's use_*_sigmas flags, see `sigma_schedule`; `karras=True` means "karras") redistributes the
    σ between the spaced end points (or `sigma_min` / `sigma_max`) and the timesteps follow them.
    σ_n, after the last step, is 0 (`final_sigma="zero"`) or σ_0 ("sigma_min").
    """
    if config.custom_sigmas is not None:  # σ as given, the last one included; the timesteps follow them
        check_steps(config, num_inference_steps)
        sigmas = np.asarray(config.custom_sigmas, np.float32)
        return sigma_to_t(sigmas[:-1], np.log(train_sigmas(config, zero_snr))).astype(np.float32), sigmas
    timesteps = spaced_timesteps(config, num_inference_steps, fractional=True).astype(np.float32)
    sigmas = train_sigmas(config, zero_snr)
    spaced = np.interp(timesteps, np.arange(len(sigmas)), sigmas)
    schedule = schedule or sigma_schedule(config, karras)
    if schedule != "spaced":
        lo = sigma_min if sigma_min is not None else spaced[-1]
        hi = sigma_max if sigma_max is not None else spaced[0]
        spaced = sigma_schedules.schedule_sigmas(schedule, lo, hi, num_inference_steps)
        timesteps = sigma_to_t(spaced, np.log(sigmas))
    return timesteps.astype(np.float32), with_final_sigma(spaced, sigmas, final_sigma)


def multistep_sigma_schedule(config, num_inference_steps: int, sigma_min=None, sigma_max=None, zero_snr: bool = False
                             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(timesteps int64 (n,), σ float64 (n,), training σ float32 (T,)), descending, as diffusers' DPM-Solver, UniPC
    and DEIS `set_timesteps` place them (before their final σ).

    Unlike Euler's, their Karras / exponential / beta σ span the whole training range (σ_0 .. σ_{T-1}, or the config's
    `sigma_min` / `sigma_max`), not the spaced end points, and the timesteps are integers: Karras' rounded,
    exponential and beta ones truncated (diffusers casts them to int64 without rounding).
    """
    timesteps = spaced_timesteps(config, num_inference_steps, extra_point=True)
    train = train_sigmas(config, zero_snr)
    schedule = sigma_schedule(config)
    if schedule == "spaced":
        return timesteps, np.interp(timesteps, np.arange(len(train)), train), train
    lo = sigma_min if sigma_min is not None else train[0]
    hi = sigma_max if sigma_max is not None else train[-1]
    sigmas = sigma_schedules.schedule_sigmas(schedule, lo, hi, num_inference_steps)
    t = sigma_to_t(sigmas, np.log(train))
    return (t.round() if schedule == "karras" else t).astype(np.int64), sigmas, train


def check_start(start: int, num_evals: int):
    """img2img skips the first `start` of the schedule's `num_evals` model evaluations: at least one must remain."""
    if not 0 <= start < num_evals:
        raise ValueError(f"start={start} must be in [0, {num_evals}): the number of steps img2img skips")


def init_noise_sigma(config, sigma_first) -> float:
    """diffusers' `init_noise_sigma` for the σ samplers: σ_max, or √(σ_max² + 1) for `leading` spacing."""
    if config.timestep_spacing == "leading":
        return float(np.sqrt(np.float32(sigma_first) ** 2 + 1))
    return float(sigma_first)


def custom_steps(config) -> int | None:
    """The step count of a custom schedule, None for a spaced one."""
    if config.custom_timesteps is not None:
        return len(config.custom_timesteps)
    return None if config.custom_sigmas is None else len(config.custom_sigmas) - 1


def checked_schedule(kind: str, values, num_train_timesteps: int) -> tuple[float, ...]:
    """Custom timesteps or σ as a tuple of floats, refused unless they can be a schedule: a flat list of finite
    numbers, strictly descending, timesteps within the training range, σ non-negative and at least two (the last
    is where the final step lands, 0 for a clean image), and at most num_train_timesteps steps."""
    try:  # real numbers only: complex ones lost their imaginary part, booleans became 0 and 1
        given = np.asarray(values)
        array = given.astype(np.float64) if given.dtype.kind in "fiu" else None
    except (TypeError, ValueError, OverflowError):
        array = None
    if array is None or array.ndim != 1 or not np.isfinite(array).all():
        raise ValueError(f"{kind} must be a list of finite numbers (in float32, of magnitude below about 3.4e38), "
                         f"got {' '.join(repr(values).split()):.80}")
    with np.errstate(over="ignore"):  # the schedule is float32: 1e300 passes in float64 and becomes inf
        if not np.isfinite(array.astype(np.float32)).all():  # the words of the pipeline's own finiteness check
            raise ValueError(f"{kind} holds NaN, inf or a number past float32's range (about 3.4e38): give finite "
                             "numbers")
    least = 1 if kind == "timesteps" else 2
    steps = len(array) - (kind == "sigmas")
    if steps > num_train_timesteps:  # the cap num_inference_steps has, whatever asks for the steps
        raise ValueError(f"{kind} asks for {steps} steps: at most {num_train_timesteps} (num_train_timesteps), "
                         "as num_inference_steps")
    if len(array) < least or (np.diff(array) >= 0).any() or array.min() < 0 or (
            kind == "timesteps" and array.max() > num_train_timesteps - 1):
        what = (f"training timesteps in [0, {num_train_timesteps - 1}], one per step" if kind == "timesteps" else
                "σ >= 0, one per step and one more where the last step lands (0: a clean image)")
        raise ValueError(f"{kind}={list(values)!r:.120} must be strictly descending {what}")
    return tuple(float(v) for v in array)


class SchedulerBase:
    """What every built-in scheduler shares (see `protocol.Scheduler`): `from_config`, which parses the dict with
    the class of the scheduler's `config` field, `check_steps` and `with_schedule`."""

    custom_schedules = ()  # what `with_schedule` takes: those of "timesteps", "sigmas" its diffusers class takes

    @classmethod
    def from_config(cls, config: Mapping[str, Any]):
        """Build from a diffusers scheduler_config.json dict (other keys ignored, unsupported values rejected)."""
        return cls(typing.get_type_hints(cls)["config"].from_dict(config))

    def check_steps(self, num_inference_steps: int) -> None:
        """Raise now, before anything is compiled, if `set_timesteps(num_inference_steps)` would."""
        check_steps(self.config, num_inference_steps)

    def with_schedule(self, timesteps=None, sigmas=None):
        """This scheduler running the given training timesteps (descending, one per step) or σ (descending, one
        more: the last is where the final step lands) in place of its spacing, as diffusers' `set_timesteps(
        timesteps=...)` / `(sigmas=...)`; `set_timesteps` then takes their step count. Align Your Steps:
        `schedulers.AYS_SCHEDULES`."""
        if timesteps is not None and sigmas is not None:
            raise ValueError("give timesteps or sigmas, not both")
        kind, values = ("timesteps", timesteps) if timesteps is not None else ("sigmas", sigmas)
        if values is None:
            return self
        name = type(self).__name__
        if kind not in self.custom_schedules:
            raise ValueError(f"{name} takes no custom {kind}, as its diffusers class: use a scheduler that does "
                             "(euler takes timesteps and sigmas; dpmpp_2m, heun, ddpm, lcm and tcd timesteps)")
        if kind == "timesteps" and (schedule := sigma_schedule(self.config)) != "spaced":
            raise ValueError(f"timesteps with {name}'s {schedule} σ schedule: the σ schedule places the timesteps "
                             "(diffusers refuses it too): drop one of them")
        values = checked_schedule(kind, values, self.config.num_train_timesteps)
        custom = {"custom_timesteps": None, "custom_sigmas": None, f"custom_{kind}": values}
        return dataclasses.replace(self, config=dataclasses.replace(self.config, **custom))


class SigmaSampler(SchedulerBase):
    """What the Euler, Euler ancestral and LMS samplers share. They integrate dx/dσ = (x - x̂_0) / σ on
    x = x_0 + σ ε (Karras et al. 2022 eq. 4 with σ(t) = t), starting from x ~ N(0, σ_max²); `state.sigmas`.
    Their states carry `init_noise_sigma`, diffusers' value for the step count (see `init_noise_sigma` above)."""

    def scale_model_input(self, state, sample, i):
        """x / √(σ² + 1): the UNet was trained on √ᾱ_t x = x_t, which has unit variance."""
        return (sample.astype(jnp.float32) / jnp.sqrt(state.sigmas[i] ** 2 + 1)).astype(sample.dtype)

    def predict_x0(self, state, model_output, i, sample):
        """x̂_0 from the network output at evaluation i (diffusers' pred_original_sample), float32."""
        sigma = state.sigmas[i]
        return predict_x0_and_epsilon(model_output, sample, 1.0, sigma, self.config.prediction_type,
                                      variance=sigma**2 + 1)[0]

    def add_noise(self, state, original_samples, noise, i):
        """x_0 + σ_i ε: the sample to start sampling at evaluation i from (img2img)."""
        noisy = original_samples.astype(jnp.float32) + noise.astype(jnp.float32) * state.sigmas[i]
        return noisy.astype(original_samples.dtype)


class VPSolver(SchedulerBase):
    """What the DPM-Solver++, UniPC and DEIS schedulers share. They work on the variance-preserving x_t = α_t x_0 +
    s_t ε itself (α = 1/√(σ²+1) = √ᾱ, s = σ α = √(1-ᾱ); Lu et al. 2022 §2), from x_T ~ N(0, I): the UNet's input
    is x unscaled. Their states carry `alpha_t` and `sigma_t` (s), float32 (evals,)."""

    def scale_model_input(self, state, sample, i):
        return sample

    def predict_x0(self, state, model_output, i, sample):
        """x̂_0 = (x - s ε̂) / α, the data prediction, from an ε, v or x_0 output. float32."""
        return predict_x0_and_epsilon(model_output, sample, state.alpha_t[i], state.sigma_t[i],
                                      self.config.prediction_type)[0]

    def add_noise(self, state, original_samples, noise, i):
        """α_i x_0 + s_i ε: the sample to start sampling at evaluation i from (img2img)."""
        noisy = state.alpha_t[i] * original_samples.astype(jnp.float32) + state.sigma_t[i] * noise.astype(jnp.float32)
        return noisy.astype(original_samples.dtype)


def vp_coefficients(sigmas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(α, s, λ) float64 for each σ: α = 1/√(σ²+1), s = σ α, λ = log(α/s) = -log σ, the half log-SNR in which the
    exponential integrators step (Lu et al. 2022 §3). σ = 0 gives s = 0, λ = ∞, which their formulas take."""
    with np.errstate(divide="ignore"):
        sig = np.asarray(sigmas, np.float64)
        alpha = 1 / np.sqrt(sig**2 + 1)
        s = sig * alpha
        return alpha, s, np.log(alpha) - np.log(s)
