"""Textual inversion (Gal et al. 2022): new tokens whose input embeddings were learned, added to the text encoder.

Files in circulation:

    A1111 .pt            {"string_to_param": {"*": (n, D)}, "name": ..., "step": ...}  (torch pickle)
    A1111 .safetensors   {"emb_params": (n, D)}
    diffusers            learned_embeds.safetensors / .bin: {token: (D,) or (n, D)}

An embedding of n vectors becomes the tokens `token`, `token_1`, ..., `token_{n-1}` (diffusers' convention);
`expand_prompts` rewrites "token" in a prompt to all of them, as diffusers' `maybe_convert_prompt` does.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from .checkpoint_files import MAX_PICKLE_BYTES, TensorOnlyUnpickler, check_member, read_safetensors

__all__ = ["expand_prompts", "load_textual_inversion", "read_embedding"]


def _read_torch_object(path):
    """The whole pickled object of a torch zip file (nested dicts, strings), read by the tensor-only unpickler.

    `checkpoint_files.read_torch_bin` keeps only top-level tensors; A1111 nests its vectors in a dict.
    """
    name = os.fspath(path)
    if not zipfile.is_zipfile(name):
        raise ValueError(f"{name!r} is not a zip-format PyTorch file; the legacy (pre-1.6) torch format is not "
                         "supported: re-save it with a recent torch, or as .safetensors")
    with zipfile.ZipFile(name) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise ValueError(f"{name!r} is a zip file but not a PyTorch checkpoint (no <archive>/data.pkl)")
        prefix = pickles[0][: -len("data.pkl")]
        members = {info.filename: info for info in archive.infolist()}
        storages = {}

        def member_size(key):  # checked against the pickle's claim before anything is read
            info = members.get(f"{prefix}data/{key}")
            return None if info is None else info.file_size

        def read_storage(key, dtype):  # embeddings are small: plain reads, no memory map
            if key not in storages:
                info = members[f"{prefix}data/{key}"]
                check_member(name, info)  # no zip bombs
                storages[key] = np.frombuffer(archive.read(info), np.uint8)
            raw = storages[key]
            return raw[: raw.size - raw.size % dtype.itemsize].view(dtype)

        check_member(name, members[pickles[0]], limit=MAX_PICKLE_BYTES)
        with archive.open(pickles[0]) as f:
            return TensorOnlyUnpickler(f, checkpoint_name=name, read_storage=read_storage,
                                       member_size=member_size).load()


def read_embedding(path, token=None) -> tuple[str, np.ndarray]:
    """(token, vectors (n, D)) from a textual-inversion file; `token` overrides the name the file gives.

    Without `token`: a diffusers file's own key; A1111 files use the file name, as A1111 does.
    """
    name = os.fspath(path)
    if Path(name).suffix.lower() == ".safetensors":
        content = dict(read_safetensors(name))
    else:
        content = _read_torch_object(name)
    stem = Path(name).stem
    if isinstance(content, np.ndarray):  # torch.save(tensor)
        found_token, vectors = stem, content
    elif isinstance(content, dict) and isinstance(content.get("string_to_param"), dict):  # A1111 .pt
        params = content["string_to_param"]
        if "*" not in params:
            raise ValueError(f"{name}: string_to_param has keys {sorted(params)}, expected '*'")
        found_token, vectors = stem, params["*"]
    elif isinstance(content, dict) and "emb_params" in content:  # A1111 .safetensors
        found_token, vectors = stem, content["emb_params"]
    elif isinstance(content, dict) and len(content) == 1:  # diffusers {token: vectors}
        found_token, vectors = next(iter(content.items()))
    else:
        keys = sorted(content) if isinstance(content, dict) else type(content).__name__
        hint = " (an SDXL embedding: sdflax runs SD 1.x / 2.x)" if isinstance(content, dict) and "clip_g" in content else ""
        raise ValueError(f"{name} is not a textual-inversion embedding{hint}: found {keys}; expected "
                         "string_to_param (A1111 .pt), emb_params (A1111 .safetensors) or one {token: tensor} entry")
    if not isinstance(vectors, np.ndarray) or vectors.ndim not in (1, 2):
        raise ValueError(f"{name}: the embedding should be a (D,) or (n, D) tensor, got {getattr(vectors, 'shape', vectors)!r}")
    return str(token or found_token), np.asarray(vectors, np.float32).reshape(-1, vectors.shape[-1])


def _multi_vector_tokens(tokenizer) -> dict[str, list[str]]:
    added = tokenizer.added_tokens_encoder
    out = {}
    for token in added:
        if f"{token}_1" in added:
            names, i = [token], 1
            while f"{token}_{i}" in added:
                names.append(f"{token}_{i}")
                i += 1
            out[token] = names
    return out


def expand_prompts(prompts: list[str], tokenizer) -> list[str]:
    """Replace each multi-vector token in the prompts by all its tokens ("<t>" -> "<t> <t>_1 <t>_2")."""
    multi = _multi_vector_tokens(tokenizer)
    if not multi:
        return prompts
    expanded = []
    for prompt in prompts:
        for token in set(tokenizer.tokenize(prompt)):  # as diffusers: only tokens the tokenizer sees whole
            if token in multi:
                prompt = prompt.replace(token, " ".join(multi[token]))
        expanded.append(prompt)
    return expanded


def load_textual_inversion(pipeline, params, path, token=None):
    """Add a file's token(s) to `pipeline.tokenizer` and rows to the text encoder's embedding table.

    Returns new params; `pipeline.tokenizer` gains the tokens and `pipeline.text_encoder` the larger vocab size.
    """
    token, vectors = read_embedding(path, token)
    tokenizer = pipeline.tokenizer
    table = params["text_encoder"]["embeddings_token_embedding"]["embedding"]
    rows, width = table.shape
    if vectors.shape[1] != width:
        raise ValueError(f"{path}: embedding vectors have {vectors.shape[1]} dimensions but this text encoder's "
                         f"have {width} (an embedding for another model: SD 1.x is 768, SD 2.x 1024)")
    tokens = [token] + [f"{token}_{i}" for i in range(1, len(vectors))]
    vocab = tokenizer.get_vocab()
    taken = [t for t in tokens if t in vocab]
    if taken:
        raise ValueError(f"token(s) {taken} already in the tokenizer: choose another name with token=...")
    tokenizer.add_tokens(tokens)
    ids = np.asarray(tokenizer.convert_tokens_to_ids(tokens))

    # New ids follow the tokenizer's vocabulary, normally the table's last row: grow the table to cover them.
    size = max(rows, int(ids.max()) + 1)
    new_table = jnp.zeros((size, width), table.dtype).at[:rows].set(table).at[ids].set(vectors.astype(table.dtype))
    text_encoder = dict(params["text_encoder"])
    text_encoder["embeddings_token_embedding"] = {**text_encoder["embeddings_token_embedding"], "embedding": new_table}
    config = dataclasses.replace(pipeline.text_encoder.config, vocab_size=size)
    pipeline.text_encoder = pipeline.text_encoder.clone(config=config)
    return {**params, "text_encoder": text_encoder}
