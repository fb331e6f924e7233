"""Textual inversion (Gal et al. 2022): new tokens whose input embeddings were learned, added to the text encoder.

Files in circulation:

    A1111 .pt            {"string_to_param": {"*": (n, D)}, "name": ..., "step": ...}  (torch pickle)
    A1111 .safetensors   {"emb_params": (n, D)}
    diffusers            learned_embeds.safetensors / .bin: {token: (D,) or (n, D)}
    SDXL                 .safetensors: {"clip_l": (n, 768), "clip_g": (n, 1280)}, one tensor per text encoder

An embedding of n vectors becomes the tokens `token`, `token_1`, ..., `token_{n-1}` (diffusers' convention);
`expand_prompts` rewrites "token" in a prompt to all of them, as diffusers' `maybe_convert_prompt` does.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from .files import read_safetensors, read_torch_object
from .weights import non_finite

__all__ = ["expand_prompts", "load_textual_inversion", "read_embedding", "read_sdxl_embedding"]

# SDXL file key -> the (tokenizer, text encoder) it extends
SDXL_KEYS = {"clip_l": ("tokenizer", "text_encoder"), "clip_g": ("tokenizer_2", "text_encoder_2")}


def _read_content(name):
    return dict(read_safetensors(name)) if Path(name).suffix.lower() == ".safetensors" else read_torch_object(name)


def read_embedding(path, token=None) -> tuple[str, np.ndarray]:
    """(token, vectors (n, D)) from a textual-inversion file; `token` overrides the name the file gives.

    Without `token`: a diffusers file's own key; A1111 files use the file name, as A1111 does.
    """
    name = os.fspath(path)
    content = _read_content(name)
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
        sdxl = isinstance(content, dict) and set(SDXL_KEYS) & set(content)
        hint = " (an SDXL embedding: load it with StableDiffusionXL)" if sdxl else ""
        raise ValueError(f"{name} is not a textual-inversion embedding{hint}: found {keys}; expected "
                         "string_to_param (A1111 .pt), emb_params (A1111 .safetensors) or one {token: tensor} entry")
    return str(token or found_token), _vectors(name, vectors)


def _vectors(name, vectors, what="the embedding"):
    if not isinstance(vectors, np.ndarray) or vectors.ndim not in (1, 2):
        raise ValueError(f"{name}: {what} should be a (D,) or (n, D) tensor, "
                         f"got {getattr(vectors, 'shape', vectors)!r}")
    if non_finite(vectors):
        raise ValueError(f"{name}: {what} holds NaN or inf (a diverged training run?), which would draw black "
                         "images: use another copy or another step's embedding")
    return np.asarray(vectors, np.float32).reshape(-1, vectors.shape[-1])


def read_sdxl_embedding(path, token=None) -> tuple[str, dict[str, np.ndarray]]:
    """(token, {"clip_l": (n, D1), "clip_g": (n, D2)}) from an SDXL embedding; the token defaults to the file
    name, as A1111 does."""
    name = os.fspath(path)
    content = _read_content(name)
    found = sorted(content) if isinstance(content, dict) else type(content).__name__
    if not isinstance(content, dict) or not set(SDXL_KEYS) & set(content):
        raise ValueError(f"{name} is not an SDXL textual-inversion embedding: found {found}; expected clip_l and "
                         "clip_g tensors (an SD 1.x / 2.x embedding: load it with StableDiffusion)")
    missing = [key for key in SDXL_KEYS if key not in content]
    if missing:
        raise ValueError(f"{name} has no {missing[0]} tensor (found {found}): an SDXL embedding needs clip_l and "
                         "clip_g, one for each text encoder")
    parts = {key: _vectors(name, content[key], key) for key in SDXL_KEYS}
    if len(parts["clip_l"]) != len(parts["clip_g"]):
        raise ValueError(f"{name}: clip_l has {len(parts['clip_l'])} vectors but clip_g {len(parts['clip_g'])}; "
                         "both text encoders need the same number")
    return str(token or Path(name).stem), parts


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


def load_textual_inversion(parts, params, path, token=None) -> tuple[dict, dict]:
    """(new parts, new params) with a file's token(s) added to the tokenizer(s) and its vectors as new rows of the
    text encoders' embedding tables; nothing given is changed.

    `parts` maps a pipeline's part names to its objects (its constructor arguments, or `vars(pipeline)`): the
    tokenizer and text encoder ("tokenizer", "text_encoder"; SDXL's "tokenizer_2", "text_encoder_2"), others
    ignored. The new parts are copies of the tokenizers that gain the tokens and clones of the text encoders with
    the larger vocab size. With a second text encoder the file is an SDXL one (`clip_l` for the first encoder,
    `clip_g` for the second), else one tensor.
    """
    present = {name for name, part in parts.items() if part is not None}
    if "text_encoder_2" in present:
        token, vectors = read_sdxl_embedding(path, token)
        targets = [(*SDXL_KEYS[key], key, vectors[key]) for key in SDXL_KEYS if SDXL_KEYS[key][1] in present]
    else:
        token, vectors = read_embedding(path, token)
        targets = [("tokenizer", "text_encoder", "the embedding", vectors)]
    tokens = [token] + [f"{token}_{i}" for i in range(1, len(targets[0][3]))]
    for tokenizer, encoder, what, vectors in targets:  # every check before anything is made
        width = params[encoder]["embeddings_token_embedding"]["embedding"].shape[1]
        if vectors.shape[1] != width:
            models = "SDXL's are 768 and 1280" if len(targets) == 2 else "SD 1.x is 768, SD 2.x 1024"
            raise ValueError(f"{path}: {what} has vectors of {vectors.shape[1]} dimensions but {encoder}'s have "
                             f"{width} (an embedding for another model: {models})")
        taken = [t for t in tokens if t in parts[tokenizer].get_vocab()]
        if taken:
            raise ValueError(f"token(s) {taken} already in the tokenizer: choose another name with token=...")
    copies = {}  # one copy per tokenizer object: a pipeline may give both encoders the same tokenizer
    new_parts, params = {}, dict(params)
    for tokenizer, encoder, _, vectors in targets:
        original = parts[tokenizer]
        if id(original) not in copies:
            copies[id(original)] = copy.deepcopy(original)
            copies[id(original)].add_tokens(tokens)
        new_parts[tokenizer] = copies[id(original)]
        ids = np.asarray(new_parts[tokenizer].convert_tokens_to_ids(tokens))
        new_parts[encoder], params[encoder] = add_rows(parts[encoder], params[encoder], ids, vectors)
    return new_parts, params


def add_rows(module, params, ids, vectors):
    """(module, params) of a text encoder with `vectors` as the embedding table's rows `ids`."""
    table = params["embeddings_token_embedding"]["embedding"]
    rows, width = table.shape
    # New ids follow the tokenizer's vocabulary, normally the table's last row: grow the table to cover them.
    size = max(rows, int(ids.max()) + 1)
    new_table = jnp.zeros((size, width), table.dtype).at[:rows].set(table).at[ids].set(vectors.astype(table.dtype))
    embedding = {**params["embeddings_token_embedding"], "embedding": new_table}
    module = module.clone(config=dataclasses.replace(module.config, vocab_size=size))
    return module, {**params, "embeddings_token_embedding": embedding}
