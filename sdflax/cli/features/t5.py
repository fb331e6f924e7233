"""--max-sequence-length: T5's tokens, for the families that read the prompt with T5 (SD 3.x, Flux.1: each lists the
flag in `Family.flags`, so that the others refuse it); the library's `prepare_inputs(..., max_sequence_length=N)`."""

from __future__ import annotations

import argparse

from ..parse import positive_int

FLAG = "--max-sequence-length"


def add_flags(add, command):
    add("--max-sequence-length", type=sequence_length, metavar="N", help="SD 3.x and Flux.1: T5's tokens, at most "
        "512 (default: the pipeline's, as diffusers: 256 for SD 3.x, 512 for Flux.1)")


def sequence_length(text):
    from ...pipeline.sd3_text import MAX_SEQUENCE_LENGTH

    value = positive_int(text)
    if value > MAX_SEQUENCE_LENGTH:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SEQUENCE_LENGTH} (T5's longest), got {value}")
    return value


def used(request) -> bool:
    return request.max_sequence_length is not None


def prompt_arguments(rows, negative) -> dict:
    return {"max_sequence_length": rows[0].max_sequence_length}


def settings(request, checkpoint) -> dict:
    return {"max_sequence_length": request.max_sequence_length} if request.max_sequence_length is not None else {}
