"""Adaptive projected guidance (Sadat et al. 2024, "Eliminating Oversaturation and Artifacts of High Guidance
Scales"), as diffusers' `AdaptiveProjectedGuidance` and `AdaptiveProjectedMixGuidance` compute it: the update
ε(c) − ε(∅), averaged with momentum over the steps, its norm capped, split into its parts parallel and orthogonal
to ε(c), and the parallel part (which oversaturates) scaled by η. The momentum buffer rides in the scan's carry."""

from __future__ import annotations

from typing import Any

import flax
import jax.numpy as jnp

from .. import sampling
from .base import Guider, cfg, norm, norm_axes, off_at, positional, rescale, shown, static

MOMENTUM = "guider.momentum"  # the buffer's name in the scan's memory


def momentum_update(diff, momentum, active):
    """diffusers' `MomentumBuffer.update` where `active`: the running average r ← diff + m r (r = 0 at the first
    step), carried to the next evaluation; returns the new average."""
    scope = sampling.current_scope()
    previous = scope.read(MOMENTUM)
    previous = jnp.zeros_like(diff) if previous is None else previous
    average = jnp.where(active, diff + momentum * previous, previous)
    scope.write(MOMENTUM, average)
    return average


def projected_update(diff, pred_cond, eta, norm_threshold, axes):
    """diffusers' `normalized_guidance` after the momentum: diff capped at norm `norm_threshold` (where > 0), then
    its part parallel to ε(c) scaled by η."""
    diff = jnp.where(norm_threshold > 0, diff * jnp.minimum(1.0, norm_threshold / norm(diff, axes)), diff)
    unit = pred_cond / jnp.maximum(norm(pred_cond, axes), 1e-12)
    parallel = (diff * unit).sum(axes, keepdims=True) * unit
    return diff - parallel + eta * parallel


@flax.struct.dataclass(kw_only=True)
class AdaptiveProjectedGuidance(Guider):
    guidance_scale: Any = positional(7.5)
    adaptive_projected_guidance_momentum: Any = None  # None: no momentum buffer
    adaptive_projected_guidance_rescale: Any = 15.0
    adaptive_projected_guidance_norm_dim: Any = static(None)
    eta: Any = 1.0

    def __post_init__(self):
        dims = self.adaptive_projected_guidance_norm_dim
        axes = (dims,) if isinstance(dims, int) else dims
        if dims is not None and not (isinstance(axes, (tuple, list)) and axes and all(
                isinstance(a, int) and not isinstance(a, bool) and -4 <= a < 4 for a in axes)):
            raise ValueError(f"{type(self).__name__}: adaptive_projected_guidance_norm_dim={shown(dims):.40} must be None "
                             "(every axis but the batch's), an axis or a tuple of axes of the latents (B, C, H, W), "
                             "e.g. (-2, -1)")
        if isinstance(dims, list):  # a static field must hash
            object.__setattr__(self, "adaptive_projected_guidance_norm_dim", tuple(dims))
        super().__post_init__()

    @property
    def carries(self):
        return self.adaptive_projected_guidance_momentum is not None

    def guide(self, pred_cond, pred_uncond, *, step, num_steps):
        on = self.in_interval(step, num_steps) & ~off_at(self.guidance_scale, self.use_original_formulation)
        diff = pred_cond - pred_uncond
        if self.carries:
            diff = momentum_update(diff, self.adaptive_projected_guidance_momentum, on)
        axes = norm_axes(self.adaptive_projected_guidance_norm_dim, diff.ndim)
        update = projected_update(diff, pred_cond, self.eta, self.adaptive_projected_guidance_rescale, axes)
        base = pred_cond if self.use_original_formulation else pred_uncond
        pred = jnp.where(on, base + self.guidance_scale * update, pred_cond)
        return rescale(pred, pred_cond, self.guidance_rescale)


@flax.struct.dataclass(kw_only=True)
class AdaptiveProjectedMixGuidance(Guider):
    """Classifier-free guidance until evaluation `adaptive_projected_guidance_start_step`, APG (its own scale)
    after it; the momentum buffer is updated at every guided step."""

    guidance_scale: Any = positional(3.5)
    adaptive_projected_guidance_scale: Any = 10.0
    adaptive_projected_guidance_momentum: Any = -0.5
    adaptive_projected_guidance_rescale: Any = 10.0
    eta: Any = 0.0
    adaptive_projected_guidance_start_step: Any = 5

    optional_arguments = ("adaptive_projected_guidance_momentum",)  # None: no momentum buffer, as diffusers

    @property
    def carries(self):
        return self.adaptive_projected_guidance_momentum is not None

    def guide(self, pred_cond, pred_uncond, *, step, num_steps):
        original = self.use_original_formulation
        cfg_on = self.in_interval(step, num_steps) & ~off_at(self.guidance_scale, original)
        apg_on = cfg_on & (step > self.adaptive_projected_guidance_start_step) & ~off_at(
            self.adaptive_projected_guidance_scale, original)
        diff = pred_cond - pred_uncond
        if self.carries:
            diff = momentum_update(diff, self.adaptive_projected_guidance_momentum, cfg_on)
        update = projected_update(diff, pred_cond, self.eta, self.adaptive_projected_guidance_rescale,
                                  tuple(range(1, diff.ndim)))
        base = pred_cond if original else pred_uncond
        pred = jnp.where(apg_on, base + self.adaptive_projected_guidance_scale * update,
                         jnp.where(cfg_on, cfg(pred_cond, pred_uncond, self.guidance_scale, original), pred_cond))
        return rescale(pred, pred_cond, self.guidance_rescale)
