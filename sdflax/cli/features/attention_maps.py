"""--attention-maps WORDS: for each word of the prompt, its cross-attention map over the first image (DAAM:
`sdflax.hooks.cross_attention_maps`, the heads', layers' and steps' mean summed over the word's tokens) laid over
the image as a heat map, a PNG beside it: IMAGE-attention-WORD.png."""

from __future__ import annotations

import os

import numpy as np

from ..request import UserError

FLAG = "--attention-maps"
DENOISERS = ("unet",)  # cross-attention layers: SD 1.x, 2.x and SDXL


def add_flags(add, command):
    if command == "batch":
        return
    add("--attention-maps", type=words, default=(), metavar="WORDS", help="comma-separated words of the prompt: for each, "
        "write its cross-attention map over the first image as a red heat map laid over it, "
        "IMAGE-attention-WORD.png")


def words(text) -> tuple[str, ...]:
    import argparse

    given = tuple(word.strip() for word in text.split(","))
    if not all(given):
        raise argparse.ArgumentTypeError(f"expected comma-separated words of the prompt, e.g. fox,forest, got "
                                         f"{text!r}")
    return given


def used(request) -> bool:
    return bool(request.attention_maps)


def check_flags(request, batch):
    """Each word is one of the prompt's (its tokens are found in the prompt's)."""
    prompt = request.prompt.lower()
    missing = [word for word in request.attention_maps if word.lower() not in prompt]
    if missing:
        raise UserError(f"--attention-maps {','.join(request.attention_maps)}: {', '.join(missing)} not in the "
                        "prompt: name words of the prompt")


def configure(pipeline, value):
    from ...hooks.attention_maps import cross_attention_maps

    return pipeline.with_hooks(cross_attention_maps())  # a guider stays


def write(request, made):
    """One overlay PNG per word, beside the first image."""
    from ...hooks.attention_maps import KEY, overlay, word_map
    from ..manifest import link_png

    maps = made.trajectory.hooks[KEY][:, :1]  # (evals, 1, h, w, 77): the first image's
    stem = os.path.splitext(made.paths[0])[0]
    for word in request.attention_maps:
        heat = word_map(maps, prompt_ids(made.pipeline, request.prompt), made.pipeline.tokenizer(word).input_ids[1:-1])
        path = f"{stem}-attention-{file_word(word)}.png"
        folder, name = os.path.split(os.path.abspath(path))
        try:
            link_png(folder, name, overlay(made.images[0], heat[0]), None, os.getpid())
        except FileExistsError:
            raise UserError(f"{path} exists: sdflax never overwrites a file; choose another --out") from None
        print(path)


def prompt_ids(pipeline, prompt) -> np.ndarray:
    """(1, 77): the first tokenizer's ids of the prompt (SDXL's second has the same words in the same places)."""
    ids = np.asarray(pipeline.prepare_inputs([prompt]))
    return ids[:, 0] if ids.ndim == 3 else ids


def file_word(word) -> str:
    return "".join(c if c.isalnum() else "-" for c in word.lower()).strip("-") or "word"
