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

__all__ = ["Guider", "arguments", "cfg", "check_interval", "check_numbers", "is_real_number", "norm", "norm_axes",
           "off_at", "positional", "rescale", "shown", "static"]


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
    non_negative_arguments = ()  # traced arguments that must be 0 or above (MAG's alpha)
    per_level_arguments = ()  # traced arguments that take one number or a tuple of them (FDG's, per level)
    optional_arguments = ()  # traced arguments that take None (besides those whose default is None)

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
    """Each traced argument (scales, weights, momentum, eta, ...) one real number, finite, of magnitude at most
    NUMBER_BOUND (a tuple or list of them for the `per_level_arguments`; None where None is its default or it is
    one of the `optional_arguments`), the `positive_arguments` above 0, the `non_negative_arguments` 0 or above;
    each `bool` field True or False. Arguments traced by a caller's jit are taken as they are."""
    name = type(guider).__name__
    for field in dataclasses.fields(guider):
        value = getattr(guider, field.name)
        if field.type in ("bool", bool):  # static flags: anything truthy was taken as True
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name}: {field.name}={shown(value)} must be True or False")
            continue
        if not field.metadata.get("pytree_node", True) or value is None and (
                field.default is None or field.name in guider.optional_arguments):
            continue
        per_level = field.name in guider.per_level_arguments
        items = list(value) if per_level and isinstance(value, (tuple, list)) else [value]
        if any(isinstance(x, jax.core.Tracer) for x in items):
            continue
        if not items or not all(is_real_number(x) for x in items):
            complex_given = any(np.iscomplexobj(x) for x in items if isinstance(x, (numbers.Number, np.ndarray,
                                                                                       jax.Array)))
            levels = ", or a list of them, one per level" if per_level else ""
            raise ValueError(f"{name}: {field.name}={shown(value)} must be {'a real' if complex_given else 'a'} "
                             f"number{levels}")
        values = np.array([as_float64(x) for x in items])
        if not np.isfinite(values).all() or np.abs(values).max(initial=0) > NUMBER_BOUND:
            raise ValueError(f"{name}: {field.name}={shown(value)} must be finite and at most {NUMBER_BOUND:.0e} in "
                             "magnitude: larger values overflow float32 into black images")
        if field.name in guider.positive_arguments and (values <= 0).any():
            raise ValueError(f"{name}: {field.name}={shown(value)} must be above 0")
        if field.name in guider.non_negative_arguments and (values < 0).any():
            raise ValueError(f"{name}: {field.name}={shown(value)} must be 0 or above")


def as_float64(x) -> float:
    """A real number in float64; inf past its range (a Python int of 400 digits)."""
    try:
        with np.errstate(all="ignore"):
            return float(np.asarray(x, np.float64))
    except OverflowError:
        return float("inf")


def is_real_number(x) -> bool:
    """One real number: a Python int or float, or a 0-d integer or float array (numpy or jax); not a boolean."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return np.shape(x) == () and np.dtype(x.dtype).kind in "fiu"
    return isinstance(x, numbers.Real)


def shown(value) -> str:
    """A value in a few characters on one line: an array by its dtype and shape (its repr spans lines)."""
    if hasattr(value, "dtype") and np.ndim(value) > 0:
        return f"<{value.dtype} array of shape {tuple(np.shape(value))}>"
    if isinstance(value, (tuple, list)) and any(np.ndim(x) > 0 for x in value if hasattr(x, "dtype")):
        return f"<{type(value).__name__} of {len(value)} holding arrays>"
    return f"{' '.join(repr(value).split()):.60}"


def check_interval(name, start, stop, where="", names=("start", "stop")):
    """diffusers' checks of a guidance interval, in one line each (`where`: which level of several; `names`: the
    arguments', ("perturbed_guidance_start", "perturbed_guidance_stop") for PAG's own interval)."""
    for argument, value in zip(names, (start, stop)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name}: {argument}={shown(value)}{where} must be a number, a fraction of the steps")
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
