"""What every guider shares: the guidance interval, the predictions it needs, and how it sits in the one scan.

A guider is a hook (`sdflax.hooks`) whose `combine` turns the UNet's chunks into the prediction the scheduler
steps with: its numbers (scales, momentum, eta) are pytree leaves, traced, so a new value never recompiles; its
other fields (`start`, `stop`, `enabled`, norm dims, layers) are static. `Pipeline.with_guider(g)` puts it in every
call. The predictions come in diffusers' names: `pred_cond`, `pred_uncond`, and one more for the guiders that
perturb the UNet (`pred_cond_skip`, `pred_cond_seg`).

diffusers decides per step whether guidance runs: `int(start * n) <= step < int(stop * n)`, `step` counting the
model evaluations from 0 and `n` the call's steps (img2img: those left after `strength`); outside the interval, or
at a scale that changes nothing, the prediction is `pred_cond`. sdflax computes every chunk at every step (one
program) and selects, which gives diffusers' numbers.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from .. import sampling
from ..hooks.core import Hook

__all__ = ["Guider", "arguments", "cfg", "check_interval", "check_numbers", "norm", "norm_axes", "off_at", "positional", "rescale",
           "static"]


def static(default):
    """A guider field that fixes the program: changing it compiles another."""
    return flax.struct.field(pytree_node=False, default=default)


def positional(default):
    """A guider's first argument, its scale: the one it takes by position too (`ClassifierFreeGuidance(7.5)`), so
    that no later argument given by position can land in another's place."""
    return flax.struct.field(default=default, kw_only=False)


@flax.struct.dataclass(kw_only=True)
class Guider(Hook):
    """The base of sdflax.guiders, with the arguments every one of diffusers' guiders takes. Subclasses are
    `flax.struct.dataclass(kw_only=True)`s that declare their other arguments (diffusers', its defaults; the first
    `positional`) and define `guide(pred_cond, pred_uncond, *extra, step, num_steps) -> prediction`."""

    guidance_rescale: Any = 0.0
    use_original_formulation: bool = static(False)
    start: float = static(0.0)
    stop: float = static(1.0)
    enabled: bool = static(True)

    extra_predictions = ()  # names of the predictions after (pred_cond, pred_uncond), one UNet chunk each
    positive_arguments = ()  # traced arguments that must be above 0 (SEG's blur sigma)

    def __post_init__(self):
        check_interval(type(self).__name__, self.start, self.stop)
        check_numbers(self)

    def in_interval(self, step, num_steps):
        """Whether guidance runs at evaluation `step` (traced) of `num_steps` (diffusers' `is_within_range`)."""
        return (int(self.start * num_steps) <= step) & (step < int(self.stop * num_steps))

    def combine(self, outputs, inputs, settings):
        scope = sampling.current_scope()
        if not self.enabled:  # the UNet ran on the conditional rows alone
            return outputs[0]
        uncond, cond, *extra = outputs
        return self.guide(cond, uncond, *extra, step=scope.step, num_steps=scope.num_steps)


NUMBER_BOUND = 1e8  # past it a guider's float32 arithmetic (scaled differences, norms) overflows into black images


def check_numbers(guider):
    """Each traced argument (scales, weights, momentum, eta, ...) a finite number of magnitude at most NUMBER_BOUND,
    the `positive_arguments` above 0; arguments traced by a caller's jit are taken as they are."""
    name = type(guider).__name__
    for field in dataclasses.fields(guider):
        value = getattr(guider, field.name)
        leaves = jax.tree.leaves(value)
        if not field.metadata.get("pytree_node", True) or any(isinstance(x, jax.core.Tracer) for x in leaves):
            continue
        if any(isinstance(x, (bool, np.bool_)) or not (isinstance(x, numbers.Real) or hasattr(x, "dtype"))
               for x in leaves):
            raise ValueError(f"{name}: {field.name}={value!r:.60} must be a number")
        with np.errstate(all="ignore"):
            values = np.concatenate([np.asarray(x, np.float64).ravel() for x in leaves] or [np.zeros(0)])
        if not np.isfinite(values).all() or np.abs(values).max(initial=0) > NUMBER_BOUND:
            raise ValueError(f"{name}: {field.name}={value!r:.60} must be finite and at most {NUMBER_BOUND:.0e} in "
                             "magnitude: larger values overflow float32 into black images")
        if field.name in guider.positive_arguments and (values <= 0).any():
            raise ValueError(f"{name}: {field.name}={value!r:.60} must be above 0")


def check_interval(name, start, stop, where="", names=("start", "stop")):
    """diffusers' checks of a guidance interval, in one line each (`where`: which level of several; `names`: the
    arguments', ("perturbed_guidance_start", "perturbed_guidance_stop") for PAG's own interval)."""
    for argument, value in zip(names, (start, stop)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name}: {argument}={value!r:.60}{where} must be a number, a fraction of the steps")
    if not 0.0 <= start < 1.0:
        raise ValueError(f"{name}: {names[0]}={start}{where} must be in [0, 1): the fraction of the steps after "
                         "which guidance begins")
    if not start <= stop <= 1.0:
        raise ValueError(f"{name}: {names[1]}={stop}{where} must be in [start, 1] = [{start}, 1]: the fraction of "
                         "the steps after which guidance ends")


def arguments(guider) -> tuple[str, ...]:
    """A guider's (or guider class's) arguments: its own in their order, then those every guider takes. That is
    diffusers' order but for APG-mix and FDG, whose diffusers classes interleave the two."""
    shared = tuple(field.name for field in dataclasses.fields(Guider))
    return tuple(field.name for field in dataclasses.fields(guider) if field.name not in shared) + shared


def off_at(scale, use_original_formulation):
    """diffusers' `is_close`: the scale at which guidance changes nothing (0 in the original formulation, else 1).
    `math.isclose`'s relative 1e-9 is equality in float32."""
    return jnp.asarray(scale, jnp.float32) == (0.0 if use_original_formulation else 1.0)


def cfg(pred_cond, pred_uncond, scale, use_original_formulation):
    """ε̂ = ε(∅) + s (ε(c) − ε(∅)), or in the original formulation ε(c) + s (ε(c) − ε(∅)) (Ho & Salimans 2022)."""
    return (pred_cond if use_original_formulation else pred_uncond) + scale * (pred_cond - pred_uncond)


def rescale(pred, pred_cond, guidance_rescale):
    """diffusers' `rescale_noise_cfg`, applied only where `guidance_rescale > 0` as diffusers does."""
    return jnp.where(jnp.asarray(guidance_rescale) > 0, sampling.rescale(pred, pred_cond, guidance_rescale), pred)


def norm_axes(norm_dim, ndim):
    """diffusers' `norm_dim`: None -> every axis but the batch's; an int or a tuple of ints as given."""
    if norm_dim is None:
        return tuple(range(1, ndim))
    return (norm_dim,) if isinstance(norm_dim, int) else tuple(norm_dim)


def norm(x, axes):
    """The L2 norm of x over `axes` (any number of them), kept as size-1 axes."""
    return jnp.sqrt(jnp.square(x).sum(axes, keepdims=True))
