"""--embedding PATH: textual-inversion embeddings (A1111 .pt/.safetensors, diffusers learned_embeds), each token
the file name without its extension, as in A1111."""

from __future__ import annotations

import os

from ..request import UserError, flag_error

FLAG = "--embedding"
DENOISERS = ("unet",)


def add_flags(add, command):
    add("--embedding", action="append", default=[], metavar="PATH",
        help="a textual-inversion embedding (A1111 .pt/.safetensors, diffusers learned_embeds); its token is the "
             "file name without the extension, as in A1111: write it in the prompt; repeat for several")


def used(request) -> bool:
    return bool(request.embedding)


def check_flags(request, batch):
    """Each file is there, and no two claim one token (their file names)."""
    tokens = {}
    for path in request.embedding:
        if not os.path.isfile(os.path.expanduser(path)):
            raise UserError(f"--embedding {path}: no such file: give the path of a textual-inversion .pt or "
                            ".safetensors file")
        token = os.path.splitext(os.path.basename(path))[0]
        if token in tokens:
            raise UserError(f"--embedding {tokens[token]} and --embedding {path} both give the token {token!r} (the "
                            "file name): rename one of the files")
        tokens[token] = path


def load(request, pipeline, params, dtype):
    """A pipeline whose tokenizer knows each token, and params with its vectors."""
    for path in request.embedding:
        try:
            pipeline, params = pipeline.load_textual_inversion(params, os.path.expanduser(path))
        except (OSError, ValueError) as e:
            raise flag_error("--embedding", path, e) from e
    return pipeline, params


def settings(request, checkpoint) -> dict:
    return {"embedding": list(request.embedding)} if request.embedding else {}
