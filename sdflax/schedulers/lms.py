"""Linear multistep sampler (k-diffusion's `sample_lms`; Karras et al. 2022's σ-ODE integrated with the
Adams–Bashforth idea of PLMS, Liu et al. 2022), order 4, matching diffusers' LMSDiscreteScheduler."""

from __future__ import annotations

import dataclasses

import flax
import jax.numpy as jnp
import numpy as np
from numpy.polynomial import Polynomial

from . import common
from .sigma_config import SigmaScheduleConfig

ORDER = 4  # diffusers' default `order` of LMSDiscreteScheduler.step


@dataclasses.dataclass(frozen=True)
class LMSConfig(SigmaScheduleConfig):
    """diffusers' LMSDiscreteScheduler fields: the σ schedule's alone."""


@flax.struct.dataclass
class LMSState:
    timesteps: jnp.ndarray  # float32 [n]
    sigmas: jnp.ndarray  # float32 [n+1]: σ_i, descending, σ_n = 0
    coefficients: jnp.ndarray  # float32 [n, ORDER]: weight of the derivative from j steps ago in step i
    derivatives: jnp.ndarray  # float32 [ORDER, *shape]: d_i, d_{i-1}, ..., newest first
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False)  # diffusers' value for this n


def lms_coefficients(sigmas: np.ndarray, order: int = ORDER) -> np.ndarray:
    """c_ij = ∫_{σ_i}^{σ_{i+1}} ℓ_j(σ) dσ, ℓ_j the Lagrange basis polynomial through σ_i, ..., σ_{i-k+1} that is 1
    at σ_{i-j}, k = min(i + 1, order). Exact polynomial integration (diffusers: scipy.integrate.quad)."""
    n = len(sigmas) - 1
    nodes_all = sigmas.astype(np.float64)
    coefficients = np.zeros((n, order))
    for i in range(n):
        nodes = nodes_all[i - np.arange(min(i + 1, order))]  # σ_i, σ_{i-1}, ...
        for j, node in enumerate(nodes):
            basis = Polynomial([1.0])
            for other in np.delete(nodes, j):
                basis *= Polynomial([-other, 1.0]) / (node - other)  # (σ - σ_m) / (σ_j - σ_m)
            antiderivative = basis.integ()
            coefficients[i, j] = antiderivative(nodes_all[i + 1]) - antiderivative(nodes_all[i])
    return coefficients


@dataclasses.dataclass(frozen=True)
class LMSScheduler(common.SigmaSampler):
    config: LMSConfig

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> LMSState:
        """`start` skips that many steps (img2img). As diffusers, the steps after it keep the full schedule's
        coefficients; the derivatives from before `start` that they would weigh are 0 (an empty history)."""
        if shape is None:
            raise ValueError("LMS keeps a history of derivatives: call set_timesteps(n, shape=sample.shape)")
        timesteps, sigmas = common.discrete_sigma_schedule(self.config, num_inference_steps)
        common.check_start(start, len(timesteps))
        return LMSState(
            timesteps=jnp.asarray(timesteps[start:]),
            sigmas=jnp.asarray(sigmas[start:]),
            coefficients=jnp.asarray(lms_coefficients(sigmas)[start:], jnp.float32),
            derivatives=jnp.zeros((ORDER, *shape), jnp.float32),
            num_inference_steps=num_inference_steps,
            init_noise_sigma=common.init_noise_sigma(self.config, sigmas.max()),
        )

    def step(self, state: LMSState, model_output, i, sample, key=None):
        """x_{i+1} = x_i + Σ_j c_ij d_{i-j},  d = (x - x̂_0) / σ: Adams–Bashforth on dx/dσ = d with unequal steps.
        The first steps have fewer derivatives; their missing coefficients are 0 (and the buffer starts at 0)."""
        x = sample.astype(jnp.float32)
        derivative = (x - self.predict_x0(state, model_output, i, x)) / state.sigmas[i]
        derivatives = jnp.concatenate([derivative[None], state.derivatives[:-1]])
        update = sum(state.coefficients[i, j] * derivatives[j] for j in range(ORDER))
        state = state.replace(derivatives=derivatives)
        return (x + update).astype(sample.dtype), state
