"""The denoising objective as diffusers' training scripts compute it (`train_text_to_image_lora.py` and its
siblings): x_t = √ᾱ_t x_0 + √(1-ᾱ_t) ε with ε offset per channel (`noise_offset`), the ε or v target, min-SNR-γ
weights, DreamBooth's prior-preservation term, the mean over pixels and then rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from ..schedulers.common import alphas_cumprod
from ..schedulers.ddpm import DDPMConfig


@dataclasses.dataclass(frozen=True)
class NoiseSchedule:
    """The training scheduler's ᾱ_t, t = 0..T-1 (diffusers' DDPMScheduler from the checkpoint's scheduler config,
    `rescale_betas_zero_snr` included), and the prediction type the model learns."""

    alpha_prod: np.ndarray  # float32 (T,)
    prediction_type: str

    @classmethod
    def from_config(cls, scheduler_config: Mapping, prediction_type: str | None = None) -> "NoiseSchedule":
        config = DDPMConfig.from_dict({k: v for k, v in scheduler_config.items() if not k.startswith("_")})
        prediction_type = prediction_type or config.prediction_type
        if prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"training predicts epsilon or v_prediction, not {prediction_type!r} (diffusers' "
                             "training scripts take these two): set TrainConfig.prediction_type")
        alpha_prod, _ = alphas_cumprod(config, rescale_zero_snr=config.rescale_betas_zero_snr, torch_rounding=True)
        return cls(alpha_prod, prediction_type)

    @property
    def num_train_timesteps(self) -> int:
        return len(self.alpha_prod)

    def coefficients(self, timesteps):
        """(√ᾱ_t, √(1-ᾱ_t)) per row, (B, 1, 1, 1), float32 as DDPMScheduler.add_noise gathers them."""
        alpha_prod = jnp.asarray(self.alpha_prod)[timesteps]
        return (jnp.sqrt(alpha_prod)[:, None, None, None], jnp.sqrt(1.0 - alpha_prod)[:, None, None, None])

    def add_noise(self, latents, noise, timesteps):
        """q(x_t | x_0) sampled with `noise` (Ho et al. 2020, eq. 4)."""
        alpha, sigma = self.coefficients(timesteps)
        return alpha * latents + sigma * noise

    def target(self, latents, noise, timesteps):
        """What the model learns to predict: ε, or v = √ᾱ_t ε - √(1-ᾱ_t) x_0 (Salimans & Ho 2022, `get_velocity`)."""
        if self.prediction_type == "epsilon":
            return noise
        alpha, sigma = self.coefficients(timesteps)
        return alpha * noise - sigma * latents

    def snr(self, timesteps):
        """ᾱ_t / (1 - ᾱ_t), as diffusers' `compute_snr`: (√ᾱ_t / √(1-ᾱ_t))²."""
        alpha_prod = jnp.asarray(self.alpha_prod)[timesteps]
        return (jnp.sqrt(alpha_prod) / jnp.sqrt(1.0 - alpha_prod)) ** 2


def denoising_loss(prediction, target, timesteps, schedule: NoiseSchedule, snr_gamma=None,
                   prior_loss_weight=None):
    """The scripts' loss. Without `snr_gamma`: the mean squared error over everything. With it (Hang et al. 2023):
    each row's mean error weighted by min(SNR_t, γ) / SNR_t (ε) or min(SNR_t, γ) / (SNR_t + 1) (v), then the mean.
    With `prior_loss_weight` (DreamBooth) the rows' second half are the class images: their plain mean error, times
    the weight, is added to the first half's loss."""
    prediction, target = prediction.astype(jnp.float32), target.astype(jnp.float32)
    if prior_loss_weight is not None:
        prediction, prior_prediction = jnp.split(prediction, 2)
        target, prior_target = jnp.split(target, 2)
        timesteps = jnp.split(timesteps, 2)[0]
    if snr_gamma is None:
        loss = jnp.mean((prediction - target) ** 2)
    else:
        snr = schedule.snr(timesteps)
        weights = jnp.minimum(snr, snr_gamma)
        weights = weights / snr if schedule.prediction_type == "epsilon" else weights / (snr + 1)
        loss = jnp.mean(jnp.mean((prediction - target) ** 2, axis=tuple(range(1, prediction.ndim))) * weights)
    if prior_loss_weight is not None:
        loss = loss + prior_loss_weight * jnp.mean((prior_prediction - prior_target) ** 2)
    return loss
