"""DDPM ancestral sampler: Ho et al. 2020, "Denoising Diffusion Probabilistic Models", matching diffusers'
DDPMScheduler on any subset of the training timesteps (eq. 6-7 with ᾱ taken at the visited timesteps)."""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp
import numpy as np

from . import common

# fixed_small: σ_t² = β̃_t, the posterior variance (the paper's lower bound); fixed_small_log: the same through
# exp(½ log β̃_t); fixed_large: σ_t² = β_t (the upper bound). diffusers' fixed_large_log gives √(log β_t) = NaN
# in its step, and learned / learned_range need a UNet with twice the output channels: not offered.
VARIANCE_TYPES = ("fixed_small", "fixed_small_log", "fixed_large")


@dataclasses.dataclass(frozen=True)
class DDPMConfig(common.ScheduleConfig):
    variance_type: str = "fixed_small"
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    rescale_betas_zero_snr: bool = False

    choices = {"variance_type": VARIANCE_TYPES}


@flax.struct.dataclass
class DDPMState:
    timesteps: jnp.ndarray  # int32 [n]
    alpha_prod_t: jnp.ndarray  # float32 [n]: ᾱ_t
    x0_coeff: jnp.ndarray  # float32 [n]: √ᾱ_{t'} β_t / (1-ᾱ_t), t' the next timestep visited (ᾱ_{t'} = 1 after the last)
    sample_coeff: jnp.ndarray  # float32 [n]: √α_t (1-ᾱ_{t'}) / (1-ᾱ_t)
    noise_std: jnp.ndarray  # float32 [n]: σ_t of the fresh noise, 0 where t = 0
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    stochastic: bool = flax.struct.field(pytree_node=False)  # some step adds noise: step needs a key
    init_noise_sigma: float = flax.struct.field(pytree_node=False, default=1.0)  # x_T ~ N(0, I)


@dataclasses.dataclass(frozen=True)
class DDPMScheduler(common.SchedulerBase):
    config: DDPMConfig
    custom_schedules = ("timesteps",)  # each step goes to the next listed timestep, as diffusers' custom_timesteps

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> DDPMState:
        """`shape` is accepted for symmetry with the multistep schedulers and ignored; `start` skips that many
        steps (img2img: diffusers' DDPM finds each step's successor by value, so a late start needs nothing else)."""
        cfg = self.config
        alpha_prod, _ = common.alphas_cumprod(cfg, rescale_zero_snr=cfg.rescale_betas_zero_snr, torch_rounding=True)
        timesteps = common.spaced_timesteps(cfg, num_inference_steps)
        common.check_start(start, len(timesteps))
        # Unlike DDIM, the step goes to the next timestep actually visited, and past the last one to ᾱ = 1.
        prev_timesteps = np.append(timesteps[1:], -1)
        timesteps, prev_timesteps = timesteps[start:], prev_timesteps[start:]

        # float32 scalar arithmetic in diffusers' order, so every coefficient is torch's to the last bit.
        a_t = common.alpha_prod_at(alpha_prod, np.float32(1.0), timesteps)
        a_prev = common.alpha_prod_at(alpha_prod, np.float32(1.0), prev_timesteps)
        one = np.float32(1.0)
        beta_prod_t, beta_prod_prev = one - a_t, one - a_prev
        alpha_t = a_t / a_prev  # α_t = ᾱ_t / ᾱ_{t'}: one step of the visited chain
        beta_t = one - alpha_t
        # μ̃_t(x_t, x̂_0) = √ᾱ_{t'} β_t / (1-ᾱ_t) x̂_0 + √α_t (1-ᾱ_{t'}) / (1-ᾱ_t) x_t   (paper eq. 7)
        x0_coeff = np.sqrt(a_prev) * beta_t / beta_prod_t
        sample_coeff = np.sqrt(alpha_t) * beta_prod_prev / beta_prod_t
        # β̃_t = (1-ᾱ_{t'}) / (1-ᾱ_t) β_t, clamped as diffusers (it takes logs of it)
        small = np.maximum(beta_prod_prev / beta_prod_t * beta_t, np.float32(1e-20))
        std = {
            "fixed_small": np.sqrt(small),
            "fixed_small_log": np.exp(np.float32(0.5) * np.log(small)),
            "fixed_large": np.sqrt(beta_t),
        }[cfg.variance_type]
        std = np.where(timesteps > 0, std, np.float32(0.0)).astype(np.float32)  # x_0 is returned without noise
        return DDPMState(
            timesteps=jnp.asarray(timesteps, jnp.int32),
            alpha_prod_t=jnp.asarray(a_t, jnp.float32),
            x0_coeff=jnp.asarray(x0_coeff, jnp.float32),
            sample_coeff=jnp.asarray(sample_coeff, jnp.float32),
            noise_std=jnp.asarray(std),
            num_inference_steps=num_inference_steps,
            stochastic=bool((timesteps > 0).any()),
        )

    def scale_model_input(self, state: DDPMState, sample, i):
        return sample

    def predict_x0(self, state: DDPMState, model_output, i, sample):
        """x̂_0 at evaluation i, float32: diffusers' pred_original_sample (clipped with `clip_sample`)."""
        pred_x0, _ = common.predict_x0_and_epsilon(
            model_output, sample, *common.alpha_sigma(state.alpha_prod_t[i]), self.config.prediction_type)
        return common.clip_x0(self.config, pred_x0)

    def add_noise(self, state: DDPMState, original_samples, noise, i):
        """q(x_t | x_0): √ᾱ_t x_0 + √(1-ᾱ_t) ε at t = timesteps[i] (img2img's start)."""
        return common.add_noise(original_samples, noise, state.alpha_prod_t[i])

    def step(self, state: DDPMState, model_output, i, sample, key=None, variance_noise=None):
        """x_t -> x_{t'} ~ N(μ̃_t(x_t, x̂_0), σ_t² I): the noise z from a PRNG `key` or given as `variance_noise`."""
        z = common.draw_step_noise(key, variance_noise, sample.shape,
                                   "DDPM adds fresh noise at every step but the one at t = 0", state.stochastic)
        x = sample.astype(jnp.float32)
        pred_x0 = self.predict_x0(state, model_output, i, x)
        prev_sample = state.x0_coeff[i] * pred_x0 + state.sample_coeff[i] * x
        if z is not None:
            prev_sample = prev_sample + state.noise_std[i] * z
        return prev_sample.astype(sample.dtype), state
