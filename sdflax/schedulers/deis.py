"""DEIS: Zhang & Chen 2023, "Fast Sampling of Diffusion Models with Exponential Integrator", multistep
Adams–Bashforth on the noise prediction in ρ = s/α = σ (the paper's ρAB-DEIS) with diffusers' "logrho"
interpolation (polynomials in log ρ), orders 1–3, matching diffusers' DEISMultistepScheduler.

In ρ = σ the probability-flow ODE of x/α is dx̄/dρ = ε̂ (x̄ = x/α, the σ view of Karras et al.); DEIS integrates the
polynomial that interpolates the last p noise predictions in log ρ exactly:
    x_{i+1} = α_{i+1} (x_i / α_i + Σ_k c_ik ε̂_{i-k}),   c_ik = ∫_{ρ_i}^{ρ_{i+1}} ℓ_k(log ρ) dρ,
ℓ_k the Lagrange basis polynomial in log ρ through log ρ_i, ..., log ρ_{i-p+1}. First order is DDIM.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax
import jax.numpy as jnp
import numpy as np

from . import common
from .sigma_config import SigmaScheduleConfig

HISTORY = 2  # ε̂ of the 2 previous evaluations (third order)


@dataclasses.dataclass(frozen=True)
class DEISConfig(SigmaScheduleConfig):
    solver_order: int = 2
    lower_order_final: bool = True

    choices = {"solver_order": (1, 2, 3)}
    unsupported = {
        "algorithm_type": ("deis",),
        "solver_type": ("logrho",),
        "use_flow_sigmas": (False, None),
        "use_dynamic_shifting": (False, None),
    }


@flax.struct.dataclass
class DEISState:
    timesteps: jnp.ndarray  # int32 [n]
    sigmas: jnp.ndarray  # float32 [n+1]: σ_i = ρ_i, descending; σ_n after the last step (never 0 in DEIS)
    alpha_t: jnp.ndarray  # float32 [n]: α_i = 1/√(σ_i²+1)
    sigma_t: jnp.ndarray  # float32 [n]: s_i = σ_i α_i
    coef_sample: jnp.ndarray  # float32 [n]: α_{i+1}/α_i
    coef_eps: jnp.ndarray  # float32 [n, 3]: α_{i+1} c_ik, the weights of ε̂_i, ε̂_{i-1}, ε̂_{i-2}
    history: jnp.ndarray  # float32 [HISTORY, *shape]: ε̂_{i-1}, ε̂_{i-2}, newest first
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False, default=1.0)  # variance preserving: x_T ~ N(0, I)


def logrho_coefficients(rho_to, rhos: np.ndarray) -> np.ndarray:
    """c_k = ∫_{ρ_0}^{ρ_to} ℓ_k(log ρ) dρ for the nodes rhos = (ρ_0, ρ_1[, ρ_2]), in diffusers' closed forms, from
    ∫ log t dt = t (log t - 1) and ∫ log² t dt = t (log² t - 2 log t + 2); in the inputs' precision."""
    if len(rhos) == 2:
        def ind_fn(t, b, c):  # ∫ (log t - log c) / (log b - log c) dt
            return t * (-np.log(c) + np.log(t) - 1) / (np.log(b) - np.log(c))

        r0, r1 = rhos
        return np.array([ind_fn(rho_to, r0, r1) - ind_fn(r0, r0, r1), ind_fn(rho_to, r1, r0) - ind_fn(r0, r1, r0)])

    def ind_fn3(t, b, c, d):  # ∫ (log t - log c)(log t - log d) / ((log b - log c)(log b - log d)) dt
        lt, lc, ld = np.log(t), np.log(c), np.log(d)
        numerator = t * (lc * (ld - lt + 1) - ld * lt + ld + lt**2 - 2 * lt + 2)
        return numerator / ((np.log(b) - lc) * (np.log(b) - ld))

    r0, r1, r2 = rhos
    return np.array([
        ind_fn3(rho_to, r0, r1, r2) - ind_fn3(r0, r0, r1, r2),
        ind_fn3(rho_to, r1, r2, r0) - ind_fn3(r0, r1, r2, r0),
        ind_fn3(rho_to, r2, r0, r1) - ind_fn3(r0, r2, r0, r1),
    ])


@dataclasses.dataclass(frozen=True)
class DEISScheduler(common.VPSolver):
    config: DEISConfig

    @classmethod
    def from_config(cls, config: Mapping[str, Any]):
        """As diffusers, a DPM-Solver / UniPC algorithm_type or solver_type becomes deis / logrho, so that a
        checkpoint saved with another multistep scheduler switches to DEIS."""
        config = dict(config)
        if config.get("algorithm_type") in ("dpmsolver", "dpmsolver++"):
            config["algorithm_type"] = "deis"
        if config.get("solver_type") in ("midpoint", "heun", "bh1", "bh2"):
            config["solver_type"] = "logrho"
        return super().from_config(config)

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> DEISState:
        """`start` skips that many steps (img2img): as in diffusers the history restarts there, while the later
        steps keep the full schedule's σ and final orders."""
        if shape is None:
            raise ValueError("DEIS keeps a history of ε̂: call set_timesteps(n, shape=sample.shape)")
        cfg = self.config
        timesteps, sigmas, train = common.multistep_sigma_schedule(cfg, num_inference_steps)
        # diffusers' σ after the last step is never 0 (ρ = 0 has no log): the smallest training σ, or for Karras /
        # exponential / beta σ their own last one repeated (the last step then stays in place)
        final = train[0] if common.sigma_schedule(cfg) == "spaced" else sigmas[-1]
        sigmas = np.append(sigmas, final).astype(np.float32)
        n = len(timesteps)
        common.check_start(start, n)

        alpha, s, _ = common.vp_coefficients(sigmas)
        rho = sigmas.astype(np.float64)  # ρ = s/α = σ
        # float64: diffusers evaluates these closed forms in float32, where their differences of nearly equal terms
        # lose up to ~1e-4 (third order), and a last-bit change in one σ moves them as much
        coef_sample, coef_eps = alpha[1:] / alpha[:-1], np.zeros((n, HISTORY + 1))
        for i in range(start, n):
            # the order: solver_order, but at most the ε̂ seen since `start`, and with lower_order_final (< 15
            # steps) first order for the last step and second for the one before
            order = min(cfg.solver_order, i - start + 1)
            if cfg.lower_order_final and n < 15:
                order = min(order, n - i)
            if order == 1:  # DDIM: x_{i+1} = (α_{i+1}/α_i) x_i - s_{i+1} (e^h - 1) ε̂_i,  h = λ_{i+1} - λ_i
                h = np.log(rho[i]) - np.log(rho[i + 1])
                coef_eps[i, 0] = -s[i + 1] * np.expm1(h)
            else:
                coef_eps[i, :order] = alpha[i + 1] * logrho_coefficients(rho[i + 1], rho[i - np.arange(order)])
        return DEISState(
            timesteps=jnp.asarray(timesteps[start:], jnp.int32),
            sigmas=jnp.asarray(sigmas[start:]),
            alpha_t=jnp.asarray(alpha[start:-1], jnp.float32),
            sigma_t=jnp.asarray(s[start:-1], jnp.float32),
            coef_sample=jnp.asarray(coef_sample[start:], jnp.float32),
            coef_eps=jnp.asarray(coef_eps[start:], jnp.float32),
            history=jnp.zeros((HISTORY, *shape), jnp.float32),
            num_inference_steps=num_inference_steps,
        )

    def step(self, state: DEISState, model_output, i, sample, key=None):
        """x_{i+1} = (α_{i+1}/α_i) x_i + Σ_k α_{i+1} c_ik ε̂_{i-k}, with ε̂ = (x - α x̂_0)/s from any prediction type
        (as diffusers converts it). Unused weights are 0: the lower orders need no branch."""
        x = sample.astype(jnp.float32)
        eps = (x - state.alpha_t[i] * self.predict_x0(state, model_output, i, x)) / state.sigma_t[i]
        eps_all = jnp.concatenate([eps[None], state.history])  # ε̂_i, ε̂_{i-1}, ε̂_{i-2}
        prev_sample = state.coef_sample[i] * x + sum(state.coef_eps[i, k] * eps_all[k] for k in range(HISTORY + 1))
        return prev_sample.astype(sample.dtype), state.replace(history=eps_all[:HISTORY])
