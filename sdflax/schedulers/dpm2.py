"""DPM2 and DPM2 ancestral: Katherine Crowson's k-diffusion samplers `sample_dpm_2` and `sample_dpm_2_ancestral`
(DPM-Solver-2 of Lu et al. 2022 on Karras et al. 2022's σ-ODE: a midpoint step with the midpoint taken in log σ),
matching diffusers' KDPM2DiscreteScheduler and KDPM2AncestralDiscreteScheduler."""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp
import numpy as np

from . import common
from .heun import TwoStageSampler, first_evaluation, interleave, require_shape, second_stages
from .sigma_config import SigmaRangeConfig


@dataclasses.dataclass(frozen=True)
class DPM2Config(SigmaRangeConfig):
    beta_start: float = 0.00085  # diffusers' KDPM2(Ancestral)DiscreteScheduler defaults
    beta_end: float = 0.012

    allowed_prediction_types = ("epsilon", "v_prediction")  # diffusers raises for "sample"


@dataclasses.dataclass(frozen=True)
class DPM2AncestralConfig(DPM2Config):
    """The same fields and defaults (KDPM2AncestralDiscreteScheduler's)."""


@flax.struct.dataclass
class DPM2State:
    timesteps: jnp.ndarray  # float32 [evals]: t_0, t(σ_mid,0), t_1, t(σ_mid,1), ..., t_{n-1}
    sigmas: jnp.ndarray  # float32 [evals]: σ_0, σ_mid,0, σ_1, ...: where the model is evaluated
    step_sigmas: jnp.ndarray  # float32 [evals]: σ_k, σ_{k+1} for step k's two evaluations (diffusers' table)
    dt: jnp.ndarray  # float32 [evals]: σ_mid,k - σ_k, then σ_target,k - σ_k
    sigma_up: jnp.ndarray  # float32 [evals]: std of the noise an evaluation adds (ancestral: a step's second)
    second: jnp.ndarray  # bool [evals]: the evaluation is a step's second (at the midpoint)
    sample: jnp.ndarray  # float32 [*shape]: x of the previous evaluation (x_k, when a second stage reads it)
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False)  # diffusers' value for this n


def log_midpoint(start, end):
    """exp of torch.lerp(log start, log end, 1/2), float32 and rounded as diffusers computes it: the geometric mean
    √(start · end), 0 where either is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a, b = np.log(start.astype(np.float32)), np.log(end.astype(np.float32))
        mid = np.exp(b - (b - a) * np.float32(0.5))  # torch.lerp's form for weights ≥ 1/2
    return np.where((start > 0) & (end > 0), mid, 0).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class DPM2Scheduler(TwoStageSampler):
    config: DPM2Config
    ancestral = False

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> DPM2State:
        """`shape` of the samples (required: the state keeps x_k); `start` skips that many steps (img2img)."""
        shape = require_shape(shape, type(self).__name__)
        cfg, n = self.config, num_inference_steps
        timesteps, sigmas = common.discrete_sigma_schedule(cfg, n, sigma_min=cfg.sigma_min, sigma_max=cfg.sigma_max)
        if cfg.use_karras_sigmas:
            timesteps = timesteps.round()  # diffusers rounds Karras' (not exponential or beta ones, nor midpoints')
        s_from, s_to = sigmas[:-1], sigmas[1:]  # float32, as diffusers computes them
        if self.ancestral:
            # σ_k -> σ_{k+1} as a deterministic move to σ_down plus fresh noise of std σ_up (the DDPM posterior):
            # σ_up² = σ_{k+1}² (σ_k² - σ_{k+1}²) / σ_k²,  σ_down² = σ_{k+1}² - σ_up².
            sigma_up = np.sqrt(s_to**2 * (s_from**2 - s_to**2) / s_from**2)
            target = np.sqrt(np.maximum(s_to**2 - sigma_up**2, 0))
            mid = log_midpoint(s_from, target)
        else:
            sigma_up, target = np.zeros_like(s_from), s_to
            mid = log_midpoint(s_to, s_from)
        t_mid = common.sigma_to_t(mid, np.log(common.train_sigmas(cfg)))
        skip = first_evaluation(start, n)
        zeros = np.zeros_like(s_from)
        per_eval = lambda first, second: jnp.asarray(interleave(first, second)[skip:], jnp.float32)  # noqa: E731
        return DPM2State(
            timesteps=per_eval(timesteps, t_mid),
            sigmas=per_eval(s_from, mid),
            step_sigmas=per_eval(s_from, s_to),
            dt=per_eval(mid - s_from, target - s_from),
            sigma_up=per_eval(zeros, sigma_up),
            second=jnp.asarray(second_stages(n)[skip:]),
            sample=jnp.zeros(shape, jnp.float32),
            num_inference_steps=n,
            init_noise_sigma=common.init_noise_sigma(cfg, sigmas.max()),
        )

    def _step(self, state: DPM2State, model_output, i, sample):
        """First evaluation of step k:  d = (x_k - x̂_0) / σ_k,  x̃ = x_k + (σ_mid - σ_k) d.
        Second (at x̃, σ_mid = √(σ_k σ_target)):  d̃ = (x̃ - x̂_0) / σ_mid,  x_{k+1} = x_k + (σ_target - σ_k) d̃.
        σ_target is σ_{k+1} (DPM2) or σ_down (ancestral). The last step, to σ_n = 0, is the first alone (Euler)."""
        x = sample.astype(jnp.float32)
        derivative = (x - self.predict_x0(state, model_output, i, x)) / state.sigmas[i]
        prev_sample = jnp.where(state.second[i], state.sample, x) + derivative * state.dt[i]
        return prev_sample, state.replace(sample=x)  # only a second stage reads `sample`, which its first wrote

    def step(self, state: DPM2State, model_output, i, sample, key=None):
        prev_sample, state = self._step(state, model_output, i, sample)
        return prev_sample.astype(sample.dtype), state


@dataclasses.dataclass(frozen=True)
class DPM2AncestralScheduler(DPM2Scheduler):
    config: DPM2AncestralConfig
    ancestral = True

    def step(self, state: DPM2State, model_output, i, sample, key=None, variance_noise=None):
        """DPM2's step towards σ_down, then x_{k+1} += σ_up z at a step's second evaluation, z ~ N(0, I) from `key`
        (or `variance_noise`); σ_up = 0 at first evaluations."""
        noise = common.draw_step_noise(key, variance_noise, sample.shape, "DPM2 ancestral adds fresh noise each step")
        prev_sample, state = self._step(state, model_output, i, sample)
        prev_sample = prev_sample + noise * state.sigma_up[i]
        return prev_sample.astype(sample.dtype), state
