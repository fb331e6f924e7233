"""A scheduler written outside sdflax: DDPM ancestral sampling (Ho et al. 2020) on an evenly spaced timestep grid.

It follows sdflax's scheduler protocol (`sdflax.schedulers.Scheduler`), so it plugs into the same compiled scan and
the pipeline:

    pipeline.scheduler = DDPMAncestral()
    images = pipeline(prompt_ids, params, jax.random.key(0), num_inference_steps=25).images
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class AncestralState:
    timesteps: jnp.ndarray  # int32 (n,), descending: where the model is evaluated
    alpha_prod: jnp.ndarray  # float32 (n,): ᾱ_t
    alpha_prod_prev: jnp.ndarray  # float32 (n,): ᾱ of the next timestep, 1 after the last
    init_noise_sigma: float = flax.struct.field(pytree_node=False, default=1.0)  # x_T ~ N(0, I)


@dataclasses.dataclass(frozen=True)
class AncestralConfig:
    beta_start: float = 0.00085  # Stable Diffusion's scaled_linear schedule
    beta_end: float = 0.012
    num_train_timesteps: int = 1000


@dataclasses.dataclass(frozen=True)
class DDPMAncestral:
    config: AncestralConfig = AncestralConfig()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]):
        """The β schedule of a diffusers scheduler_config.json (assumed scaled_linear); other keys are ignored."""
        names = {f.name for f in dataclasses.fields(AncestralConfig)}
        return cls(AncestralConfig(**{k: v for k, v in config.items() if k in names}))

    def check_steps(self, num_inference_steps):
        if not 1 <= num_inference_steps <= self.config.num_train_timesteps:
            raise ValueError(f"num_inference_steps must be in [1, {self.config.num_train_timesteps}]")

    def set_timesteps(self, num_inference_steps, shape=None, start=0):
        """n evenly spaced timesteps from T - 1 down to 0; `start` skips that many (img2img)."""
        self.check_steps(num_inference_steps)
        cfg = self.config
        T = cfg.num_train_timesteps
        betas = np.linspace(cfg.beta_start**0.5, cfg.beta_end**0.5, T) ** 2
        alpha_prod = np.cumprod(1 - betas)
        t = np.linspace(T - 1, 0, num_inference_steps).round().astype(np.int32)[start:]
        prev = np.append(alpha_prod[t[1:]], 1.0)
        return AncestralState(jnp.asarray(t), jnp.asarray(alpha_prod[t], jnp.float32), jnp.asarray(prev, jnp.float32))

    def scale_model_input(self, state, x, i):
        return x

    def predict_x0(self, state, eps, i, x):
        """x̂₀ = (x_t − √(1−ᾱ_t) ε) / √ᾱ_t."""
        a = state.alpha_prod[i]
        return (x - jnp.sqrt(1 - a) * eps) / jnp.sqrt(a)

    def step(self, state, eps, i, x, key=None):
        """Sample the posterior q(x_prev | x_t, x̂₀) (Ho et al. eq. 6–7) with α = ᾱ_t / ᾱ_prev."""
        a, a_prev = state.alpha_prod[i], state.alpha_prod_prev[i]
        alpha = a / a_prev
        x0 = self.predict_x0(state, eps, i, x)
        mean = (jnp.sqrt(a_prev) * (1 - alpha) * x0 + jnp.sqrt(alpha) * (1 - a_prev) * x) / (1 - a)
        variance = (1 - alpha) * (1 - a_prev) / (1 - a)  # 0 at the last step: the mean is x̂₀ there
        return mean + jnp.sqrt(variance) * jax.random.normal(key, x.shape, x.dtype), state

    def add_noise(self, state, x0, noise, i):
        """q(x_t | x₀) = N(√ᾱ_t x₀, (1−ᾱ_t) I) at t = timesteps[i] (Ho et al. eq. 4)."""
        a = state.alpha_prod[i]
        return jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise
