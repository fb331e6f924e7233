"""DDIM sampler: Song et al. 2021, "Denoising Diffusion Implicit Models"."""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from . import common


@dataclasses.dataclass(frozen=True)
class DDIMConfig(common.ScheduleConfig):
    set_alpha_to_one: bool = True
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    rescale_betas_zero_snr: bool = False
    eta: float = 0.0  # not a diffusers config key (diffusers passes it to step): the pipeline's default for step


@flax.struct.dataclass
class DDIMState:
    timesteps: jnp.ndarray  # int32 [n]
    alpha_prod_t: jnp.ndarray  # float32 [n]: ᾱ_t
    alpha_prod_t_prev: jnp.ndarray  # float32 [n]: ᾱ_{t-δ}, δ = T // n (ᾱ_final past the end)
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False, default=1.0)  # x_T ~ N(0, I)


@dataclasses.dataclass(frozen=True)
class DDIMScheduler(common.SchedulerBase):
    config: DDIMConfig

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> DDIMState:
        """`shape` is accepted for symmetry with PNDM and ignored; `start` skips that many steps (img2img)."""
        cfg = self.config
        alpha_prod, final_alpha_prod = common.alphas_cumprod(cfg, rescale_zero_snr=cfg.rescale_betas_zero_snr)
        timesteps = common.spaced_timesteps(cfg, num_inference_steps)
        # As diffusers: the previous timestep is always t - T // n, even for `trailing`/`linspace` spacing
        # where that is not the next entry of `timesteps`.
        prev_timesteps = timesteps - cfg.num_train_timesteps // num_inference_steps
        common.check_start(start, len(timesteps))
        timesteps, prev_timesteps = timesteps[start:], prev_timesteps[start:]
        return DDIMState(
            timesteps=jnp.asarray(timesteps, jnp.int32),
            alpha_prod_t=jnp.asarray(common.alpha_prod_at(alpha_prod, final_alpha_prod, timesteps)),
            alpha_prod_t_prev=jnp.asarray(common.alpha_prod_at(alpha_prod, final_alpha_prod, prev_timesteps)),
            num_inference_steps=num_inference_steps,
        )

    def scale_model_input(self, state: DDIMState, sample, i):
        return sample

    def _predict(self, state: DDIMState, model_output, i, sample):
        """(x̂_0, ε̂) at evaluation i; x̂_0 clipped with `clip_sample` (ε̂ is not recomputed, as diffusers)."""
        pred_x0, pred_epsilon = common.predict_x0_and_epsilon(
            model_output, sample, *common.alpha_sigma(state.alpha_prod_t[i]), self.config.prediction_type)
        return common.clip_x0(self.config, pred_x0), pred_epsilon

    def predict_x0(self, state: DDIMState, model_output, i, sample):
        """x̂_0 at evaluation i, float32: diffusers' pred_original_sample (clipped with `clip_sample`)."""
        return self._predict(state, model_output, i, sample)[0]

    def add_noise(self, state: DDIMState, original_samples, noise, i):
        """q(x_t | x_0): √ᾱ_t x_0 + √(1-ᾱ_t) ε at t = timesteps[i] (img2img's start)."""
        return common.add_noise(original_samples, noise, state.alpha_prod_t[i])

    def step(self, state: DDIMState, model_output, i, sample, key=None, eta=None, variance_noise=None):
        """x_t -> x_{t-δ}. eta = 0 is deterministic DDIM, eta = 1 is DDPM-like ancestral sampling; for
        eta > 0 pass a PRNG `key` or the standard-normal `variance_noise` itself. `eta` defaults to the
        config's, so `scheduler_config={"eta": 1.0}` reaches the sampling loop."""
        eta = self.config.eta if eta is None else eta
        try:
            adds_noise = float(eta) > 0  # as diffusers: noise only for eta > 0
        except jax.errors.ConcretizationTypeError:
            adds_noise = True  # traced eta: add σ_t z, which is 0 when eta is 0
        z = common.draw_step_noise(key, variance_noise, sample.shape,
                                   "eta > 0 (or a traced eta) adds noise (use eta=0.0 for plain DDIM)", adds_noise)

        x = sample.astype(jnp.float32)
        alpha_prod_t, alpha_prod_t_prev = state.alpha_prod_t[i], state.alpha_prod_t_prev[i]
        pred_x0, pred_epsilon = self._predict(state, model_output, i, x)

        # σ_t = η √((1-ᾱ_{t-δ})/(1-ᾱ_t)) √(1 - ᾱ_t/ᾱ_{t-δ})   (paper eq. 16)
        variance = ((1.0 - alpha_prod_t_prev) / (1.0 - alpha_prod_t)) * (1.0 - alpha_prod_t / alpha_prod_t_prev)
        std_dev_t = eta * jnp.sqrt(variance)

        # x_{t-δ} = √ᾱ_{t-δ} x̂_0 + √(1-ᾱ_{t-δ}-σ_t²) ε̂ + σ_t z   (paper eq. 12)
        direction = jnp.sqrt(1.0 - alpha_prod_t_prev - std_dev_t**2) * pred_epsilon
        prev_sample = jnp.sqrt(alpha_prod_t_prev) * pred_x0 + direction
        if z is not None:
            prev_sample = prev_sample + std_dev_t * z
        return prev_sample.astype(sample.dtype), state
