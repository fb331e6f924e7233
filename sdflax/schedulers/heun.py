"""Heun sampler: Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models",
Algorithm 2 with S_churn = 0 (k-diffusion's `sample_heun`), matching diffusers' HeunDiscreteScheduler.

Also what the two-evaluation samplers (Heun, DPM2, DPM++ 2S ancestral, DPM++ SDE) share: one entry of
`state.timesteps` per model evaluation, laid out as diffusers interleaves them, and a step that does the first or
the second stage of a step by looking up `i` in per-evaluation arrays, with no Python branch on `i`.
"""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp
import numpy as np

from . import common
from .sigma_config import SigmaRangeConfig


def interleave(first, second) -> np.ndarray:
    """Per-evaluation values from per-step ones, in diffusers' order: [f_0, s_0, f_1, s_1, ..., f_{n-1}]. Each step
    evaluates the model twice, but the last, which lands on σ = 0, has only its first stage (an Euler step):
    2n - 1 evaluations."""
    first, second = np.asarray(first), np.asarray(second)
    return np.append(np.stack([first[:-1], second[:-1]], axis=1).ravel(), first[-1])


def second_stages(n: int) -> np.ndarray:
    """bool (2n - 1,): True at the evaluations that finish a step (a step's second)."""
    return interleave(np.zeros(n, bool), np.ones(n, bool))


def first_evaluation(start: int, n: int) -> int:
    """img2img skips `start` steps (diffusers' `set_begin_index(start * order)`): the first 2 start evaluations."""
    common.check_start(start, n)
    return 2 * start


def require_shape(shape, sampler: str):
    if shape is None:
        raise ValueError(f"{sampler} keeps the sample between the two evaluations of a step: call "
                         "set_timesteps(n, shape=sample.shape)")
    return tuple(shape)


class TwoStageSampler(common.SigmaSampler):
    """A σ sampler whose steps take two model evaluations. `state.sigmas` (evals,) is the σ the model sees at each
    evaluation (scale_model_input, predict_x0); `state.step_sigmas` (evals,) is diffusers' `sigmas[step_index]`,
    σ_k at step k's first evaluation and σ_{k+1} at its second, which add_noise uses."""

    def add_noise(self, state, original_samples, noise, i):
        """x_0 + σ ε at diffusers' σ of evaluation i: img2img starts at a step's first evaluation (σ_k);
        inpainting noises the known region to the next evaluation's."""
        noisy = original_samples.astype(jnp.float32) + noise.astype(jnp.float32) * state.step_sigmas[i]
        return noisy.astype(original_samples.dtype)


@dataclasses.dataclass(frozen=True)
class HeunConfig(SigmaRangeConfig):
    beta_start: float = 0.00085  # diffusers' HeunDiscreteScheduler defaults
    beta_end: float = 0.012
    clip_sample: bool = False
    clip_sample_range: float = 1.0


@flax.struct.dataclass
class HeunState:
    timesteps: jnp.ndarray  # float32 [evals]: t_0, t_1, t_1, t_2, t_2, ..., t_{n-1}
    sigmas: jnp.ndarray  # float32 [evals]: σ_0, σ_1, σ_1, ..., σ_{n-1}: where the model is evaluated
    dt: jnp.ndarray  # float32 [evals]: σ_{k+1} - σ_k at both evaluations of step k
    second: jnp.ndarray  # bool [evals]: the evaluation is a step's second (the corrector)
    derivative: jnp.ndarray  # float32 [*shape]: d of the previous evaluation (the predictor's, for its corrector)
    sample: jnp.ndarray  # float32 [*shape]: x of the previous evaluation (x_k, when a corrector reads it)
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False)  # diffusers' value for this n

    @property
    def step_sigmas(self):
        return self.sigmas  # Heun's corrector is evaluated at σ_{k+1}, where diffusers' table has it too


@dataclasses.dataclass(frozen=True)
class HeunScheduler(TwoStageSampler):
    config: HeunConfig
    custom_schedules = ("timesteps",)

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> HeunState:
        """`shape` of the samples (required: the state keeps x_k and d_k); `start` skips that many steps (img2img)."""
        shape = require_shape(shape, "Heun")
        cfg = self.config
        # Euler's schedule: σ interpolated at the spaced timesteps, or redistributed by the config's use_*_sigmas
        # between their end points, with the timesteps following the σ.
        timesteps, sigmas = common.discrete_sigma_schedule(cfg, num_inference_steps, sigma_min=cfg.sigma_min,
                                                           sigma_max=cfg.sigma_max)
        n, skip = num_inference_steps, first_evaluation(start, num_inference_steps)
        # Step k: predictor at (σ_k, t_k), corrector at (σ_{k+1}, t_{k+1}); both move by σ_{k+1} - σ_k.
        t_next = np.append(timesteps[1:], 0.0)  # the last step has no corrector: its entry is dropped
        dt = sigmas[1:] - sigmas[:-1]  # float32, as diffusers' `sigma_next - sigma_hat`
        return HeunState(
            timesteps=jnp.asarray(interleave(timesteps, t_next)[skip:], jnp.float32),
            sigmas=jnp.asarray(interleave(sigmas[:-1], sigmas[1:])[skip:], jnp.float32),
            dt=jnp.asarray(interleave(dt, dt)[skip:], jnp.float32),
            second=jnp.asarray(second_stages(n)[skip:]),
            derivative=jnp.zeros(shape, jnp.float32),
            sample=jnp.zeros(shape, jnp.float32),
            num_inference_steps=n,
            init_noise_sigma=common.init_noise_sigma(cfg, sigmas.max()),
        )

    def predict_x0(self, state, model_output, i, sample):
        return common.clip_x0(self.config, super().predict_x0(state, model_output, i, sample))

    def step(self, state: HeunState, model_output, i, sample, key=None):
        """Predictor (first evaluation of step k):  d_k = (x_k - x̂_0) / σ_k,  x̃ = x_k + (σ_{k+1} - σ_k) d_k.
        Corrector (second, at x̃):  d̃ = (x̃ - x̂_0) / σ_{k+1},  x_{k+1} = x_k + (σ_{k+1} - σ_k) (d_k + d̃) / 2.
        The last step, to σ_n = 0, is the predictor alone (an Euler step)."""
        x = sample.astype(jnp.float32)
        derivative = (x - self.predict_x0(state, model_output, i, x)) / state.sigmas[i]
        second = state.second[i]
        slope = jnp.where(second, (state.derivative + derivative) / 2, derivative)
        prev_sample = jnp.where(second, state.sample, x) + slope * state.dt[i]
        # Kept at every evaluation; only a corrector reads them, and its predictor wrote them.
        return prev_sample.astype(sample.dtype), state.replace(derivative=derivative, sample=x)
