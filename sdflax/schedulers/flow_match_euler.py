"""Euler on a rectified flow: Esser et al. 2024, "Scaling Rectified Flow Transformers for High-Resolution Image
Synthesis" (Stable Diffusion 3), matching diffusers' FlowMatchEulerDiscreteScheduler.

x_σ = (1 - σ) x_0 + σ ε for σ in [0, 1]; the model predicts the velocity v = dx/dσ = ε - x_0 (prediction type
"flow"), and a step is x + (σ_next - σ) v. The σ are spaced evenly in t = σ T and bent towards noise by the
shift s: σ -> s σ / (1 + (s - 1) σ), or, with `use_dynamic_shifting`, by a shift `mu` that depends on the image's
size (`with_mu`, `for_image_seq_len`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import flax
import jax.numpy as jnp
import numpy as np

from ..models.config import ConfigError, config_from_dict, config_source
from . import common, sigma_schedules
from .sigma_config import check_one_schedule

TIME_SHIFT_TYPES = ("exponential", "linear")
SIGMA_SPACINGS = ("trained", "flux")


@dataclasses.dataclass(frozen=True)
class FlowMatchEulerConfig:
    """diffusers' FlowMatchEulerDiscreteScheduler fields (its defaults), and sdflax's `mu` and custom σ."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False  # shift by `mu` (the image size's) instead of `shift`
    base_shift: float = 0.5  # mu at base_image_seq_len latent tokens ...
    max_shift: float = 1.15  # ... and at max_image_seq_len, linear in between (`for_image_seq_len`)
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    invert_sigmas: bool = False
    shift_terminal: float | None = None  # stretch the shifted σ so that the last step starts at this σ
    use_karras_sigmas: bool = False  # at most one of these four: σ placed between the shifted end points
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    use_kl_optimal_sigmas: bool = False  # sdflax's (A1111's and ComfyUI's "KL Optimal"); diffusers has no such flag
    time_shift_type: str = "exponential"
    stochastic_sampling: bool = False  # x_next = (1 - σ_next) x̂_0 + σ_next z, z fresh noise
    # Never read from a config file; static, as the scheduler is: a new one is a new program.
    mu: float | None = None  # the dynamic shift (`with_mu`)
    custom_sigmas: tuple[float, ...] | None = None  # `with_schedule(sigmas=)`: n σ, then 0
    custom_timesteps: None = None  # flow σ are given, not timesteps (what the pipelines read)
    # the σ before shifting where none are given: "trained", evenly between the training σ's ends (diffusers' own,
    # its SD 3 pipelines'); "flux", linspace(1, 1/n, n), what diffusers' Flux pipelines hand it (`with_sigma_spacing`)
    sigma_spacing: str = "trained"

    prediction_type = "flow"  # the model's output: the velocity ε - x_0

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "FlowMatchEulerConfig":
        """Our fields out of a diffusers scheduler_config.json dict; other keys are ignored, bad values are a
        `ConfigError` naming the file."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"{cls.__name__}: the scheduler config is a {type(config).__name__}, not a JSON object")
        fields = {k: v for k, v in config.items() if k not in ("mu", "custom_sigmas", "custom_timesteps",
                                                                  "sigma_spacing")}
        try:
            return config_from_dict(cls, fields)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:  # __post_init__'s checks
            raise ConfigError(f"{config_source(config)}{' '.join(str(e).split())[:300]}") from None

    def __post_init__(self):
        if self.sigma_spacing not in SIGMA_SPACINGS:
            raise ValueError(f"sigma_spacing={self.sigma_spacing!r}; allowed: {SIGMA_SPACINGS}")
        if self.time_shift_type not in TIME_SHIFT_TYPES:
            raise ValueError(f"time_shift_type={self.time_shift_type!r}; allowed: {TIME_SHIFT_TYPES}")
        check_one_schedule(self)
        if not self.shift > 0:
            raise ValueError(f"shift={self.shift!r} must be positive (1: no shift; SD3 uses 3)")
        if self.shift_terminal is not None and not 0 <= self.shift_terminal < 1:
            raise ValueError(f"shift_terminal={self.shift_terminal!r} must be in [0, 1), or None for none")
        if self.custom_sigmas is not None and (max(self.custom_sigmas) > 1 or self.custom_sigmas[-1] != 0):
            raise ValueError(f"sigmas={list(self.custom_sigmas)!r:.120}: flow σ lie in [0, 1] and end at 0, where the "
                             "last step lands (append 0 to diffusers' list)")


@flax.struct.dataclass
class FlowMatchEulerState:
    timesteps: jnp.ndarray  # float32 [n]: σ T, what the model is given
    sigmas: jnp.ndarray  # float32 [n+1]: σ_i, descending (ascending with invert_sigmas); σ_n after the last step
    num_inference_steps: int = flax.struct.field(pytree_node=False)
    init_noise_sigma: float = flax.struct.field(pytree_node=False)  # 1: x_1 is the noise itself


def img2img_start(num_inference_steps: int, strength: float) -> int:
    """How many steps of the schedule SD3's img2img skips: diffusers' StableDiffusion3Img2ImgPipeline
    `get_timesteps`, which rounds 1 - strength of the steps down to whole steps after multiplying (SD 1.x's
    img2img rounds the steps run down instead)."""
    if not 0 < strength <= 1:
        raise ValueError(f"strength must be in (0, 1], got {strength}: 1 repaints everything, small values keep "
                         "the image")
    return int(max(num_inference_steps - min(num_inference_steps * strength, num_inference_steps), 0))


@dataclasses.dataclass(frozen=True)
class FlowMatchEulerScheduler(common.SchedulerBase):
    config: FlowMatchEulerConfig
    custom_schedules = ("sigmas",)

    def with_mu(self, mu: float):
        """This scheduler shifting by `mu` (diffusers' `set_timesteps(mu=)`), for `use_dynamic_shifting`."""
        if isinstance(mu, bool) or not isinstance(mu, (int, float, np.number)) or not math.isfinite(mu):
            raise ValueError(f"mu={mu!r} must be a finite number (the log of the shift)")
        return dataclasses.replace(self, config=dataclasses.replace(self.config, mu=float(mu)))

    def with_sigma_spacing(self, spacing: str):
        """This scheduler spacing its σ as a family's pipelines do (`FlowMatchEulerConfig.sigma_spacing`)."""
        if spacing == self.config.sigma_spacing:
            return self
        return dataclasses.replace(self, config=dataclasses.replace(self.config, sigma_spacing=spacing))

    def for_image_seq_len(self, image_seq_len: int):
        """This scheduler with the mu diffusers' SD3 and Flux pipelines give an image of `image_seq_len` latent
        tokens ((h / patch) (w / patch)) where its config shifts dynamically and no mu is set; else itself."""
        cfg = self.config
        if not cfg.use_dynamic_shifting or cfg.mu is not None:
            return self
        slope = (cfg.max_shift - cfg.base_shift) / (cfg.max_image_seq_len - cfg.base_image_seq_len)
        return self.with_mu(image_seq_len * slope + cfg.base_shift - slope * cfg.base_image_seq_len)

    def with_schedule(self, timesteps=None, sigmas=None):
        """This scheduler running the given σ: n of them, then 0 (diffusers' `set_timesteps(sigmas=)`, which
        appends the 0); the config's shift applies to them, as diffusers'."""
        if timesteps is not None:
            raise ValueError(f"{type(self).__name__} takes custom sigmas (as SD3's pipelines pass them), not "
                             "timesteps: give σ = t / num_train_timesteps, then 0")
        return super().with_schedule(sigmas=sigmas)

    img2img_start = staticmethod(img2img_start)  # the steps img2img skips, as SD 3's pipelines count them

    def check_steps(self, num_inference_steps: int) -> None:
        common.check_steps(self.config, num_inference_steps)
        if self.config.use_dynamic_shifting and self.config.mu is None:
            raise ValueError("use_dynamic_shifting needs mu: scheduler.for_image_seq_len(tokens) or "
                             "scheduler.with_mu(mu)")

    def schedule(self, num_inference_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """(timesteps float32 (n,), σ float32 (n+1,)), as diffusers' `set_timesteps` computes them."""
        self.check_steps(num_inference_steps)
        cfg, T = self.config, self.config.num_train_timesteps
        if cfg.custom_sigmas is not None:  # float32, as diffusers casts given σ
            sigmas = np.asarray(cfg.custom_sigmas[:-1], np.float32)
        elif cfg.sigma_spacing == "flux":
            sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps).astype(np.float32)
        else:  # between the end points of diffusers' T training σ, float32 and already shifted (unless
            # dynamically): the last σ is shifted twice, as diffusers'
            train = np.linspace(1, T, T, dtype=np.float32)[::-1] / np.float32(T)
            if not cfg.use_dynamic_shifting:
                train = self.shifted(train)
            sigma_max, sigma_min = float(train[0]), float(train[-1])
            sigmas = np.linspace(sigma_max * T, sigma_min * T, num_inference_steps) / T
        sigmas = self.shifted(sigmas)
        if cfg.shift_terminal:
            one_minus = 1 - sigmas
            sigmas = 1 - one_minus / (one_minus[-1] / (1 - cfg.shift_terminal))
        if (schedule := common.sigma_schedule(cfg)) != "spaced":
            sigmas = sigma_schedules.schedule_sigmas(schedule, sigmas[-1].item(), sigmas[0].item(),
                                                     num_inference_steps)
        sigmas = sigmas.astype(np.float32)
        final = np.float32(0)
        if cfg.invert_sigmas:
            sigmas, final = 1 - sigmas, np.float32(1)
        return sigmas * np.float32(T), np.append(sigmas, final)

    def shifted(self, sigmas: np.ndarray) -> np.ndarray:
        """σ bent towards noise, in σ's dtype: by `shift`, or by exp(mu) (or mu, `time_shift_type` linear)."""
        cfg = self.config
        if not cfg.use_dynamic_shifting:
            return cfg.shift * sigmas / (1 + (cfg.shift - 1) * sigmas)
        shift = math.exp(cfg.mu) if cfg.time_shift_type == "exponential" else cfg.mu
        return shift / (shift + (1 / sigmas - 1))

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...] | None = None, start: int = 0
                      ) -> FlowMatchEulerState:
        """`shape` is accepted for symmetry with the multistep schedulers and ignored; `start` skips that many
        steps (img2img: `img2img_start`)."""
        timesteps, sigmas = self.schedule(num_inference_steps)
        common.check_start(start, len(timesteps))
        return FlowMatchEulerState(timesteps=jnp.asarray(timesteps[start:]), sigmas=jnp.asarray(sigmas[start:]),
                                   num_inference_steps=num_inference_steps, init_noise_sigma=1.0)

    def scale_model_input(self, state, sample, i):
        return sample

    def predict_x0(self, state, model_output, i, sample):
        """x̂_0 = x - σ v, float32."""
        sigma = state.sigmas[i]
        return common.predict_x0_and_epsilon(model_output, sample, 1 - sigma, sigma, "flow")[0]

    def step(self, state: FlowMatchEulerState, model_output, i, sample, key=None, variance_noise=None):
        """x_{i+1} = x + (σ_{i+1} - σ_i) v: one Euler step of the flow's ODE dx/dσ = v. With stochastic_sampling,
        x̂_0 noised afresh to σ_{i+1} (from `key`, or `variance_noise` as given)."""
        x = sample.astype(jnp.float32)
        sigma, sigma_next = state.sigmas[i], state.sigmas[i + 1]
        if self.config.stochastic_sampling:
            noise = common.draw_step_noise(key, variance_noise, x.shape, "stochastic_sampling")
            prev_sample = (1 - sigma_next) * self.predict_x0(state, model_output, i, x) + sigma_next * noise
        else:
            prev_sample = x + (sigma_next - sigma) * model_output.astype(jnp.float32)
        return prev_sample.astype(sample.dtype), state

    def add_noise(self, state, original_samples, noise, i):
        """(1 - σ_i) x_0 + σ_i ε: the sample to start sampling at evaluation i from (img2img; diffusers'
        `scale_noise`)."""
        sigma = state.sigmas[i]
        noisy = sigma * noise.astype(jnp.float32) + (1 - sigma) * original_samples.astype(jnp.float32)
        return noisy.astype(original_samples.dtype)
