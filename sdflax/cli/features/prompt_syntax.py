"""A1111's prompt syntax, on by default for SD 1.x / 2.x and SDXL: `(word)`, `(word:1.3)`, `[word]`, `\\(`, BREAK
and prompts past 77 tokens in chunks (`pipeline.prepare_inputs(..., weighting="a1111")`); --plain-prompt reads
the prompts as diffusers does (every character a word, cut at 77 tokens). The PNG keeps the prompt as typed, so
A1111 reads the same picture."""

from __future__ import annotations

import inspect

FLAG = "--plain-prompt"
DENOISERS = ("unet",)  # SD 3.x's and Flux.1's prompts are read as diffusers reads them


def add_flags(add, command):
    add("--plain-prompt", action="store_true", help="read the prompts as diffusers does, cut at 77 tokens (default "
        "for SD 1.x, 2.x and SDXL: A1111's syntax, (word:1.3), [word], \\( for a bracket, BREAK, and prompts past 77 "
        "tokens in chunks of 75)")


def used(request) -> bool:
    return request.plain_prompt


def prepared(pipeline, request, prompts, arguments) -> tuple:
    """(ids, A1111's weights or None) of `prompts`: A1111's syntax where the pipeline takes it and the request
    does not turn it off. Prompts A1111 reads as diffusers does (no brackets, no BREAK, one chunk) keep the plain
    ids and no weights: the same numbers, and the program of the library's plain call."""
    plain = pipeline.prepare_inputs(prompts, **arguments)
    if "weighting" not in inspect.signature(pipeline.prepare_inputs).parameters or request.plain_prompt:
        return plain, None
    ids, weights = pipeline.prepare_inputs(prompts, **arguments, weighting="a1111")
    if ids.shape == plain.shape and (ids == plain).all() and (weights == 1).all():
        return plain, None
    return ids, weights


def settings(request, checkpoint) -> dict:
    return {"plain_prompt": True} if request.plain_prompt else {}


def parameters(s) -> str:
    """As A1111 writes its emphasis turned off, for prompts with brackets."""
    return ", Emphasis: None" if "plain_prompt" in s and any(c in s["prompt"] for c in "([") else ""
