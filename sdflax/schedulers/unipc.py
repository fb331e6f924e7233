"""UniPC: Zhao et al. 2023, "UniPC: A Unified Predictor-Corrector Framework for Fast Sampling of Diffusion Models",
the B(h) variants bh1 / bh2 of UniP-p (predictor) and UniC-p (corrector) on the data prediction x̂_0, orders 1–3,
matching diffusers' UniPCMultistepScheduler with predict_x0=True.

Each model evaluation first corrects the sample it was made at (UniC: the same step again, now also using the new
x̂_0, which raises the order by one without another evaluation), then predicts the next sample from the corrected
one (UniP). Both are linear in the samples and the x̂_0 history, with coefficients that depend only on the
schedule: `set_timesteps` precomputes them per step, and `step` is branch-free. (One deliberate difference: diffusers'
bh1 step into σ = 0 multiplies B = -∞ by an empty sum, NaN; here it is the first-order step's limit, x̂_0.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax
import jax.numpy as jnp
import numpy as np

from . import common
from .sigma_config import FINAL_SIGMAS_TYPES, SigmaRangeConfig

HISTORY = 3  # x̂_0 of the 3 previous evaluations: UniC-3 needs m_{i-1}, m_{i-2}, m_{i-3}


@dataclasses.dataclass(frozen=True)
class UniPCConfig(SigmaRangeConfig):
    solver_order: int = 2
    solver_type: str = "bh2"
    lower_order_final: bool = True
    final_sigmas_type: str = "zero"
    rescale_betas_zero_snr: bool = False

    choices = {"solver_order": (1, 2, 3), "solver_type": ("bh1", "bh2"), "final_sigmas_type": FINAL_SIGMAS_TYPES}
    unsupported = {
        "predict_x0": (True,),
        "disable_corrector": ([], ()),
        "solver_p": (None,),
        "use_flow_sigmas": (False, None),
        "use_dynamic_shifting": (False, None),
        "shift_terminal": (None,),
    }


@flax.struct.dataclass
class UniPCState:
    timesteps: jnp.ndarray  # int32 [n]
    sigmas: jnp.ndarray  # float32 [n+1]: σ_i, descending; σ_n after the last step
    alpha_t: jnp.ndarray  # float32 [n]: α_i = 1/√(σ_i²+1)
    sigma_t: jnp.ndarray  # float32 [n]: s_i = σ_i α_i
    # x^c_i = c_x[i] x_i + c_last[i] x^c_{i-1} + Σ_j c_m[i, j] m_{i-j}   (UniC; x^c_i = x_i where it does not run)
    corrector_x: jnp.ndarray  # float32 [n]
    corrector_last: jnp.ndarray  # float32 [n]
    corrector_m: jnp.ndarray  # float32 [n, 4]: weights of m_i, m_{i-1}, m_{i-2}, m_{i-3}
    # x_{i+1} = p_x[i] x^c_i + Σ_j p_m[i, j] m_{i-j}   (UniP)
    predictor_x: jnp.ndarray  # float32 [n]
    predictor_m: jnp.ndarray  # float32 [n, 3]: weights of m_i, m_{i-1}, m_{i-2}
    history: jnp.ndarray  # float32 [HISTORY, *shape]: m_{i-1}, m_{i-2}, m_{i-3}, newest first
    last_sample: jnp.ndarray  # float32 [*shape]: x^c_{i-1}, the corrected sample the last prediction started from
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False, default=1.0)  # variance preserving: x_T ~ N(0, I)


def bh_update(lam: np.ndarray, alpha_to: float, s_to: float, s_from: float, to: int, frm: int, order: int,
              solver_type: str, corrector: bool) -> tuple[float, np.ndarray]:
    """One UniP-p or UniC-p step from λ[frm] to λ[to], written as (weight of the sample, weights of m_frm, m_{frm-1},
    ..., and for UniC last m_to, the new x̂_0), float64, with B = hh (bh1) or e^{hh} - 1 (bh2), as diffusers'
    multistep_uni_p_bh_update / multistep_uni_c_bh_update compute them.

    With h = λ_to - λ_frm and hh = -h (data prediction):
        x_to = (s_to/s_frm) x - α_to (e^{hh} - 1) m_frm - α_to B Σ_k ρ_k D_k,   D_k = (m_{frm-k} - m_frm) / r_k,
    r_k = (λ_{frm-k} - λ_frm) / h, and for UniC one more term ρ_p (m_to - m_frm). ρ solves
    Σ_k ρ_k r_k^{q-1} = q! hh φ_{q+1}(hh) / B for q = 1..p, φ_1(z) = (e^z - 1)/z, φ_{k+1}(z) = (φ_k(z) - 1/k!)/z
    (the predictor drops the last row and column, and takes ρ = 1/2 for p = 2; the corrector ρ = 1/2 for p = 1).
    """
    h = lam[to] - lam[frm]
    hh = -h
    h_phi_1 = np.expm1(hh)  # h φ_1(h) = e^h - 1
    weights = np.zeros(order + 1)  # m_frm, m_{frm-1}, ..., m_{frm-p+1}; then m_to (corrector only)
    weights[0] = -alpha_to * h_phi_1
    sample_weight = s_to / s_from
    if order == 1 and not corrector:
        return sample_weight, weights[:order]
    b_h = hh if solver_type == "bh1" else np.expm1(hh)
    rks = np.array([(lam[frm - k] - lam[frm]) / h for k in range(1, order)] + [1.0])
    # b_q = q! hh φ_{q+1}(hh) / B: hh φ_2 = h_phi_1/hh - 1, then hh φ_{q+2} = hh φ_{q+1} / hh - 1/(q+1)!
    b, h_phi_k, factorial = [], h_phi_1 / hh - 1, 1
    for q in range(1, order + 1):
        b.append(h_phi_k * factorial / b_h)
        factorial *= q + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    R = np.stack([rks ** (q - 1) for q in range(1, order + 1)])
    if corrector:
        rhos = np.array([0.5]) if order == 1 else np.linalg.solve(R, np.array(b))
    else:
        rhos = np.array([0.5]) if order == 2 else np.linalg.solve(R[:-1, :-1], np.array(b[:-1]))
    scale = -alpha_to * b_h
    for k in range(1, order):  # ρ_k D_k = ρ_k (m_{frm-k} - m_frm) / r_k
        weights[k] += scale * rhos[k - 1] / rks[k - 1]
        weights[0] -= scale * rhos[k - 1] / rks[k - 1]
    if corrector:  # ρ_p (m_to - m_frm)
        weights[order] += scale * rhos[-1]
        weights[0] -= scale * rhos[-1]
        return sample_weight, weights
    return sample_weight, weights[:order]


@dataclasses.dataclass(frozen=True)
class UniPCScheduler(common.VPSolver):
    config: UniPCConfig

    @classmethod
    def from_config(cls, config: Mapping[str, Any]):
        """As diffusers, a DPM-Solver / DEIS solver_type (midpoint, heun, logrho) becomes bh2, so that a checkpoint
        saved with another multistep scheduler switches to UniPC."""
        if config.get("solver_type") in ("midpoint", "heun", "logrho"):
            config = {**config, "solver_type": "bh2"}
        return super().from_config(config)

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> UniPCState:
        """`start` skips that many steps (img2img): as in diffusers, the history restarts there (the first step run
        is UniP-1 without a correction) while the later steps keep the full schedule's orders and σ."""
        if shape is None:
            raise ValueError("UniPC keeps a history of x̂_0: call set_timesteps(n, shape=sample.shape)")
        timesteps, sigmas, alpha, s, coefficients = self._schedule(num_inference_steps, start)
        corrector_x, corrector_last, corrector_m, predictor_x, predictor_m = coefficients

        def f32(a):  # the steps from `start` on
            return jnp.asarray(a[start:], jnp.float32)

        return UniPCState(
            timesteps=jnp.asarray(timesteps[start:], jnp.int32),
            sigmas=jnp.asarray(sigmas[start:]),
            alpha_t=f32(alpha[:-1]),
            sigma_t=f32(s[:-1]),
            corrector_x=f32(corrector_x),
            corrector_last=f32(corrector_last),
            corrector_m=f32(corrector_m),
            predictor_x=f32(predictor_x),
            predictor_m=f32(predictor_m),
            history=jnp.zeros((HISTORY, *shape), jnp.float32),
            last_sample=jnp.zeros(tuple(shape), jnp.float32),
            num_inference_steps=num_inference_steps,
        )

    def check_steps(self, num_inference_steps: int) -> None:
        """Raise now, before anything is compiled (or JAX started), if `set_timesteps(num_inference_steps)` would."""
        super().check_steps(num_inference_steps)
        self._schedule(num_inference_steps, 0)

    def _schedule(self, num_inference_steps: int, start: int):
        """(timesteps, σ (n+1,), α, s, the UniC / UniP coefficients), numpy, checked finite."""
        cfg = self.config
        timesteps, sigmas, train = common.multistep_sigma_schedule(
            cfg, num_inference_steps, cfg.sigma_min, cfg.sigma_max, zero_snr=cfg.rescale_betas_zero_snr)
        # diffusers' σ after the last step: 0, or the smallest σ (the training schedule's, or for Karras /
        # exponential / beta σ the schedule's own last one repeated: the last step then stays in place)
        if cfg.final_sigmas_type == "zero":
            final = 0.0
        else:
            final = train[0] if common.sigma_schedule(cfg) == "spaced" else sigmas[-1]
        sigmas = np.append(sigmas, final).astype(np.float32)
        n = len(timesteps)
        common.check_start(start, n)

        alpha, s, lam = common.vp_coefficients(sigmas)
        # UniP-p at step i: p = the solver order, lowered towards the end (lower_order_final: at most the steps left)
        # and at the start (at most the x̂_0 seen since `start`)
        orders = [min(cfg.solver_order, n - i if cfg.lower_order_final else cfg.solver_order, i - start + 1)
                  for i in range(n)]
        corrector_x, corrector_last = np.zeros(n), np.zeros(n)
        corrector_m, predictor_x, predictor_m = np.zeros((n, HISTORY + 1)), np.zeros(n), np.zeros((n, HISTORY))
        with np.errstate(divide="ignore", invalid="ignore"):  # h = ∞ into σ_n = 0 (only UniP-1 steps there)
            for i in range(start, n):
                if i == start:  # nothing to correct: x^c_i = x_i
                    corrector_x[i] = 1.0
                else:  # UniC-p redoes step i-1 (its predictor's order p) with m_i as well
                    p = orders[i - 1]
                    corrector_last[i], w = bh_update(lam, alpha[i], s[i], s[i - 1], i, i - 1, p, cfg.solver_type,
                                                     corrector=True)
                    corrector_m[i, 1:p + 1] += w[:p]  # m_{i-1}, ..., m_{i-p}
                    corrector_m[i, 0] += w[p]  # m_i
                predictor_x[i], w = bh_update(lam, alpha[i + 1], s[i + 1], s[i], i + 1, i, orders[i], cfg.solver_type,
                                              corrector=False)
                predictor_m[i, :orders[i]] = w
        coefficients = (corrector_x, corrector_last, corrector_m, predictor_x, predictor_m)
        if not all(np.isfinite(c).all() for c in coefficients):
            raise ValueError(f"UniPC's coefficients are not finite for this schedule ({num_inference_steps} steps, "
                             f"lower_order_final={cfg.lower_order_final}, final_sigmas_type="
                             f"{cfg.final_sigmas_type!r}): diffusers' would give NaN samples")
        return timesteps, sigmas, alpha, s, coefficients

    def step(self, state: UniPCState, model_output, i, sample, key=None):
        """Correct x_i with m_i = x̂_0(x_i) (UniC), then predict x_{i+1} from the corrected x^c_i (UniP):
            x^c_i = c_x x_i + c_last x^c_{i-1} + Σ_j c_m[j] m_{i-j},   x_{i+1} = p_x x^c_i + Σ_j p_m[j] m_{i-j}.
        Unused weights are 0, which makes the first step (no correction) and the lower orders branch-free."""
        x = sample.astype(jnp.float32)
        m = self.predict_x0(state, model_output, i, x)
        ms = jnp.concatenate([m[None], state.history])  # m_i, m_{i-1}, m_{i-2}, m_{i-3}
        corrected = state.corrector_x[i] * x + state.corrector_last[i] * state.last_sample
        corrected = corrected + sum(state.corrector_m[i, j] * ms[j] for j in range(HISTORY + 1))
        prev_sample = state.predictor_x[i] * corrected + sum(state.predictor_m[i, j] * ms[j] for j in range(HISTORY))
        state = state.replace(history=ms[:HISTORY], last_sample=corrected)
        return prev_sample.astype(sample.dtype), state
