"""Euler sampler: Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models",
Algorithm 1 without the second-order correction (k-diffusion's `sample_euler`), matching diffusers'
EulerDiscreteScheduler."""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp

from . import common
from .sigma_config import FINAL_SIGMAS_TYPES, SigmaRangeConfig


@dataclasses.dataclass(frozen=True)
class EulerConfig(SigmaRangeConfig):
    final_sigmas_type: str = "zero"
    rescale_betas_zero_snr: bool = False

    choices = {"final_sigmas_type": FINAL_SIGMAS_TYPES}
    unsupported = {
        "interpolation_type": ("linear",),
        "timestep_type": ("discrete",),
    }


@flax.struct.dataclass
class EulerState:
    timesteps: jnp.ndarray  # float32 [n]: where the model is evaluated (fractional for linspace / Karras)
    sigmas: jnp.ndarray  # float32 [n+1]: σ_i, descending; σ_n after the last step
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False)  # diffusers' value for this n


@dataclasses.dataclass(frozen=True)
class EulerScheduler(common.SigmaSampler):
    config: EulerConfig
    custom_schedules = ("timesteps", "sigmas")

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> EulerState:
        """`shape` is accepted for symmetry with the multistep schedulers and ignored; `start` skips that many
        steps (img2img)."""
        cfg = self.config
        timesteps, sigmas = common.discrete_sigma_schedule(
            cfg, num_inference_steps, sigma_min=cfg.sigma_min, sigma_max=cfg.sigma_max,
            final_sigma=cfg.final_sigmas_type, zero_snr=cfg.rescale_betas_zero_snr,
        )
        common.check_start(start, len(timesteps))
        return EulerState(
            timesteps=jnp.asarray(timesteps[start:]),
            sigmas=jnp.asarray(sigmas[start:]),
            num_inference_steps=num_inference_steps,
            init_noise_sigma=common.init_noise_sigma(cfg, sigmas.max()),
        )

    def step(self, state: EulerState, model_output, i, sample, key=None):
        """d = (x - x̂_0) / σ_i,  x_{i+1} = x + (σ_{i+1} - σ_i) d   (the ODE dx/dσ = d, one Euler step)."""
        x = sample.astype(jnp.float32)
        derivative = (x - self.predict_x0(state, model_output, i, x)) / state.sigmas[i]
        prev_sample = x + derivative * (state.sigmas[i + 1] - state.sigmas[i])
        return prev_sample.astype(sample.dtype), state
