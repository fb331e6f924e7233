"""DPM-Solver++ SDE: the stochastic second-order singlestep solver of Lu et al. 2022, "DPM-Solver++: Fast Solver
for Guided Sampling of Diffusion Probabilistic Models", as Katherine Crowson's k-diffusion `sample_dpmpp_sde`
(r = 1/2, eta = 1) runs it, matching diffusers' DPMSolverSDEScheduler.

Both evaluations of a step add noise, Brownian increments over [σ_mid, σ_k] and [σ_{k+1}, σ_k] of one path, as
k-diffusion's BrownianTreeNoiseSampler draws them: the second noise is correlated with the first.
"""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp
import numpy as np

from . import common, sigma_schedules
from .heun import TwoStageSampler, first_evaluation, interleave, require_shape, second_stages
from .sigma_config import SigmaRangeConfig


@dataclasses.dataclass(frozen=True)
class DPMSolverSDEConfig(SigmaRangeConfig):
    """Its Karras σ always span the spaced schedule's: `sigma_min` / `sigma_max` place the exponential and beta σ
    alone."""

    beta_start: float = 0.00085  # diffusers' DPMSolverSDEScheduler defaults
    beta_end: float = 0.012
    # diffusers' `noise_sampler_seed` seeds its torch Brownian tree; here the noise comes from the step's key.

    allowed_prediction_types = ("epsilon", "v_prediction")  # diffusers raises for "sample"


@flax.struct.dataclass
class DPMSolverSDEState:
    timesteps: jnp.ndarray  # float32 [evals]: t_0, t(σ_mid,0), t_1, ..., t_{n-1}
    sigmas: jnp.ndarray  # float32 [evals]: σ_0, σ_mid,0, σ_1, ...: where the model is evaluated
    step_sigmas: jnp.ndarray  # float32 [evals]: σ_k, σ_{k+1} for step k's two evaluations (diffusers' table)
    coef_sample: jnp.ndarray  # float32 [evals]: a in x' = a x + b x̂_0 + σ_up z (x: x_k at both evaluations)
    coef_x0: jnp.ndarray  # float32 [evals]: b
    sigma_up: jnp.ndarray  # float32 [evals]
    noise_carry: jnp.ndarray  # float32 [evals]: z = noise_carry · z_first + noise_fresh · N(0, I)
    noise_fresh: jnp.ndarray  # float32 [evals]
    second: jnp.ndarray  # bool [evals]: the evaluation is a step's second (at the midpoint)
    sample: jnp.ndarray  # float32 [*shape]: x of the previous evaluation (x_k, when a second stage reads it)
    noise: jnp.ndarray  # float32 [*shape]: z of the previous evaluation (the first stage's, when a second reads it)
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False)  # diffusers' value for this n


def sde_schedule(cfg: DPMSolverSDEConfig, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(timesteps (n,), σ (n,), the midpoints' timesteps (n-1,)), float64, as DPMSolverSDEScheduler places them:
    Euler's spacing, but σ interpolated at float64 timesteps (Karras, exponential or beta σ redistributed between
    their end points, the timesteps following them), and σ_mid = √(σ_k σ_{k+1}) from float64 σ, before any
    float32 rounding."""
    timesteps = common.spaced_timesteps(cfg, n, fractional=True).astype(np.float64)
    train = common.train_sigmas(cfg)
    sigmas = np.interp(timesteps, np.arange(len(train)), train)
    if (schedule := common.sigma_schedule(cfg)) != "spaced":
        lo, hi = sigmas[-1], sigmas[0]
        if schedule != "karras":  # diffusers' `_convert_to_karras` here ignores the config's end points
            lo = cfg.sigma_min if cfg.sigma_min is not None else lo
            hi = cfg.sigma_max if cfg.sigma_max is not None else hi
        sigmas = sigma_schedules.schedule_sigmas(schedule, lo, hi, n)
        timesteps = common.sigma_to_t(sigmas, np.log(train))
    t = -np.log(sigmas)
    t_mid = common.sigma_to_t(np.exp(-(t[:-1] + np.diff(t) / 2)), np.log(train))
    return timesteps, sigmas, t_mid


def exponential_step(t, t_to):
    """DPM-Solver++(1) from t = -log σ towards t_to with the ancestral split, float32 as diffusers computes it:
    (a, b, σ_up) with x' = a x + b x̂_0 + σ_up z, a = σ_down / σ, b = 1 - σ_down / σ (as e^{-h} - 1 with
    h = log σ - log σ_down), σ_up² = σ_to² (σ² - σ_to²) / σ² (k-diffusion's `get_ancestral_step`)."""
    sigma_from, sigma_to = np.exp(-t), np.exp(-t_to)
    sigma_up = np.minimum(sigma_to, np.sqrt(sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2))
    sigma_down = np.sqrt(np.maximum(sigma_to**2 - sigma_up**2, 0))
    with np.errstate(divide="ignore"):
        t_down = -np.log(sigma_down)
    return np.exp(-t_down) / np.exp(-t), -np.expm1(t - t_down), sigma_up


@dataclasses.dataclass(frozen=True)
class DPMSolverSDEScheduler(TwoStageSampler):
    config: DPMSolverSDEConfig

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> DPMSolverSDEState:
        """`shape` of the samples (required: the state keeps x_k and the first noise); `start` skips that many
        steps (img2img)."""
        shape = require_shape(shape, "DPM++ SDE")
        cfg, n = self.config, num_inference_steps
        timesteps, sigmas64, t_mid = sde_schedule(cfg, n)
        sigmas = np.append(sigmas64, 0.0).astype(np.float32)
        s_from, s_to = sigmas[:-1], sigmas[1:]
        # Step k in t = -log σ: the midpoint s = t_k + h/2 (σ_mid = √(σ_k σ_{k+1})). First evaluation: x̂_0(x_k, σ_k)
        # carries x_k to s by an ancestral DPM-Solver++(1) step; second: x̂_0(x_mid, σ_mid) carries x_k to t_{k+1}.
        # float32 throughout, as diffusers: σ_down² = σ_to² - σ_up² cancels, and its rounding is diffusers'.
        with np.errstate(divide="ignore"):
            t, t_next = -np.log(s_from), -np.log(s_to)  # t_n = inf
        t_prop = t + (t_next - t) * np.float32(0.5)
        sigma_mid = np.exp(-t_prop)
        a_first, b_first, up_first = exponential_step(t, t_prop)
        a_second, b_second, up_second = exponential_step(t, t_next)
        last = s_to == 0  # Euler to σ = 0 lands on x̂_0
        a_first, b_first, up_first = np.where(last, 0, a_first), np.where(last, 1, b_first), np.where(last, 0, up_first)
        # Brownian increments W(σ_k) - W(σ_mid) = √Δ₁ z₁ and W(σ_k) - W(σ_{k+1}) = √Δ₁ z₁ + √Δ₂ z₂, each divided by
        # its own std (Δ₁ = σ_k - σ_mid, Δ₂ = σ_mid - σ_{k+1}): the second noise is √(Δ₁/Δ) z₁ + √(Δ₂/Δ) z₂.
        # Steps cover disjoint intervals, so their noises are independent.
        delta_first, delta = s_from.astype(np.float64) - sigma_mid, s_from.astype(np.float64) - s_to
        carry = np.sqrt(delta_first / delta)
        fresh = np.sqrt((delta - delta_first) / delta)
        skip = first_evaluation(start, n)
        per_eval = lambda first, second: jnp.asarray(interleave(first, second)[skip:], jnp.float32)  # noqa: E731
        return DPMSolverSDEState(
            timesteps=per_eval(timesteps, np.append(t_mid, 0.0)),
            sigmas=per_eval(s_from, sigma_mid),
            step_sigmas=per_eval(s_from, s_to),
            coef_sample=per_eval(a_first, a_second),
            coef_x0=per_eval(b_first, b_second),
            sigma_up=per_eval(up_first, up_second),
            noise_carry=per_eval(np.zeros(n), carry),
            noise_fresh=per_eval(np.ones(n), fresh),
            second=jnp.asarray(second_stages(n)[skip:]),
            sample=jnp.zeros(shape, jnp.float32),
            noise=jnp.zeros(shape, jnp.float32),
            num_inference_steps=n,
            init_noise_sigma=common.init_noise_sigma(cfg, sigmas.max()),
        )

    def step(self, state: DPMSolverSDEState, model_output, i, sample, key=None, variance_noise=None):
        """First evaluation of step k:  x_mid = a₁ x_k + b₁ x̂_0(x_k) + σ_up,1 z₁.
        Second:  x_{k+1} = a₂ x_k + b₂ x̂_0(x_mid) + σ_up,2 z₂,  z₂ correlated with z₁ as Brownian increments are.
        Fresh noise from `key`; `variance_noise` is taken as the evaluation's z itself (tests)."""
        noise = common.draw_step_noise(key, variance_noise, sample.shape, "DPM++ SDE adds fresh noise each step")
        if variance_noise is None:  # a Brownian increment: part the first stage's, part fresh
            noise = state.noise_carry[i] * state.noise + state.noise_fresh[i] * noise
        x = sample.astype(jnp.float32)
        x0 = self.predict_x0(state, model_output, i, x)
        x_k = jnp.where(state.second[i], state.sample, x)
        prev_sample = state.coef_sample[i] * x_k + state.coef_x0[i] * x0 + state.sigma_up[i] * noise
        # Only a second stage reads `sample` and `noise`, which its first wrote.
        return prev_sample.astype(sample.dtype), state.replace(sample=x, noise=noise)
