"""Euler ancestral sampler (k-diffusion's `sample_euler_ancestral`; Karras et al. 2022, "Elucidating the Design
Space of Diffusion-Based Generative Models", on the DDPM ancestral split of Ho et al. 2020), matching diffusers'
EulerAncestralDiscreteScheduler."""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp
import numpy as np

from . import common
from .sigma_config import SigmaScheduleConfig


@dataclasses.dataclass(frozen=True)
class EulerAncestralConfig(SigmaScheduleConfig):
    """diffusers' EulerAncestralDiscreteScheduler fields, and the σ schedules its class has not but A1111's and
    ComfyUI's "Euler a" has: Euler's, placed as Euler places them."""

    rescale_betas_zero_snr: bool = False
    allowed_prediction_types = ("epsilon", "v_prediction")


@flax.struct.dataclass
class EulerAncestralState:
    timesteps: jnp.ndarray  # float32 [n]
    sigmas: jnp.ndarray  # float32 [n+1]: σ_i, descending, σ_n = 0
    sigma_down: jnp.ndarray  # float32 [n]: where the deterministic part of step i lands
    sigma_up: jnp.ndarray  # float32 [n]: std of the fresh noise step i adds
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False)  # diffusers' value for this n


@dataclasses.dataclass(frozen=True)
class EulerAncestralScheduler(common.SigmaSampler):
    config: EulerAncestralConfig

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> EulerAncestralState:
        """`shape` is accepted for symmetry with the multistep schedulers and ignored; `start` skips that many
        steps (img2img)."""
        timesteps, sigmas = common.discrete_sigma_schedule(
            self.config, num_inference_steps, zero_snr=self.config.rescale_betas_zero_snr
        )
        common.check_start(start, len(timesteps))
        init_noise_sigma = common.init_noise_sigma(self.config, sigmas.max())
        timesteps, sigmas = timesteps[start:], sigmas[start:]
        # Split σ_i -> σ_{i+1} into a deterministic move to σ_down and fresh noise of std σ_up, such that
        # σ_down² + σ_up² = σ_{i+1}², σ_up² = σ_{i+1}² (σ_i² - σ_{i+1}²) / σ_i²   (the DDPM posterior variance).
        s_from, s_to = sigmas[:-1], sigmas[1:]  # float32, as diffusers computes them
        sigma_up = np.sqrt(s_to**2 * (s_from**2 - s_to**2) / s_from**2)
        sigma_down = np.sqrt(np.maximum(s_to**2 - sigma_up**2, 0))  # ≥ 0 but for rounding
        return EulerAncestralState(
            timesteps=jnp.asarray(timesteps),
            sigmas=jnp.asarray(sigmas),
            sigma_down=jnp.asarray(sigma_down, jnp.float32),
            sigma_up=jnp.asarray(sigma_up, jnp.float32),
            num_inference_steps=num_inference_steps,
            init_noise_sigma=init_noise_sigma,
        )

    def step(self, state: EulerAncestralState, model_output, i, sample, key=None, variance_noise=None):
        """x_{i+1} = x + (σ_down - σ_i) (x - x̂_0) / σ_i + σ_up z,  z ~ N(0, I) from `key` (or `variance_noise`)."""
        z = common.draw_step_noise(key, variance_noise, sample.shape, "Euler ancestral adds fresh noise each step")
        x = sample.astype(jnp.float32)
        sigma = state.sigmas[i]
        derivative = (x - self.predict_x0(state, model_output, i, x)) / sigma
        prev_sample = x + derivative * (state.sigma_down[i] - sigma)
        prev_sample = prev_sample + z * state.sigma_up[i]
        return prev_sample.astype(sample.dtype), state
