"""DPM-Solver++(2S) ancestral: Lu et al. 2022, "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion
Probabilistic Models", Algorithm 1 (the second-order singlestep solver in data prediction) with k-diffusion's
ancestral split of each step, as Katherine Crowson's `sample_dpmpp_2s_ancestral` (eta = 1, s_noise = 1).

diffusers has no such class; the σ schedule and timesteps are its Euler samplers' (EulerAncestralDiscreteScheduler,
EulerDiscreteScheduler with Karras, exponential or beta σ), and the midpoints' timesteps are interpolated in log σ
as KDPM2's are.
"""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp
import numpy as np

from . import common
from .heun import TwoStageSampler, first_evaluation, interleave, require_shape, second_stages
from .sigma_config import SigmaRangeConfig


@dataclasses.dataclass(frozen=True)
class DPMpp2SAncestralConfig(SigmaRangeConfig):
    """Euler ancestral's defaults, and Euler's σ schedules and their end points."""


@flax.struct.dataclass
class DPMpp2SAncestralState:
    timesteps: jnp.ndarray  # float32 [evals]: t_0, t(σ_mid,0), t_1, ..., t_{n-1}
    sigmas: jnp.ndarray  # float32 [evals]: σ_0, σ_mid,0, σ_1, ...: where the model is evaluated
    step_sigmas: jnp.ndarray  # float32 [evals]: σ_k, σ_{k+1} for step k's two evaluations
    coef_sample: jnp.ndarray  # float32 [evals]: a in x' = a x + b x̂_0 + σ_up z (x: x_k at both evaluations)
    coef_x0: jnp.ndarray  # float32 [evals]: b
    sigma_up: jnp.ndarray  # float32 [evals]: 0 at first evaluations
    second: jnp.ndarray  # bool [evals]: the evaluation is a step's second (at the midpoint)
    sample: jnp.ndarray  # float32 [*shape]: x of the previous evaluation (x_k, when a second stage reads it)
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False)  # diffusers' Euler ancestral value for this n


def ancestral_step(sigma_from, sigma_to):
    """(σ_down, σ_up): σ_from -> σ_to as a deterministic move to σ_down plus fresh noise of std σ_up, with
    σ_up² = σ_to² (σ_from² - σ_to²) / σ_from² (the DDPM posterior's) capped at σ_to, σ_down² + σ_up² = σ_to²
    (k-diffusion's `get_ancestral_step` at eta = 1)."""
    sigma_up = np.minimum(sigma_to, np.sqrt(sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2))
    return np.sqrt(np.maximum(sigma_to**2 - sigma_up**2, 0)), sigma_up


@dataclasses.dataclass(frozen=True)
class DPMpp2SAncestralScheduler(TwoStageSampler):
    config: DPMpp2SAncestralConfig

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> DPMpp2SAncestralState:
        """`shape` of the samples (required: the state keeps x_k); `start` skips that many steps (img2img)."""
        shape = require_shape(shape, "DPM++ 2S ancestral")
        cfg, n = self.config, num_inference_steps
        timesteps, sigmas = common.discrete_sigma_schedule(cfg, n, sigma_min=cfg.sigma_min, sigma_max=cfg.sigma_max)
        s_from, s_to = sigmas[:-1].astype(np.float64), sigmas[1:].astype(np.float64)
        sigma_down, sigma_up = ancestral_step(s_from, s_to)
        # In t = -log σ (the half log-SNR λ of a VE schedule), step k goes t_k -> t_down = t_k + h, with a midpoint
        # s = t_k + h/2, σ_mid = √(σ_k σ_down). DPM-Solver++(1) from t_k in data prediction (Lu et al. 2022 §4, α = 1
        # in the σ view):
        #   x(t') = (σ(t')/σ_k) x_k - (e^{-(t'-t_k)} - 1) x̂_0,
        # taken to s with x̂_0(x_k, σ_k) (the first evaluation), then to t_down with x̂_0(x_mid, σ_mid) (the second).
        # The last step lands on σ_down = 0: x_n = x̂_0 (k-diffusion's Euler step there,
        # x_k + (x_k - x̂_0)/σ_k (0 - σ_k), is x̂_0 too).
        last = sigma_down == 0
        with np.errstate(divide="ignore"):
            h = np.log(s_from) - np.log(sigma_down)  # inf at the last step
        sigma_mid = np.sqrt(s_from * sigma_down)
        a_first = np.where(last, 0.0, sigma_mid / s_from)
        b_first = np.where(last, 1.0, -np.expm1(-h / 2))
        a_second, b_second = sigma_down / s_from, -np.expm1(-h)
        noise = np.where(s_to > 0, sigma_up, 0.0)  # added after the second evaluation
        t_mid = common.sigma_to_t(sigma_mid, np.log(common.train_sigmas(cfg)))
        skip = first_evaluation(start, n)
        per_eval = lambda first, second: jnp.asarray(interleave(first, second)[skip:], jnp.float32)  # noqa: E731
        return DPMpp2SAncestralState(
            timesteps=per_eval(timesteps, t_mid),
            sigmas=per_eval(s_from, sigma_mid),
            step_sigmas=per_eval(s_from, s_to),
            coef_sample=per_eval(a_first, a_second),
            coef_x0=per_eval(b_first, b_second),
            sigma_up=per_eval(np.zeros(n), noise),
            second=jnp.asarray(second_stages(n)[skip:]),
            sample=jnp.zeros(shape, jnp.float32),
            num_inference_steps=n,
            init_noise_sigma=common.init_noise_sigma(cfg, sigmas.max()),
        )

    def step(self, state: DPMpp2SAncestralState, model_output, i, sample, key=None, variance_noise=None):
        """First evaluation of step k:  x_mid = (σ_mid/σ_k) x_k - (e^{-h/2} - 1) x̂_0(x_k).
        Second:  x_{k+1} = (σ_down/σ_k) x_k - (e^{-h} - 1) x̂_0(x_mid) + σ_up z,  z ~ N(0, I) from `key`
        (or `variance_noise`)."""
        noise = common.draw_step_noise(key, variance_noise, sample.shape,
                                       "DPM++ 2S ancestral adds fresh noise each step")
        x = sample.astype(jnp.float32)
        x0 = self.predict_x0(state, model_output, i, x)
        x_k = jnp.where(state.second[i], state.sample, x)
        prev_sample = state.coef_sample[i] * x_k + state.coef_x0[i] * x0 + state.sigma_up[i] * noise
        # Only a second stage reads `sample`, which its first wrote.
        return prev_sample.astype(sample.dtype), state.replace(sample=x)
