"""The scheduler interface that the sampling loop and the pipelines are written against.

Every method is a pure function of a flax.struct state; `i` indexes the model evaluations (a traced int32 inside
`lax.scan`), so per-step values are precomputed by `set_timesteps` and looked up with `i`.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable


@runtime_checkable
class SchedulerState(Protocol):
    timesteps: Any  # (evals,): the training timestep of each model evaluation, in order
    init_noise_sigma: float  # static: what fresh N(0, I) noise is multiplied by to start sampling


@runtime_checkable
class Scheduler(Protocol):
    config: Any  # frozen and hashable: the scheduler is a static argument of the compiled loop

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Scheduler:
        """Build from a diffusers scheduler_config.json dict."""

    def check_steps(self, num_inference_steps: int) -> None:
        """Raise if `set_timesteps(num_inference_steps)` would; cheap, for callers to run before compiling."""

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> SchedulerState:
        """The state for sampling latents of `shape` in n steps, skipping the first `start` steps (img2img; a
        two-evaluation sampler such as Heun skips 2 * start evaluations, as diffusers' img2img does)."""

    def scale_model_input(self, state, x, i):
        """The UNet's input at evaluation i."""

    def step(self, state, model_output, i, x, key=None):
        """(x after evaluation i's step, next state); stochastic samplers draw their noise from `key`."""

    def predict_x0(self, state, model_output, i, x):
        """x̂₀ from evaluation i's model output, float32."""

    def add_noise(self, state, x0, noise, i):
        """x₀ noised to evaluation i's level: where sampling from evaluation i starts (img2img)."""
