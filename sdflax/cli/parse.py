"""The argparse types of the command line's flags: each refuses a bad value in one line."""

from __future__ import annotations

import argparse

from ..utils import is_float32


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# One generate call makes every image in one program: a count past this would only run out of memory after the
# model loaded. `sdflax batch` makes any number, a batch at a time.
MAX_NUM_IMAGES = 1024


def num_images(text):
    value = positive_int(text)
    if value > MAX_NUM_IMAGES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_NUM_IMAGES}, got {value} (one call makes them all: "
                                         "`sdflax batch` makes any number, a batch at a time)")
    return value


def seed(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be between 0 and {2**32 - 1}, got {value}")
    return value


def number(check, problem):
    """An argparse type: a float for which `check` holds, else `problem` (formatted with the `text` given and its
    `value`)."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(problem.format(text=text, value=value))
        return value
    return parse


strength = number(lambda v: 0 < v <= 1, "must be in (0, 1], got {value}: 1 repaints everything, small values keep "
                  "the image")
# NaN or inf guidance, or 1e39 (inf in float32, the programs' type): a black image
finite = number(is_float32, "must be a finite number (as float32, the type the programs compute in), got "
                "{text!r}")

# sdflax.guiders.base.NUMBER_BOUND (the parser imports no JAX): past it a scale's products overflow float32
SCALE_BOUND = 1e8


def scale(text):
    """A guidance or conditioning scale: finite, and at most SCALE_BOUND (3e38 drew a black image)."""
    value = finite(text)
    if abs(value) > SCALE_BOUND:
        raise argparse.ArgumentTypeError(f"must be at most {SCALE_BOUND:g} in magnitude (past it float32 arithmetic "
                                         f"overflows into a black image), got {text!r}")
    return value


def is_number(text) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def scheduler_argument(text):
    """sdflax's scheduler names, diffusers' class names and A1111's sampler names ("DPM++ 2M Karras")."""
    from ..schedulers import scheduler_from_config

    try:
        scheduler_from_config({}, text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def prompt_text(text):
    """A prompt: text. Bytes of the command line that are not UTF-8 reach Python as lone surrogates, which no
    tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        raise argparse.ArgumentTypeError(f"{shown!r:.80} is not UTF-8 text (\ufffd marks the bytes that are not): "
                                         "give the prompt in UTF-8") from None
    return text
