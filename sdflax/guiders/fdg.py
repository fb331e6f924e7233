"""Frequency-decoupled guidance (Sadat et al. 2025, "Guidance in the Frequency Domain Enables High-Fidelity
Sampling at Low CFG Scales"), as diffusers' `FrequencyDecoupledGuidance` computes it: both predictions taken apart
into kornia's Laplacian pyramid, classifier-free guidance at its own scale on each level (highest frequencies first),
and the guided pyramid put back together.

The pyramid is kornia's (`build_laplacian_pyramid`, `pyrup`, `pyrdown` with their defaults): the 5×5 kernel
[1, 4, 6, 4, 1]ᵀ[1, 4, 6, 4, 1] / 256 with 'reflect' borders, bilinear resampling without aligned corners, and the
input reflect-padded at its bottom and right to the next power of two where kornia pads it. diffusers returns that
padded size, which no scheduler can step with; sdflax crops the prediction back to the latents' size.
"""

from __future__ import annotations

from typing import Any

import flax
import jax.numpy as jnp
from jax import lax

from .base import Guider, check_interval, check_numbers, off_at, positional, rescale, shown, static

__all__ = ["FrequencyDecoupledGuidance", "image_from_pyramid", "laplacian_pyramid", "pyrdown", "pyrup"]

KERNEL = (1 / 16, 4 / 16, 6 / 16, 4 / 16, 1 / 16)  # kornia's 5×5 pyramid kernel is its outer product with itself


def blur(x):
    """kornia's `filter2d(x, pyramid kernel, 'reflect')` over the last two axes, one axis at a time."""
    for axis in (x.ndim - 2, x.ndim - 1):
        n = x.shape[axis]
        padded = jnp.pad(x, [(2, 2) if a == axis else (0, 0) for a in range(x.ndim)], mode="reflect")
        x = sum(weight * lax.slice_in_dim(padded, i, i + n, axis=axis) for i, weight in enumerate(KERNEL))
    return x


def pyrdown(x):
    """kornia's `pyrdown` of an image with even sides (those of the pyramid): blurred, then bilinear at half size,
    which without aligned corners is the mean of each 2×2 block."""
    *lead, h, w = x.shape
    return blur(x).reshape(*lead, h // 2, 2, w // 2, 2).mean((-3, -1))


def double(x, axis):
    """torch's bilinear upsampling by 2 along `axis` without aligned corners: pixel 2k is ¼ x[k−1] + ¾ x[k], 2k+1
    is ¾ x[k] + ¼ x[k+1], the border pixel repeated (torch clamps its source index)."""
    n = x.shape[axis]
    padded = jnp.pad(x, [(1, 1) if a == axis else (0, 0) for a in range(x.ndim)], mode="edge")
    previous, following = lax.slice_in_dim(padded, 0, n, axis=axis), lax.slice_in_dim(padded, 2, n + 2, axis=axis)
    pixels = jnp.stack([0.25 * previous + 0.75 * x, 0.75 * x + 0.25 * following], axis + 1)
    return pixels.reshape(*x.shape[:axis], 2 * n, *x.shape[axis + 1:])


def pyrup(x):
    """kornia's `pyrup`: bilinear at twice the size, then blurred."""
    return blur(double(double(x, x.ndim - 2), x.ndim - 1))


def is_power_of_two(n):
    return n > 0 and n & (n - 1) == 0


def laplacian_pyramid(x, levels):
    """kornia's `build_laplacian_pyramid(x, levels)` over the last two axes: `levels` arrays, each a Gaussian level
    less the next one upsampled, then the last Gaussian level. Like kornia (0.9), x is first reflect-padded to the
    next power of two per side where neither side is one, or where a side is not a multiple of 2^(levels − 1)."""
    *_, h, w = x.shape
    stride = 2 ** (levels - 1)
    if not (is_power_of_two(h) or is_power_of_two(w)) or h % stride or w % stride:
        pads = [(0, 0)] * (x.ndim - 2) + [(0, 2 ** (h - 1).bit_length() - h), (0, 2 ** (w - 1).bit_length() - w)]
        x = jnp.pad(x, pads, mode="reflect")
    gaussians = [x]
    for _ in range(levels - 1):
        gaussians.append(pyrdown(gaussians[-1]))
    return [fine - pyrup(coarse) for fine, coarse in zip(gaussians, gaussians[1:])] + [gaussians[-1]]


def image_from_pyramid(pyramid):
    """diffusers' `build_image_from_pyramid`: the inverse of `laplacian_pyramid` (before its padding is cropped)."""
    image = pyramid[-1]
    for level in reversed(pyramid[:-1]):
        image = pyrup(image) + level
    return image


def per_level(value, levels):
    """A setting given once or per level (diffusers' float or list) -> one value per level."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * levels


def within(start, stop, step, num_steps):
    """diffusers' `is_within_range` for one interval: `int(start * n) <= step < int(stop * n)`."""
    return (int(start * num_steps) <= step) & (step < int(stop * num_steps))


def project(v0, v1):
    """diffusers' `project`: v0's parts parallel and orthogonal to v1, over all axes but the batch's (float32:
    without jax's x64 there is no float64 to upcast to)."""
    axes = tuple(range(1, v0.ndim))
    unit = v1 / jnp.maximum(jnp.sqrt(jnp.square(v1).sum(axes, keepdims=True)), 1e-12)
    parallel = (v0 * unit).sum(axes, keepdims=True) * unit
    return parallel, v0 - parallel


@flax.struct.dataclass(kw_only=True)
class FrequencyDecoupledGuidance(Guider):
    """CFG per level of a Laplacian pyramid, `guidance_scales` from the highest frequencies to the lowest;
    `guidance_rescale`, `parallel_weights`, `start` and `stop` take one value or one per level."""

    guidance_scales: Any = positional((10.0, 5.0))
    parallel_weights: Any = None  # None: each level's plain CFG shift (weight 1), and no projection computed
    guidance_rescale_space: str = static("data")
    upcast_to_double: bool = static(True)  # diffusers' float64 projection; sdflax computes it in float32

    per_level_arguments = ("guidance_scales", "guidance_rescale", "parallel_weights")

    def __post_init__(self):
        name, levels = type(self).__name__, self.levels
        if levels < 1:
            raise ValueError(f"{name}: guidance_scales={shown(self.guidance_scales)} must be a list of at least one "
                             "scale, one per frequency level from the highest")
        for field in ("guidance_rescale", "parallel_weights", "start", "stop"):
            value = getattr(self, field)
            if isinstance(value, (tuple, list)) and len(value) != levels:
                raise ValueError(f"{name}: {field} has {len(value)} values but guidance_scales has {levels} levels: "
                                 "give one value, or one per level")
        if not isinstance(self.guidance_rescale_space, str) or self.guidance_rescale_space not in ("data", "freq"):
            raise ValueError(f"{name}: guidance_rescale_space={shown(self.guidance_rescale_space)} must be 'data' or "
                             "'freq'")
        for field in ("start", "stop"):  # static fields must hash: lists become tuples
            object.__setattr__(self, field, per_level(getattr(self, field), levels))
        for level, (start, stop) in enumerate(zip(self.start, self.stop)):
            check_interval(name, start, stop, f" (level {level})")
        check_numbers(self)

    @property
    def levels(self):
        return len(self.guidance_scales) if isinstance(self.guidance_scales, (tuple, list)) else 0

    def in_interval(self, step, num_steps):
        """Whether any level may be guided: from the earliest start to the latest stop, as diffusers."""
        return within(min(self.start), max(self.stop), step, num_steps)

    def guide(self, pred_cond, pred_uncond, *, step, num_steps):
        levels, original = self.levels, self.use_original_formulation
        if (side := min(pred_cond.shape[-2:])) < 2 ** (levels - 1):  # a level would be less than one latent wide
            raise ValueError(f"{type(self).__name__}: {levels} levels halve the latents {levels - 1} times, but "
                             f"these are {side} wide on their short side: give at most {side.bit_length()} "
                             "guidance_scales, or a larger picture")
        rescales = per_level(self.guidance_rescale, levels)
        weights = per_level(self.parallel_weights, levels)
        guided = []
        for level, (cond, uncond) in enumerate(zip(laplacian_pyramid(pred_cond, levels),
                                                   laplacian_pyramid(pred_uncond, levels))):
            scale, shift = self.guidance_scales[level], cond - uncond
            if self.parallel_weights is not None:
                parallel, orthogonal = project(shift, cond)
                shift = jnp.where(jnp.asarray(weights[level]) == 1.0, shift, weights[level] * parallel + orthogonal)
            pred = (cond if original else uncond) + scale * shift
            if self.guidance_rescale_space == "freq":
                pred = rescale(pred, cond, rescales[level])
            # a level out of its interval, or at a scale that changes nothing, keeps the conditional level: what
            # diffusers means, though its loop appends a stale variable there and then fails
            on = within(self.start[level], self.stop[level], step, num_steps) & ~off_at(scale, original)
            guided.append(jnp.where(on, pred, cond))
        pred = image_from_pyramid(guided)[..., :pred_cond.shape[-2], :pred_cond.shape[-1]]
        if self.guidance_rescale_space == "data":
            pred = rescale(pred, pred_cond, rescales[0])
        all_off = jnp.all(jnp.stack([off_at(scale, original) for scale in self.guidance_scales]))
        return jnp.where(self.in_interval(step, num_steps) & ~all_off, pred, pred_cond)
