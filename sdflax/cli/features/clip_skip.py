"""--clip-skip N, as A1111's "Clip skip": the text states of the Nth layer from the end (2: the penultimate), which
is diffusers' `clip_skip=N - 1` (SD 1.x / 2.x through the final layer norm; SDXL both encoders, N - 1 layers
before their penultimate)."""

from __future__ import annotations

from ..parse import positive_int

FLAG = "--clip-skip"
DENOISERS = ("unet",)


def add_flags(add, command):
    add("--clip-skip", type=positive_int, metavar="N", help="A1111's Clip skip: the text encoder's Nth layer from the "
        "end (1: the last, 2: the penultimate; diffusers' clip_skip=N-1) (default: 1, the checkpoint's own)")


def used(request) -> bool:
    return request.clip_skip is not None


def call_arguments(pipeline, value, rows) -> tuple[list, dict]:
    skipped = rows[0].clip_skip - 1
    return [], {"clip_skip": skipped or None}  # 1: no layer skipped, diffusers' default


def settings(request, checkpoint) -> dict:
    return {"clip_skip": request.clip_skip} if request.clip_skip is not None else {}


def parameters(s) -> str:
    """As A1111 writes it (it leaves out Clip skip 1)."""
    return f", Clip skip: {s['clip_skip']}" if s.get("clip_skip", 1) != 1 else ""
