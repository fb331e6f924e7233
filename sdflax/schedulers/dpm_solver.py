"""DPM-Solver++ 2M: Lu et al. 2022, "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion Probabilistic
Models", Algorithm 2 (multistep, second order, data prediction), matching diffusers' DPMSolverMultistepScheduler
with algorithm_type="dpmsolver++"; and its SDE variant (algorithm_type="sde-dpmsolver++", `dpmpp_2m_sde`), the
same multistep data prediction integrated along the reverse SDE instead of the ODE (the noise is
re-injected each step; k-diffusion's `sample_dpmpp_2m_sde` with eta = 1)."""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp
import numpy as np

from . import common
from .sigma_config import FINAL_SIGMAS_TYPES, SigmaScheduleConfig


@dataclasses.dataclass(frozen=True)
class DPMSolverConfig(SigmaScheduleConfig):
    solver_order: int = 2
    algorithm_type: str = "dpmsolver++"
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False
    final_sigmas_type: str = "zero"
    rescale_betas_zero_snr: bool = False

    choices = {
        "solver_order": (1, 2),
        "algorithm_type": ("dpmsolver++", "sde-dpmsolver++"),
        "solver_type": ("midpoint", "heun"),
        "final_sigmas_type": FINAL_SIGMAS_TYPES,
    }
    unsupported = {
        "use_lu_lambdas": (False, None),
        "use_flow_sigmas": (False, None),
        "use_dynamic_shifting": (False, None),
        "lambda_min_clipped": (-float("inf"),),
        "variance_type": (None,),
    }


@flax.struct.dataclass
class DPMSolverState:
    timesteps: jnp.ndarray  # int32 [n]
    sigmas: jnp.ndarray  # float32 [n+1]: σ_i = √((1-ᾱ)/ᾱ), descending; σ_n after the last step
    alpha_t: jnp.ndarray  # float32 [n]: α_i = 1/√(σ_i²+1) = √ᾱ   (x_t = α_t x_0 + s_t ε)
    sigma_t: jnp.ndarray  # float32 [n]: s_i = σ_i α_i = √(1-ᾱ)
    coef_sample: jnp.ndarray  # float32 [n]: a_i in x_{i+1} = a_i x_i + b_i m_i + c_i (m_i - m_{i-1})
    coef_d0: jnp.ndarray  # float32 [n]: b_i
    coef_d1: jnp.ndarray  # float32 [n]: c_i, 0 for first-order steps
    coef_noise: jnp.ndarray  # float32 [n]: std of the fresh noise step i adds (0 but for the SDE variant)
    prev_x0: jnp.ndarray  # float32 [*shape]: x̂_0 of the previous step (m_{i-1})
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False, default=1.0)  # variance preserving: x_T ~ N(0, I)


@dataclasses.dataclass(frozen=True)
class DPMSolverScheduler(common.VPSolver):
    config: DPMSolverConfig
    custom_schedules = ("timesteps",)

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> DPMSolverState:
        """`start` skips that many steps (img2img): the first step run is first order, as in diffusers."""
        if shape is None:
            raise ValueError("DPM-Solver++ 2M keeps the previous x̂_0: call set_timesteps(n, shape=sample.shape)")
        cfg, n = self.config, num_inference_steps
        # Spaced timesteps and σ, or Karras / exponential / beta σ over the training range with timesteps following.
        timesteps, sigmas, train = common.multistep_sigma_schedule(cfg, n, zero_snr=cfg.rescale_betas_zero_snr)
        sigmas = common.with_final_sigma(sigmas, train, cfg.final_sigmas_type)
        n = len(timesteps)
        common.check_start(start, n)

        alpha, s, lam = common.vp_coefficients(sigmas)  # the VP view, float64; σ_n = 0 gives λ_n = ∞
        sde = cfg.algorithm_type == "sde-dpmsolver++"
        a, b, c, noise = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
        for i in range(n):
            h = lam[i + 1] - lam[i]
            if sde:
                # x_{i+1} = (s_{i+1}/s_i) e^{-h} x_i + α_{i+1}(1 - e^{-2h}) D + s_{i+1} √(1 - e^{-2h}) z: the reverse
                # SDE in λ solved exactly for a constant x̂_0 = D; it forgets x_i twice as fast (e^{-2h} where the
                # ODE has e^{-h}) and replaces the forgotten noise with fresh z.
                a[i] = s[i + 1] / s[i] * np.exp(-h)
                b[i] = -alpha[i + 1] * np.expm1(-2 * h)
                noise[i] = s[i + 1] * np.sqrt(-np.expm1(-2 * h))
            else:
                a[i] = s[i + 1] / s[i]
                b[i] = -alpha[i + 1] * np.expm1(-h)  # α_{i+1} (1 - e^{-h})
            final = i == n - 1 and (
                cfg.euler_at_final or (cfg.lower_order_final and n < 15) or cfg.final_sigmas_type == "zero"
            )
            if cfg.solver_order == 1 or i <= start or final:
                continue  # first order (DPM-Solver++ 1, i.e. DDIM); `lower_order_second` only matters for order 3
            r = (lam[i] - lam[i - 1]) / h  # r_i = h_{i-1} / h_i
            if cfg.solver_type == "midpoint":  # Algorithm 2: D_i = (1 + 1/(2r)) m_i - 1/(2r) m_{i-1}
                c[i] = 0.5 * b[i] / r
            elif sde:  # "heun": + α_{i+1} ((1 - e^{-2h})/(-2h) + 1) (m_i - m_{i-1}) / r
                c[i] = alpha[i + 1] * (np.expm1(-2 * h) / (2 * h) + 1) / r
            else:  # "heun" (diffusers): + α_{i+1} ((e^{-h} - 1)/h + 1) (m_i - m_{i-1}) / r
                c[i] = alpha[i + 1] * (np.expm1(-h) / h + 1) / r
        return DPMSolverState(
            timesteps=jnp.asarray(timesteps[start:], jnp.int32),
            sigmas=jnp.asarray(sigmas[start:]),
            alpha_t=jnp.asarray(alpha[start:-1], jnp.float32),
            sigma_t=jnp.asarray(s[start:-1], jnp.float32),
            coef_sample=jnp.asarray(a[start:], jnp.float32),
            coef_d0=jnp.asarray(b[start:], jnp.float32),
            coef_d1=jnp.asarray(c[start:], jnp.float32),
            coef_noise=jnp.asarray(noise[start:], jnp.float32),
            prev_x0=jnp.zeros(tuple(shape), jnp.float32),
            num_inference_steps=num_inference_steps,
        )

    def step(self, state: DPMSolverState, model_output, i, sample, key=None, variance_noise=None):
        """x_{i+1} = (s_{i+1}/s_i) x_i + α_{i+1}(1 - e^{-h}) (m_i + (m_i - m_{i-1}) / (2r)),  m = x̂_0,
        h = λ_{i+1} - λ_i, r = h_{i-1}/h: Algorithm 2's update. Its coefficients are precomputed; c_i = 0 gives
        the first-order step (the first, and the last with lower_order_final) without a branch. The SDE variant
        adds fresh noise z from `key` (or `variance_noise`) with std coef_noise_i; the ODE ignores the key."""
        x = sample.astype(jnp.float32)
        m = self.predict_x0(state, model_output, i, x)
        prev_sample = state.coef_sample[i] * x + state.coef_d0[i] * m + state.coef_d1[i] * (m - state.prev_x0)
        if self.config.algorithm_type == "sde-dpmsolver++":
            z = common.draw_step_noise(key, variance_noise, sample.shape,
                                       "DPM-Solver++ 2M SDE adds fresh noise each step")
            prev_sample = prev_sample + state.coef_noise[i] * z
        return prev_sample.astype(sample.dtype), state.replace(prev_x0=m)


@dataclasses.dataclass(frozen=True)
class DPMPP2MSDEConfig(DPMSolverConfig):
    algorithm_type: str = "sde-dpmsolver++"
    choices = {**DPMSolverConfig.choices, "algorithm_type": ("sde-dpmsolver++",)}


@dataclasses.dataclass(frozen=True)
class DPMPP2MSDEScheduler(DPMSolverScheduler):
    """DPM-Solver++ 2M SDE (`dpmpp_2m_sde`): DPMSolverScheduler with algorithm_type="sde-dpmsolver++", whatever the
    config dict says; the name picks the algorithm, a checkpoint's scheduler config the schedule."""

    config: DPMPP2MSDEConfig

    @classmethod
    def from_config(cls, config):
        return super().from_config({**config, "algorithm_type": "sde-dpmsolver++"})
