"""Trajectory Consistency Distillation sampler: Zheng et al. 2024, "Trajectory Consistency Distillation: Improved
Latent Consistency Distillation by Semi-Linear Consistency Function with Trajectory Mapping" (its strategic
stochastic sampling), matching diffusers' TCDScheduler. Steps over LCM's schedule (lcm.py)."""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp
import numpy as np

from . import common
from .lcm import ConsistencySampler, ConsistencyScheduleConfig, alphas, consistency_timesteps


@dataclasses.dataclass(frozen=True)
class TCDConfig(ConsistencyScheduleConfig):
    # γ, the paper's stochasticity: 0 is deterministic (a DDIM jump along the trajectory), 1 is LCM-like
    # re-noising. Not a diffusers config key: diffusers passes it to step, whose own default is 0.3 (the paper's
    # recommendation), but its pipelines pass their `eta`, 0.0 unless given. This is the pipeline's default, as
    # DDIM's: `scheduler_config={"eta": 0.3}` for the paper's setting.
    eta: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"eta={self.eta!r} (TCD's gamma) must be in [0, 1]")


@flax.struct.dataclass
class TCDState:
    timesteps: jnp.ndarray  # int32 [n]
    alpha_prod_t: jnp.ndarray  # float32 [n]: ᾱ_t
    alpha_prod_s: jnp.ndarray  # float32 [n]: ᾱ_s, s = ⌊(1-γ) t'⌋ where the trajectory is mapped to, t' the next step
    sqrt_ratio: jnp.ndarray  # float32 [n]: √(ᾱ_{t'}/ᾱ_s); 1 where no noise is added
    sqrt_one_minus_ratio: jnp.ndarray  # float32 [n]: √(1 - ᾱ_{t'}/ᾱ_s); 0 where no noise is added
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    stochastic: bool = flax.struct.field(pytree_node=False)  # γ > 0 and more than one step
    init_noise_sigma: float = flax.struct.field(pytree_node=False, default=1.0)  # x_T ~ N(0, I)


@dataclasses.dataclass(frozen=True)
class TCDScheduler(ConsistencySampler):
    config: TCDConfig

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> TCDState:
        """`shape` is accepted for symmetry with the multistep schedulers and ignored; `start` skips that many
        steps (img2img, as diffusers' `set_begin_index`)."""
        alpha_prod = alphas(self.config)
        timesteps = consistency_timesteps(self.config, num_inference_steps)
        common.check_start(start, len(timesteps))
        timesteps = timesteps[start:]
        next_timesteps = np.append(timesteps[1:], 0)  # the last step maps to t = 0
        # s = ⌊(1-γ) t'⌋, in float32 as diffusers
        s = np.floor(np.float32(1.0 - self.config.eta) * next_timesteps.astype(np.float32)).astype(np.int64)
        a_next, a_s = alpha_prod[next_timesteps], alpha_prod[s]
        stochastic = self.config.eta > 0 and len(timesteps) > 1
        # x_{t'} = √(ᾱ_{t'}/ᾱ_s) x_s + √(1 - ᾱ_{t'}/ᾱ_s) z: forward from s back up to t' (not at the last step)
        ratio = a_next / a_s
        renoise = stochastic & (np.arange(len(timesteps)) < len(timesteps) - 1)
        sqrt_ratio = np.where(renoise, np.sqrt(ratio), np.float32(1.0))
        sqrt_one_minus_ratio = np.where(renoise, np.sqrt(np.float32(1.0) - ratio), np.float32(0.0))
        return TCDState(
            timesteps=jnp.asarray(timesteps, jnp.int32),
            alpha_prod_t=jnp.asarray(alpha_prod[timesteps]),
            alpha_prod_s=jnp.asarray(a_s),
            sqrt_ratio=jnp.asarray(sqrt_ratio, jnp.float32),
            sqrt_one_minus_ratio=jnp.asarray(sqrt_one_minus_ratio, jnp.float32),
            num_inference_steps=num_inference_steps,
            stochastic=stochastic,
        )

    def _predict(self, state: TCDState, model_output, i, sample):
        return common.predict_x0_and_epsilon(
            model_output, sample, *common.alpha_sigma(state.alpha_prod_t[i]), self.config.prediction_type)

    def predict_x0(self, state: TCDState, model_output, i, sample):
        """x̂_0 at evaluation i, float32 (diffusers' pred_original_sample; TCD does not clip it)."""
        return self._predict(state, model_output, i, sample)[0]

    def step(self, state: TCDState, model_output, i, sample, key=None, variance_noise=None):
        """x_t -> x_s = √ᾱ_s x̂_0 + √(1-ᾱ_s) ε̂ (the trajectory mapped to s = ⌊(1-γ) t'⌋ ≤ t'), then for γ > 0
        forward to t' with fresh z from a PRNG `key` (or `variance_noise`); the last step returns x_s, s = 0."""
        z = common.draw_step_noise(key, variance_noise, sample.shape, "TCD with eta > 0 adds fresh noise",
                                   state.stochastic)
        pred_x0, pred_epsilon = self._predict(state, model_output, i, sample)
        alpha_prod_s = state.alpha_prod_s[i]
        pred_noised = jnp.sqrt(alpha_prod_s) * pred_x0 + jnp.sqrt(1.0 - alpha_prod_s) * pred_epsilon
        prev_sample = pred_noised
        if z is not None:
            prev_sample = state.sqrt_ratio[i] * pred_noised + state.sqrt_one_minus_ratio[i] * z
        return prev_sample.astype(sample.dtype), state
