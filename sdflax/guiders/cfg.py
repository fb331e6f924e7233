"""Guiders that combine the conditional and unconditional predictions: classifier-free guidance and three
refinements of it, each as diffusers' class of the same name computes it."""

from __future__ import annotations

from typing import Any

import flax
import jax.numpy as jnp

from .base import Guider, cfg, norm, off_at, positional, rescale


@flax.struct.dataclass(kw_only=True)
class ClassifierFreeGuidance(Guider):
    """ε̂ = ε(∅) + s (ε(c) − ε(∅)) (Ho & Salimans 2022), with the guidance interval and diffusers' rescale."""

    guidance_scale: Any = positional(7.5)

    def guide(self, pred_cond, pred_uncond, *, step, num_steps):
        on = self.in_interval(step, num_steps) & ~off_at(self.guidance_scale, self.use_original_formulation)
        pred = jnp.where(on, cfg(pred_cond, pred_uncond, self.guidance_scale, self.use_original_formulation),
                         pred_cond)
        return rescale(pred, pred_cond, self.guidance_rescale)


@flax.struct.dataclass(kw_only=True)
class ClassifierFreeZeroStarGuidance(Guider):
    """CFG-Zero* (Fan et al. 2025): the unconditional prediction scaled by its optimal projection coefficient
    α = ⟨ε(c), ε(∅)⟩ / ‖ε(∅)‖² per image, and a zero prediction for the first `zero_init_steps` evaluations."""

    guidance_scale: Any = positional(7.5)
    zero_init_steps: Any = 1

    def guide(self, pred_cond, pred_uncond, *, step, num_steps):
        b = pred_cond.shape[0]
        cond, uncond = pred_cond.reshape(b, -1), pred_uncond.reshape(b, -1)
        alpha = (cond * uncond).sum(1) / ((uncond ** 2).sum(1) + 1e-8)
        scaled_uncond = pred_uncond * alpha.reshape(b, *(1,) * (pred_cond.ndim - 1))
        on = self.in_interval(step, num_steps) & ~off_at(self.guidance_scale, self.use_original_formulation)
        pred = jnp.where(on, cfg(pred_cond, scaled_uncond, self.guidance_scale, self.use_original_formulation),
                         pred_cond)
        # zero after the rescale: diffusers rescales the zero prediction, 0 x (std(ε(c)) / 0), a NaN image
        return jnp.where(step < self.zero_init_steps, 0.0, rescale(pred, pred_cond, self.guidance_rescale))


@flax.struct.dataclass(kw_only=True)
class TangentialClassifierFreeGuidance(Guider):
    """TCFG (Kwon et al. 2025): the unconditional prediction replaced by its projection on the first right
    singular vector of [ε(c); ε(∅)] per image (its tangential part removed), then CFG."""

    guidance_scale: Any = positional(7.5)

    def guide(self, pred_cond, pred_uncond, *, step, num_steps):
        b = pred_cond.shape[0]
        uncond = pred_uncond.reshape(b, 1, -1)
        _, _, vh = jnp.linalg.svd(jnp.concatenate([pred_cond.reshape(b, 1, -1), uncond], 1), full_matrices=False)
        first = vh[:, :1]  # (B, 1, N): the principal direction; its sign cancels in v vᵀ
        projected = ((uncond @ first.transpose(0, 2, 1)) @ first).reshape(pred_uncond.shape)
        on = self.in_interval(step, num_steps) & ~off_at(self.guidance_scale, self.use_original_formulation)
        pred = jnp.where(on, cfg(pred_cond, projected, self.guidance_scale, self.use_original_formulation),
                         pred_cond)
        return rescale(pred, pred_cond, self.guidance_rescale)


@flax.struct.dataclass(kw_only=True)
class MagnitudeAwareGuidance(Guider):
    """MAG / MAMBO-G: the scale damped where the guidance update is large against the unconditional prediction,
    s' = 1 + (s − 1) exp(−α ‖ε(c) − ε(∅)‖ / ‖ε(∅)‖) per image (s exp(...) in the original formulation)."""

    guidance_scale: Any = positional(10.0)
    alpha: Any = 8.0

    non_negative_arguments = ("alpha",)  # below 0 the damping grows as exp(|α| ratio): inf past |α| ratio ≈ 88

    def guide(self, pred_cond, pred_uncond, *, step, num_steps):
        axes = tuple(range(1, pred_cond.ndim))
        diff = pred_cond - pred_uncond
        ratio = norm(diff, axes) / norm(pred_uncond, axes)
        damping = jnp.exp(-self.alpha * ratio)
        scale = (self.guidance_scale * damping if self.use_original_formulation
                 else 1.0 + (self.guidance_scale - 1.0) * damping)
        guided = (pred_cond if self.use_original_formulation else pred_uncond) + scale * diff
        on = self.in_interval(step, num_steps) & ~off_at(self.guidance_scale, self.use_original_formulation)
        return rescale(jnp.where(on, guided, pred_cond), pred_cond, self.guidance_rescale)
