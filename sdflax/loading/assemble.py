"""The one path from configs and checkpoint tensors to models and params, whatever the source.

A diffusers folder (`loading.py`), a single-file checkpoint and a ControlNet file (`single_file.py`) each end as
config dicts and diffusers-named tensors per model; `assemble` builds the models from the configs with one kernel
choice, takes their param shapes from sdflax's cache (`cache.py`) and fills them with the tensors (`weights.py`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp

from ..cache import param_shapes
from ..models.layers import resolve_kernels
from .weights import convert_state_dict


def build_models(classes: dict, configs: dict, dtype, attention="auto", kernels=None) -> dict:
    """{name: module} from config dicts, all with one kernel choice (`kernels`, else made here for the default
    device and `attention`)."""
    kernels = kernels or resolve_kernels(attention)
    return {name: cls.from_config(configs[name], dtype, attention, kernels) for name, cls in classes.items()}


def check_dtype(dtype):
    """Weights and activations in a floating dtype: int32 rounded the weights to whole numbers (a T2I-Adapter's
    features near zero gave the image without the adapter)."""
    try:
        floating = jnp.issubdtype(dtype, jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise TypeError(f"dtype must be a floating dtype (jnp.float32, jnp.bfloat16 or jnp.float16), got {dtype!r}")


def assemble(classes: dict, configs: dict, tensors, dtype, attention="auto", kernels=None, tokenizers=None):
    """(modules, params, tokenizers): {name: module} built from `configs`, {name: params} and {name: tokenizer}.

    `tensors(name, modules)` gives one model's `(where, {diffusers name: array})`, read when that model's turn
    comes (the UNet first); `where` names the source in errors. `tokenizers` maps names to functions that build
    them.
    """
    check_dtype(dtype)
    modules = build_models(classes, configs, dtype, attention, kernels)
    # Tracing the models for their parameter shapes and building the tokenizers hold the GIL; copying tensors
    # into device buffers does not. So a side thread does the first while this one copies, biggest model first.
    order = sorted(modules, key=lambda name: name != "unet")
    with ThreadPoolExecutor(1) as side:
        shapes = {name: side.submit(param_shapes, modules[name]) for name in order}
        pending = {name: side.submit(build) for name, build in (tokenizers or {}).items()}
        params = {}
        for name in order:
            where, state_dict = tensors(name, modules)
            params[name] = convert_state_dict(state_dict, shapes[name].result(), dtype, where)
            del state_dict  # a model's tensors are dropped before the next model's are read
        built = {name: future.result() for name, future in pending.items()}
    return modules, {name: params[name] for name in classes}, built
