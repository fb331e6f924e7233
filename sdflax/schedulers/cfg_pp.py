"""CFG++ (Chung et al. 2024, "CFG++: Manifold-constrained Classifier Free Guidance for Diffusion Models"): each step
lands from the guided x̂₀, as the base sampler does, but re-noises along the unconditional noise estimate instead of
the guided one, which keeps the sample near the data manifold; the paper's guidance λ in [0, 1] is the guidance
scale (ComfyUI's CFG++ samplers take it so: scales of about 0.5 to 2 rather than 7.5).

    Euler:     x_{i+1} = D + σ_{i+1} (x - U) / σ_i                       D = x̂₀(guided), U = x̂₀(unconditional)
    Euler a:   x_{i+1} = D + σ_down (x - U) / σ_i + σ_up z
    DPM++ 2M:  x_{i+1} = D + σ_{i+1} (x - U) / σ_i - (e^{-h} - 1) / (2r) (D - U_{i-1})   (first order: without
               the last term), in σ's parametrisation x = x₀ + σ ε, h = log σ_i - log σ_{i+1}, r = h_{i-1} / h

as ComfyUI's `sample_euler_cfg_pp`, `sample_euler_ancestral_cfg_pp` and `sample_dpmpp_2m_cfg_pp` compute them
(Forge's "Euler CFG++", "Euler a CFG++", "DPM++ 2M CFG++"), on diffusers' Euler and DPM-Solver schedules. The
sampling loop hands `step` the unconditional prediction as `unconditional=` when the model returns `(guided,
unconditional)` (the pipelines' guided model does for a scheduler whose `takes_unconditional` is set); without it a
step is the base sampler's, which CFG++ is when both agree.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from . import common
from .dpm_solver import DPMSolverScheduler
from .euler import EulerScheduler
from .euler_ancestral import EulerAncestralScheduler


class CFGPP:
    """What the CFG++ samplers share: the pipelines run classifier-free guidance for them at any scale (the
    unconditional half is what they re-noise with), and hand them its prediction."""

    takes_unconditional = True

    def _x0s(self, state, model_output, unconditional, i, x):
        """(x̂₀ of the guided prediction, x̂₀ of the unconditional one, or the guided again without it)."""
        x0 = self.predict_x0(state, model_output, i, x)
        return x0, x0 if unconditional is None else self.predict_x0(state, unconditional, i, x)


@dataclasses.dataclass(frozen=True)
class EulerCFGPPScheduler(CFGPP, EulerScheduler):
    def step(self, state, model_output, i, sample, key=None, unconditional=None):
        x = sample.astype(jnp.float32)
        x0, x0_uncond = self._x0s(state, model_output, unconditional, i, x)
        prev_sample = x0 + (x - x0_uncond) / state.sigmas[i] * state.sigmas[i + 1]
        return prev_sample.astype(sample.dtype), state


@dataclasses.dataclass(frozen=True)
class EulerAncestralCFGPPScheduler(CFGPP, EulerAncestralScheduler):
    def step(self, state, model_output, i, sample, key=None, variance_noise=None, unconditional=None):
        z = common.draw_step_noise(key, variance_noise, sample.shape, "Euler a CFG++ adds fresh noise each step")
        x = sample.astype(jnp.float32)
        x0, x0_uncond = self._x0s(state, model_output, unconditional, i, x)
        prev_sample = x0 + (x - x0_uncond) / state.sigmas[i] * state.sigma_down[i] + z * state.sigma_up[i]
        return prev_sample.astype(sample.dtype), state


@dataclasses.dataclass(frozen=True)
class DPMPP2MCFGPPScheduler(CFGPP, DPMSolverScheduler):
    """DPM-Solver++ 2M's schedule and coefficients (diffusers' variance-preserving x = α x_σ; the multistep
    correction is the midpoint one), stepping as CFG++ from the guided x̂₀ along the unconditional one. Without an
    unconditional prediction it is DPM++ 2M."""

    @classmethod
    def from_config(cls, config):
        return super().from_config({**config, "algorithm_type": "dpmsolver++", "solver_type": "midpoint"})

    def step(self, state, model_output, i, sample, key=None, unconditional=None):
        """In the VP view: x_{i+1} = (s_{i+1}/s_i) x + α_{i+1} (D - U) + b_i U + c_i (D - U_{i-1}), b_i and c_i DPM++
        2M's (α_{i+1}(1 - e^{-h}) and b_i / (2r)): with U = D, DPM++ 2M's step."""
        x = sample.astype(jnp.float32)
        d, u = self._x0s(state, model_output, unconditional, i, x)
        alpha_next = 1 / jnp.sqrt(state.sigmas[i + 1].astype(jnp.float32) ** 2 + 1)
        prev_sample = (state.coef_sample[i] * x + alpha_next * (d - u) + state.coef_d0[i] * u
                       + state.coef_d1[i] * (d - state.prev_x0))
        return prev_sample.astype(sample.dtype), state.replace(prev_x0=u)
