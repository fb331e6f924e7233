"""DPM-Solver++(3M) SDE: Katherine Crowson's k-diffusion `sample_dpmpp_3m_sde`, the third-order multistep
DPM-Solver++ (Lu et al. 2022, "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion Probabilistic Models")
on the reverse SDE, on diffusers' discrete σ schedule (the Euler schedulers': spacing, Karras / exponential /
beta σ). diffusers has no such scheduler; tests/test_multistep_samplers.py checks it against k-diffusion's loop
written out in numpy float64.

In the σ view x = x_0 + σ ε with t = -log σ (the half log-SNR λ) and h = t_{i+1} - t_i, each step is
    x_{i+1} = e^{-(1+η)h} x_i + (1 - e^{-(1+η)h}) m_i + φ_2 D_1 - φ_3 D_2 + σ_{i+1} √(1 - e^{-2ηh}) s_noise z,
m = x̂_0, with D_1, D_2 the first and second divided differences of the last three m in t (fewer at the start),
φ_2 = (e^{-(1+η)h} - 1)/((1+η)h) + 1, φ_3 = φ_2/((1+η)h) - 1/2; into σ_{i+1} = 0 it returns m_i.
k-diffusion draws z from a Brownian tree; its increments over the disjoint steps are independent N(0, I) after its
normalisation, which is what `common.step_noise` draws here.
"""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp
import numpy as np

from . import common
from .sigma_config import FINAL_SIGMAS_TYPES, SigmaRangeConfig

HISTORY = 2  # x̂_0 of the 2 previous evaluations


@dataclasses.dataclass(frozen=True)
class DPMPP3MSDEConfig(SigmaRangeConfig):
    final_sigmas_type: str = "zero"
    rescale_betas_zero_snr: bool = False
    eta: float = 1.0  # the SDE's share: 0 gives the deterministic DPM-Solver++(3M)
    s_noise: float = 1.0  # scales the fresh noise

    choices = {"final_sigmas_type": FINAL_SIGMAS_TYPES}


@flax.struct.dataclass
class DPMPP3MSDEState:
    timesteps: jnp.ndarray  # float32 [n]
    sigmas: jnp.ndarray  # float32 [n+1]: σ_i, descending; σ_n after the last step
    coef_sample: jnp.ndarray  # float32 [n]: e^{-(1+η)h}, 0 into σ = 0
    coef_x0: jnp.ndarray  # float32 [n, 3]: weights of m_i, m_{i-1}, m_{i-2}
    coef_noise: jnp.ndarray  # float32 [n]: σ_{i+1} √(1 - e^{-2ηh}) s_noise
    history: jnp.ndarray  # float32 [HISTORY, *shape]: m_{i-1}, m_{i-2}, newest first
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False)  # diffusers' value for this n


def dpmpp_3m_sde_coefficients(sigmas: np.ndarray, eta: float, s_noise: float, start: int = 0):
    """(coef_sample (n,), coef_x0 (n, 3), coef_noise (n,)) float64 for σ_0..σ_n, the step written out linear in
    x_i and m_i, m_{i-1}, m_{i-2}; the history (and so the order) starts again at step `start`."""
    n = len(sigmas) - 1
    sig = sigmas.astype(np.float64)
    coef_sample, coef_x0, coef_noise = np.zeros(n), np.zeros((n, HISTORY + 1)), np.zeros(n)
    for i in range(start, n):
        if sig[i + 1] == 0:  # the denoising step: x = m_i
            coef_x0[i, 0] = 1.0
            continue
        h = np.log(sig[i]) - np.log(sig[i + 1])  # t = -log σ
        h_eta = h * (eta + 1)
        coef_sample[i] = np.exp(-h_eta)
        coef_x0[i, 0] = -np.expm1(-h_eta)
        phi_2 = np.expm1(-h_eta) / h_eta + 1
        if i - start >= 2:  # third order: h_1, h_2 the two previous steps
            r0 = (np.log(sig[i - 1]) - np.log(sig[i])) / h
            r1 = (np.log(sig[i - 2]) - np.log(sig[i - 1])) / h
            phi_3 = phi_2 / h_eta - 0.5
            # d1_0 = (m_i - m_{i-1}) / r0, d1_1 = (m_{i-1} - m_{i-2}) / r1,
            # φ2 d1 - φ3 d2 = φ2 (d1_0 + (d1_0 - d1_1) r0/(r0+r1)) - φ3 (d1_0 - d1_1)/(r0+r1) = A d1_0 + B d1_1
            a = phi_2 + (phi_2 * r0 - phi_3) / (r0 + r1)
            b = -(phi_2 * r0 - phi_3) / (r0 + r1)
            coef_x0[i] += [a / r0, -a / r0 + b / r1, -b / r1]
        elif i - start == 1:  # second order: φ2 (m_i - m_{i-1}) / r
            r = (np.log(sig[i - 1]) - np.log(sig[i])) / h
            coef_x0[i, :2] += [phi_2 / r, -phi_2 / r]
        if eta:
            coef_noise[i] = sig[i + 1] * np.sqrt(-np.expm1(-2 * h * eta)) * s_noise
    return coef_sample, coef_x0, coef_noise


@dataclasses.dataclass(frozen=True)
class DPMPP3MSDEScheduler(common.SigmaSampler):
    config: DPMPP3MSDEConfig

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> DPMPP3MSDEState:
        """`start` skips that many steps (img2img); the history, and so the order, starts again there."""
        if shape is None:
            raise ValueError("DPM-Solver++(3M) SDE keeps a history of x̂_0: call set_timesteps(n, shape=sample.shape)")
        cfg = self.config
        timesteps, sigmas = common.discrete_sigma_schedule(
            cfg, num_inference_steps, sigma_min=cfg.sigma_min, sigma_max=cfg.sigma_max,
            final_sigma=cfg.final_sigmas_type, zero_snr=cfg.rescale_betas_zero_snr,
        )
        common.check_start(start, len(timesteps))
        coef_sample, coef_x0, coef_noise = dpmpp_3m_sde_coefficients(sigmas, cfg.eta, cfg.s_noise, start)
        return DPMPP3MSDEState(
            timesteps=jnp.asarray(timesteps[start:]),
            sigmas=jnp.asarray(sigmas[start:]),
            coef_sample=jnp.asarray(coef_sample[start:], jnp.float32),
            coef_x0=jnp.asarray(coef_x0[start:], jnp.float32),
            coef_noise=jnp.asarray(coef_noise[start:], jnp.float32),
            history=jnp.zeros((HISTORY, *shape), jnp.float32),
            num_inference_steps=num_inference_steps,
            init_noise_sigma=common.init_noise_sigma(cfg, sigmas.max()),
        )

    def step(self, state: DPMPP3MSDEState, model_output, i, sample, key=None, variance_noise=None):
        """x_{i+1} = a_i x_i + Σ_j w_ij m_{i-j} + c_i z, z ~ N(0, I) from `key` (or `variance_noise`); η = 0 or
        s_noise = 0 needs neither."""
        x = sample.astype(jnp.float32)
        m = self.predict_x0(state, model_output, i, x)
        ms = jnp.concatenate([m[None], state.history])  # m_i, m_{i-1}, m_{i-2}
        prev_sample = state.coef_sample[i] * x + sum(state.coef_x0[i, j] * ms[j] for j in range(HISTORY + 1))
        if self.config.eta and self.config.s_noise:
            z = common.draw_step_noise(key, variance_noise, sample.shape,
                                       "DPM-Solver++(3M) SDE adds fresh noise each step")
            prev_sample = prev_sample + state.coef_noise[i] * z
        return prev_sample.astype(sample.dtype), state.replace(history=ms[:HISTORY])
