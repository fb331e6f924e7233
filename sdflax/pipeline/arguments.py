"""Each call argument of the kind it must be, before anything reads it: arrays of real numbers with a batch axis,
scales that are one real number within float32's safe range, functions that are callable, flags that are booleans.
A list, a string, a complex number or 3e38 failed deep inside the trace or drew a black image."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from ..guiders.base import NUMBER_BOUND
from .types import float32_array

# Arguments that take arrays (not pictures, which also come as PIL images or lists of them), and those that take
# one number.
ARRAYS = ("prompt_ids", "neg_prompt_ids", "prompt_weights", "neg_prompt_weights", "prompt_embeds", "neg_prompt_embeds", "pooled_prompt_embeds",
          "neg_pooled_prompt_embeds", "latents", "noise")
NUMBERS = ("guidance_scale", "guidance_rescale", "strength", "aesthetic_score", "negative_aesthetic_score",
           "skip_layer_guidance_scale", "skip_layer_guidance_start", "skip_layer_guidance_stop")
FUNCTIONS = ("callback", "guidance")  # None, or a function
FLAGS = ("return_trajectory",)
WHOLE_NUMBERS = ("clip_skip",)  # None, or a whole number
WORDS = {"output_type": "'np' or 'latent'"}  # a string among these


def described(value) -> str:
    """A value in a few words on one line (an array's repr spans lines)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"a {value.dtype} array of shape {tuple(value.shape)}"
    return f"{value!r:.40} ({type(value).__name__})"


def check_kinds(args):
    for name in ARRAYS:
        value = args.get(name)
        if value is not None and not hasattr(value, "shape"):
            raise TypeError(f"{name} must be an array (numpy or jax), got a {type(value).__name__}"
                            + (": make it with pipeline.prepare_inputs(prompts)" if name.endswith("_ids") else ""))
        real = value is None or any(jnp.issubdtype(value.dtype, kind) for kind in (jnp.floating, jnp.integer))
        if not real:  # bfloat16 is one
            raise TypeError(f"{name} must be an array of real numbers, got {value.dtype}")
        if value is not None and np.ndim(value) < 2:
            raise ValueError(f"{name} has shape {value.shape}; it takes a batch, (B, ...): one row per prompt")
    for name in NUMBERS:
        value = args.get(name)
        if value is None and name != "guidance_scale":  # None: the default (guidance_scale has no None)
            continue
        if isinstance(value, bool) or not (hasattr(value, "shape") or isinstance(value, numbers.Real)) or (
                hasattr(value, "dtype") and np.dtype(value.dtype).kind not in "fiu"):
            raise TypeError(f"{name} must be a number, got {described(value)}")
        if not isinstance(value, jax.core.Tracer):  # past the bound, scaled differences overflow float32
            with np.errstate(all="ignore"):
                values = np.asarray(value, np.float64)
            if np.isfinite(values).all() and np.abs(values).max(initial=0) > NUMBER_BOUND:
                raise ValueError(f"{name}={float(np.max(np.abs(values))):g} is past {NUMBER_BOUND:g}, where float32 "
                                 "arithmetic overflows into a black image: give a smaller number")
    for name in FUNCTIONS:
        if args.get(name) is not None and not callable(args[name]):
            raise TypeError(f"{name} must be a function or None, got {described(args[name])}")
    for name in FLAGS:
        if name in args and not isinstance(args[name], (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {described(args[name])}")
    for name in WHOLE_NUMBERS:
        value = args.get(name)
        if value is not None and (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral)):
            raise TypeError(f"{name} must be a whole number or None, got {described(value)}")
    for name, words in WORDS.items():
        if name in args and not isinstance(args[name], str):
            raise TypeError(f"{name} must be {words}, got {described(args[name])}")


def picture_arrays(name, value):
    """A conditioning's pictures (an array, or a list of them, one per net) as float32 arrays; a file name or
    other text in one line naming the argument (numpy's "could not convert string to float" named none)."""
    try:
        return jax.tree.map(float32_array, value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an array of pixels, or a list of them (one per net), got "
                        f"{described(value)}: make it with pipeline.prepare_image_inputs(pictures)") from None
