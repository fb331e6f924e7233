"""Latent Consistency Model sampler: Luo et al. 2023, "Latent Consistency Models: Synthesizing High-Resolution
Images with Few-Step Inference" (multistep latent consistency sampling; the boundary condition of Song et al. 2023,
"Consistency Models"), matching diffusers' LCMScheduler.

Also the timestep schedule that TCD (tcd.py) shares: the n steps are taken from the `original_inference_steps`
evenly spaced timesteps the model was distilled on.
"""

from __future__ import annotations

import dataclasses
import numbers

import flax
import jax.numpy as jnp
import numpy as np

from . import common

SIGMA_DATA = 0.5  # σ_data of the consistency-model boundary condition, as diffusers (and Song et al. 2023)


@dataclasses.dataclass(frozen=True)
class ConsistencyScheduleConfig(common.ScheduleConfig):
    """What LCM and TCD share: the Stable Diffusion schedule the models are distilled from, and the distillation
    grid. `steps_offset`, `timestep_spacing` and `set_alpha_to_one` are kept for the config format but change
    nothing: these samplers never step past the grid's timesteps, and space them their own way."""

    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    set_alpha_to_one: bool = True
    original_inference_steps: int = 50
    rescale_betas_zero_snr: bool = False

    def __post_init__(self):
        super().__post_init__()
        T, steps = self.num_train_timesteps, self.original_inference_steps
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 1 <= steps <= T:
            raise ValueError(f"original_inference_steps={steps!r} must be an int in [1, {T}] (num_train_timesteps)")


def check_steps(config: ConsistencyScheduleConfig, num_inference_steps) -> None:
    """Raise unless 1 <= n <= original_inference_steps: the n steps are a subset of the distillation grid (or n
    is the custom schedule's length: diffusers takes timesteps off the grid, and more of them, with a warning)."""
    n, T, steps = num_inference_steps, config.num_train_timesteps, config.original_inference_steps
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"num_inference_steps must be an int, got {' '.join(repr(n).split()):.80}")
    if (custom := common.custom_steps(config)) is not None:
        if n != custom:
            raise ValueError(f"num_inference_steps={n}, but the custom schedule has {custom} steps")
        return
    if not 1 <= n <= T:
        raise ValueError(f"num_inference_steps must be in [1, {T}] (num_train_timesteps), got {n}")
    if n > steps:
        raise ValueError(f"num_inference_steps={n} is more than original_inference_steps={steps}: the steps are "
                         f"a subset of the {steps} timesteps the model was distilled on")


def consistency_timesteps(config: ConsistencyScheduleConfig, num_inference_steps: int) -> np.ndarray:
    """The n timesteps, descending, int64: from the distillation grid t_j = j ⌊T/N⌋ - 1, j = 1..N (N =
    original_inference_steps), every (N/n)-th counted from the top, ⌊k N/n⌋ for k = 0..n-1 (diffusers' indices)."""
    check_steps(config, num_inference_steps)
    if config.custom_timesteps is not None:  # as given (diffusers' `set_timesteps(timesteps=...)`)
        return np.asarray(config.custom_timesteps, np.int64)
    T, N = config.num_train_timesteps, config.original_inference_steps
    grid = (np.arange(1, N + 1, dtype=np.int64) * (T // N) - 1)[::-1]
    indices = np.floor(np.linspace(0, N, num=num_inference_steps, endpoint=False)).astype(np.int64)
    return grid[indices]


def alphas(config: ConsistencyScheduleConfig) -> np.ndarray:
    """ᾱ_t for t = 0..T-1, float32, torch's to the last bit."""
    return common.alphas_cumprod(config, rescale_zero_snr=config.rescale_betas_zero_snr, torch_rounding=True)[0]


class ConsistencySampler(common.SchedulerBase):
    """What LCM and TCD share beyond the schedule: the step count check, identity input scaling, and noising."""

    custom_schedules = ("timesteps",)  # each step goes to the next listed timestep, as diffusers' custom_timesteps

    def check_steps(self, num_inference_steps: int) -> None:
        check_steps(self.config, num_inference_steps)

    def scale_model_input(self, state, sample, i):
        return sample

    def add_noise(self, state, original_samples, noise, i):
        """q(x_t | x_0): √ᾱ_t x_0 + √(1-ᾱ_t) ε at t = timesteps[i] (img2img's start)."""
        return common.add_noise(original_samples, noise, state.alpha_prod_t[i])


@dataclasses.dataclass(frozen=True)
class LCMConfig(ConsistencyScheduleConfig):
    clip_sample: bool = False
    clip_sample_range: float = 1.0
    timestep_scaling: float = 10.0


@flax.struct.dataclass
class LCMState:
    timesteps: jnp.ndarray  # int32 [n]
    alpha_prod_t: jnp.ndarray  # float32 [n]: ᾱ_t
    c_skip: jnp.ndarray  # float32 [n]: the boundary-condition weights at t, c_skip(0) = 1, c_out(0) = 0
    c_out: jnp.ndarray  # float32 [n]
    sqrt_alpha_prod_next: jnp.ndarray  # float32 [n]: √ᾱ_{t'} of the next timestep t'; 1 at the last step
    sqrt_beta_prod_next: jnp.ndarray  # float32 [n]: √(1-ᾱ_{t'}); 0 at the last step, which returns x̂_0 itself
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    stochastic: bool = flax.struct.field(pytree_node=False)  # more than one step: some step re-noises
    init_noise_sigma: float = flax.struct.field(pytree_node=False, default=1.0)  # x_T ~ N(0, I)


@dataclasses.dataclass(frozen=True)
class LCMScheduler(ConsistencySampler):
    config: LCMConfig

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> LCMState:
        """`shape` is accepted for symmetry with the multistep schedulers and ignored; `start` skips that many
        steps (img2img, as diffusers' `set_begin_index`; LatentConsistencyModelImg2ImgPipeline's `strength`
        instead shortens the distillation grid, another schedule)."""
        alpha_prod = alphas(self.config)
        timesteps = consistency_timesteps(self.config, num_inference_steps)
        common.check_start(start, len(timesteps))
        timesteps = timesteps[start:]
        a_t = alpha_prod[timesteps]
        a_next = alpha_prod[timesteps[1:]]
        # c_skip(t) = σ_d² / ((s t)² + σ_d²),  c_out(t) = s t / √((s t)² + σ_d²),  s = timestep_scaling:
        # f(x, t) = c_skip x + c_out x̂_0 is the identity at t = 0 (float32, in diffusers' order).
        scaled = timesteps.astype(np.float32) * np.float32(self.config.timestep_scaling)
        sigma_data_sq = np.float32(SIGMA_DATA**2)
        c_skip = sigma_data_sq / (scaled**2 + sigma_data_sq)
        c_out = scaled / np.sqrt(scaled**2 + sigma_data_sq)
        return LCMState(
            timesteps=jnp.asarray(timesteps, jnp.int32),
            alpha_prod_t=jnp.asarray(a_t),
            c_skip=jnp.asarray(c_skip, jnp.float32),
            c_out=jnp.asarray(c_out, jnp.float32),
            sqrt_alpha_prod_next=jnp.asarray(np.append(np.sqrt(a_next), np.float32(1.0)), jnp.float32),
            sqrt_beta_prod_next=jnp.asarray(np.append(np.sqrt(np.float32(1.0) - a_next), np.float32(0.0)),
                                            jnp.float32),
            num_inference_steps=num_inference_steps,
            stochastic=len(timesteps) > 1,
        )

    def predict_x0(self, state: LCMState, model_output, i, sample):
        """The consistency function's x̂_0 at evaluation i, float32: c_skip x + c_out x̂_0(ε̂) (diffusers'
        `denoised`, what the last step returns)."""
        x = sample.astype(jnp.float32)
        pred_x0, _ = common.predict_x0_and_epsilon(
            model_output, x, *common.alpha_sigma(state.alpha_prod_t[i]), self.config.prediction_type)
        pred_x0 = common.clip_x0(self.config, pred_x0)
        return state.c_out[i] * pred_x0 + state.c_skip[i] * x

    def step(self, state: LCMState, model_output, i, sample, key=None, variance_noise=None):
        """x_t -> √ᾱ_{t'} f(x_t, t) + √(1-ᾱ_{t'}) z: denoise to x̂_0 in one jump, then re-noise to the next timestep
        t' with fresh z from a PRNG `key` (or `variance_noise`); the last step returns f(x_t, t)."""
        z = common.draw_step_noise(key, variance_noise, sample.shape, "LCM re-noises between steps",
                                   state.stochastic)
        denoised = self.predict_x0(state, model_output, i, sample)
        prev_sample = state.sqrt_alpha_prod_next[i] * denoised
        if z is not None:
            prev_sample = prev_sample + state.sqrt_beta_prod_next[i] * z
        return prev_sample.astype(sample.dtype), state
