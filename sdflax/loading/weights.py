"""Checkpoint tensors -> the params pytree of an sdflax model.

Our module names follow the checkpoints, so a tensor finds its parameter by name alone: both sides are reduced
to the module path joined with "_" (`down_blocks.0.attentions.1.to_out.0.weight` and the parameter
`down_blocks_0_attentions_1 / to_out_0 / kernel` both become `down_blocks_0_attentions_1_to_out_0`), plus
a short rename table and the layout rules of PyTorch -> Flax:

    conv weight (O, I, kh, kw)  -> kernel (kh, kw, I, O)
    linear weight (O, I)        -> kernel (I, O)      (a 1x1 conv weight (O, I, 1, 1) too)
    norm weight                 -> scale
    embedding weight            -> embedding

Flax msgpack checkpoints already hold `kernel`/`scale`/`embedding` in Flax layout and only need the renames.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from .files import CheckpointFileError, read_checkpoint

# Names older checkpoints (SD 1.x VAEs, diffusers' Flax models) use for attention projections.
RENAMES = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out_0"}

# Prefixes that some writers add and others do not (transformers 5 saves CLIP without `text_model.`).
OPTIONAL_PREFIXES = ("text_model.", "vision_model.")

# Tensors that are buffers, not parameters.
IGNORED = re.compile(r"(^|\.)(position_ids|num_batches_tracked)$")

WEIGHT_LEAVES = ("kernel", "scale", "embedding")

# Tensors that transformers ties to another (`_tied_weights_keys`), stored by some writers instead of the other or
# beside it: {copy: original}. The copy fills in for a missing original and is ignored otherwise.
TIED = {"encoder.embed_tokens.weight": "shared.weight"}  # T5

# Copying tensors into device buffers in Flax layout is a strided transpose that releases the GIL: threads copy
# a float32 SD 1.5 UNet in 1.7 s instead of 2.8 s on 2 cores. Few, large batches keep them from waiting on the GIL
# after each tensor while another thread traces a model; at most 512 MB of cast copies are in flight at once.
COPY_THREADS = min(8, os.cpu_count() or 1)
COPY_BATCH_BYTES = (512 << 20) // COPY_THREADS


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not fit the model built from its config."""


class NonFiniteWeightsError(ValueError):
    """A checkpoint holds NaN or inf: the model would draw black or NaN images without a word."""


def non_finite(array: np.ndarray) -> bool:
    """Whether a float array holds NaN or inf, at about the speed of reading it: a float32 sum of finite weights is
    finite (one that overflows is checked element by element); float16 by its exponent bits, which numpy would
    otherwise convert one by one."""
    if array.dtype == np.float16 and array.flags.c_contiguous:
        exponent = np.uint16(0x7C00)
        return bool(np.any((array.view(np.uint16) & exponent) == exponent))
    if array.dtype.kind not in "fV" or array.dtype.kind == "V" and array.dtype.name != "bfloat16":
        return False  # integers (T5's ids, a tokenizer's tables) and booleans are always finite
    with np.errstate(all="ignore"):
        total = np.add.reduce(array, axis=None, dtype=np.float64 if array.dtype == np.float64 else np.float32)
    return not np.isfinite(total) and not bool(np.isfinite(array).all())


def _module_and_leaf(key: str) -> tuple[str, str]:
    for prefix in OPTIONAL_PREFIXES:
        key = key.removeprefix(prefix)
    parts = [RENAMES.get(p, p) for p in key.split(".")]
    return "_".join(parts[:-1]), parts[-1]


def _to_flax_layout(array: np.ndarray, source_leaf: str, target_leaf: str, target_ndim: int) -> np.ndarray:
    if source_leaf != "weight" or target_leaf != "kernel":
        return array  # biases, norm scales, embeddings, and Flax-layout tensors are used as they are
    if array.ndim == 4 and array.shape[2:] == (1, 1):  # a 1x1 conv: a matrix transpose, twice as fast to copy
        return array[:, :, 0, 0].T if target_ndim == 2 else array[:, :, 0, 0].T[None, None]
    return array.transpose(2, 3, 1, 0) if array.ndim == 4 else array.T


def short_list(names, limit=12) -> str:
    """The names sorted and comma-joined, the first `limit` of them, for an error message."""
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def convert_state_dict(state_dict: dict, shapes, dtype=jnp.float32, where="checkpoint"):
    """Map `{name: np.ndarray}` onto the parameter tree `shapes` (a pytree of ShapeDtypeStructs) in `dtype`.

    Each tensor is cast on its own, so a bfloat16 load never holds a float32 copy of the model.
    """
    targets = traverse_util.flatten_dict(shapes)
    by_name = {("_".join(path[:-1]), path[-1]): path for path in targets}
    params, sources, unexpected, mismatched = {}, {}, [], []
    if any(copy in state_dict for copy in TIED):
        state_dict = dict(state_dict)
        for copy, original in TIED.items():
            if copy in state_dict:
                state_dict.setdefault(original, state_dict.pop(copy))
    for key, array in state_dict.items():
        if IGNORED.search(key):
            continue
        module, leaf = _module_and_leaf(key)
        target_leaf = next((t for t in WEIGHT_LEAVES if (module, t) in by_name), leaf) if leaf == "weight" else leaf
        path = by_name.get((module, target_leaf))
        if path is None:
            unexpected.append(key)
            continue
        target = targets[path]
        value = _to_flax_layout(np.asarray(array), leaf, target_leaf, len(target.shape))
        if value.shape != tuple(target.shape):
            mismatched.append(f"{key}: checkpoint {tuple(np.shape(array))}, model expects {tuple(target.shape)}")
            continue
        params[path], sources[path] = value, (key, np.asarray(array))
    missing = ["/".join(path) for path in targets if path not in params]
    problems = []
    if mismatched:
        problems.append("shape mismatch: " + "; ".join(mismatched[:12]))
    if missing:
        problems.append(f"missing from the checkpoint: {short_list(missing)}")
    if unexpected:
        problems.append(f"not used by the model: {short_list(unexpected)}")
    if problems:
        raise CheckpointMismatchError(f"{where} does not match the model config: " + " | ".join(problems))
    return traverse_util.unflatten_dict(_to_device(params, np.dtype(dtype), sources, where))


def _to_device(arrays: dict, dtype: np.dtype, sources: dict, where: str) -> dict:
    """{key: numpy array or view} -> {key: jax.Array in `dtype`}, copied in batches by a few threads, each array
    checked for NaN and inf as it goes (`sources`: the checkpoint's name and tensor of each)."""
    batches, size = [[]], 0
    for key, array in arrays.items():
        if size > COPY_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(key)
        size += array.size * dtype.itemsize

    def copy(keys):  # cast one batch at a time: a bfloat16 load never holds a float32 copy of the model
        bad = [sources[key][0] for key in keys if non_finite(sources[key][1])]
        return bad, None if bad else jax.device_put([arrays[key].astype(dtype, copy=False) for key in keys])

    with ThreadPoolExecutor(COPY_THREADS) as pool:
        copies = list(pool.map(copy, batches))
    if bad := [name for found, _ in copies for name in found]:
        raise NonFiniteWeightsError(f"{where} holds NaN or inf in {short_list(bad, 6)}: a damaged or diverged "
                                    "checkpoint, which would draw black images; use another copy of the file")
    return {key: value for keys, (_, values) in zip(batches, copies) for key, value in zip(keys, values)}


def weight_files(folder, variant: str | None = None) -> list[str]:
    """The weight files of one model folder, in order of preference: safetensors, PyTorch .bin, Flax msgpack."""
    v = f".{variant}" if variant else ""
    for stem in ("diffusion_pytorch_model", "model"):
        for name in (f"{stem}{v}.safetensors", f"{stem}.safetensors.index{v}.json", f"{stem}{v}.safetensors.index.json"):
            if os.path.isfile(os.path.join(folder, name)):
                return _expand_index(folder, name)
    for stem in ("diffusion_pytorch_model", "pytorch_model"):
        for name in (f"{stem}{v}.bin", f"{stem}.bin.index{v}.json", f"{stem}{v}.bin.index.json"):
            if os.path.isfile(os.path.join(folder, name)):
                return _expand_index(folder, name)
    for name in ("diffusion_flax_model.msgpack", "flax_model.msgpack"):  # diffusers' and transformers' Flax
        if os.path.isfile(os.path.join(folder, name)):
            return [os.path.join(folder, name)]
    present = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    wanted = f"diffusion_pytorch_model{v}.safetensors, model{v}.safetensors, *.bin or a Flax *.msgpack"
    raise FileNotFoundError(f"no weights in {folder}: expected one of {wanted}; found {present or 'nothing'}")


def _expand_index(folder, name):
    path = os.path.join(folder, name)
    if not name.endswith(".json"):
        return [path]
    try:
        with open(path, "rb") as f:
            index = json.loads(f.read())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointFileError(f"shard index {path}: not valid JSON ({' '.join(str(e).split())[:200]})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointFileError(
            f"shard index {path}: expected a JSON object whose \"weight_map\" maps tensor names to shard files, "
            f"found {'no weight_map' if weight_map is None else f'weight_map {weight_map!r:.100}'}"
        )
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        # A shard is a file beside the index: a path elsewhere is a broken (or hostile) index.
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise CheckpointFileError(f"shard index {path}: shard {shard!r:.100} is not a file name in {folder}")
    return [os.path.join(folder, shard) for shard in shards]


def read_weights(folder, variant=None) -> dict:
    """{name: array} of a model folder's weight files (all shards), as they are stored."""
    state_dict = {}
    for path in weight_files(folder, variant):
        state_dict.update(read_checkpoint(path))
    return state_dict
