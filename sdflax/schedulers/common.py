"""Shared pieces of the DDPM-family schedulers (Ho et al. 2020, "Denoising Diffusion Probabilistic Models")."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

BETA_SCHEDULES = ("linear", "scaled_linear")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


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

    # Subclasses narrow these.
    allowed_prediction_types = PREDICTION_TYPES

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "ScheduleConfig":
        """Pick our fields out of a diffusers config dict; other keys (_class_name, ...) are ignored."""
        if config.get("thresholding", False):
            raise ValueError("thresholding=True (dynamic thresholding) is not implemented in sdflax; set it to False")
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in config.items() if k in names}
        if values.get("trained_betas") is not None:
            values["trained_betas"] = tuple(float(b) for b in np.asarray(values["trained_betas"]).ravel())
        return cls(**values)

    def __post_init__(self):
        for field, allowed in (
            ("beta_schedule", BETA_SCHEDULES),
            ("timestep_spacing", TIMESTEP_SPACINGS),
            ("prediction_type", self.allowed_prediction_types),
        ):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"{field}={value!r} is not supported by {type(self).__name__}; allowed: {allowed}")


def alphas_cumprod(config: ScheduleConfig, rescale_zero_snr: bool = False) -> tuple[np.ndarray, np.float32]:
    """ᾱ_t = ∏_{s≤t} (1 - β_s) for t = 0..T-1 as float32 (like diffusers), and ᾱ used after the last step."""
    T = config.num_train_timesteps
    if config.trained_betas is not None:
        betas = np.asarray(config.trained_betas, np.float32)
    elif config.beta_schedule == "linear":
        betas = np.linspace(config.beta_start, config.beta_end, T, dtype=np.float32)
    else:  # scaled_linear: linear in √β (the Stable Diffusion schedule)
        betas = np.linspace(config.beta_start**0.5, config.beta_end**0.5, T, dtype=np.float32) ** 2
    if rescale_zero_snr:
        betas = rescale_zero_terminal_snr(betas)
    alpha_prod = np.cumprod(1.0 - betas, dtype=np.float32)
    final_alpha_prod = np.float32(1.0) if config.set_alpha_to_one else alpha_prod[0]
    return alpha_prod, final_alpha_prod


def rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Lin et al. 2023 ("Common Diffusion Noise Schedules and Sample Steps are Flawed"), Algorithm 1:
    shift and scale √ᾱ_t so that √ᾱ_{T-1} = 0 (zero terminal SNR) while √ᾱ_0 is unchanged."""
    sqrt_alpha_prod = np.sqrt(np.cumprod(1.0 - betas, dtype=np.float32))
    first, last = sqrt_alpha_prod[0].copy(), sqrt_alpha_prod[-1].copy()
    sqrt_alpha_prod = (sqrt_alpha_prod - last) * (first / (first - last))
    alpha_prod = sqrt_alpha_prod**2
    alphas = np.concatenate([alpha_prod[:1], alpha_prod[1:] / alpha_prod[:-1]])
    return (1.0 - alphas).astype(np.float32)


def spaced_timesteps(config: ScheduleConfig, num_inference_steps: int) -> np.ndarray:
    """The num_inference_steps training timesteps to visit, ascending (diffusers' `timestep_spacing`)."""
    T, n = config.num_train_timesteps, num_inference_steps
    if not 1 <= n <= T:
        raise ValueError(f"num_inference_steps must be in [1, {T}] (num_train_timesteps), got {n}")
    if config.timestep_spacing == "linspace":
        return np.linspace(0, T - 1, n).round().astype(np.int64)
    if config.timestep_spacing == "leading":
        return np.arange(n, dtype=np.int64) * (T // n) + config.steps_offset
    # trailing: count back from T in equal (fractional) strides, so the first step is at T - 1.
    return np.round(np.arange(T, 0, -T / n))[::-1].astype(np.int64) - 1


def alpha_prod_at(alpha_prod: np.ndarray, final_alpha_prod, timesteps: np.ndarray) -> np.ndarray:
    """ᾱ_t for each t, with ᾱ_t := final_alpha_prod for t < 0 (the step past the end of the chain)."""
    timesteps = np.asarray(timesteps)
    return np.where(timesteps >= 0, alpha_prod[np.maximum(timesteps, 0)], final_alpha_prod).astype(np.float32)


def predict_x0_and_epsilon(model_output, sample, alpha_prod_t, prediction_type: str):
    """Turn the network output into (x̂_0, ε̂) using x_t = √ᾱ_t x_0 + √(1-ᾱ_t) ε."""
    beta_prod_t = 1.0 - alpha_prod_t
    if prediction_type == "epsilon":
        pred_epsilon = model_output
        pred_x0 = (sample - jnp.sqrt(beta_prod_t) * model_output) / jnp.sqrt(alpha_prod_t)
    elif prediction_type == "sample":
        pred_x0 = model_output
        pred_epsilon = (sample - jnp.sqrt(alpha_prod_t) * model_output) / jnp.sqrt(beta_prod_t)
    elif prediction_type == "v_prediction":
        # v = √ᾱ_t ε - √(1-ᾱ_t) x_0  (Salimans & Ho 2022)
        pred_x0 = jnp.sqrt(alpha_prod_t) * sample - jnp.sqrt(beta_prod_t) * model_output
        pred_epsilon = jnp.sqrt(alpha_prod_t) * model_output + jnp.sqrt(beta_prod_t) * sample
    else:
        raise ValueError(f"prediction_type={prediction_type!r}; allowed: {PREDICTION_TYPES}")
    return pred_x0, pred_epsilon
