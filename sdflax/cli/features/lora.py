"""--lora PATH[:SCALE]: LoRA files (kohya/A1111 or diffusers/PEFT; Flux.1's XLabs and Black Forest Labs' too, SD 3.x's
kohya / ComfyUI names) merged into the model in order; the PNG writes them into A1111's prompt as <lora:NAME:WEIGHT>."""

from __future__ import annotations

import argparse
import os

from ...utils import is_float32
from ..parse import is_number
from ..request import UserError, flag_error

FLAG = "--lora"
DENOISERS = ("unet",)
FAMILIES = ("flux", "sd3")  # the transformers' LoRAs too (sdflax.loading.flux_lora, sd3_lora)


def add_flags(add, command):
    add("--lora", action="append", default=[], type=lora_argument, metavar="PATH[:SCALE]",
        help="a LoRA file (kohya/A1111 or diffusers/PEFT) merged into the model at SCALE (default: 1.0); repeat for "
             "several, merged in order. A file whose name ends in :NUMBER needs its :SCALE written out")


def lora_argument(text):
    """PATH[:SCALE] -> (PATH, SCALE): the scale is read only where the part after the last ':' is a number, so
    C:\\loras\\x.safetensors and names with colons are paths."""
    path, colon, tail = text.rpartition(":")
    scale = float(tail) if colon and path and is_number(tail) else None
    if scale is None:
        return text, 1.0
    if not is_float32(scale):
        raise argparse.ArgumentTypeError(f"{text}: the scale must be a finite float32 number (1 is the LoRA's full "
                                         "strength, 0 leaves the model as it is)")
    return path, scale


def used(request) -> bool:
    return bool(request.lora)


def check_flags(request, batch):
    """Each file is there; whether it fits the model is known once the model is loaded."""
    for path, _ in request.lora:
        if not os.path.isfile(os.path.expanduser(path)):
            head, _, tail = path.rpartition(":")
            if head and os.path.isfile(os.path.expanduser(head)) and not is_number(tail):
                raise UserError(f"--lora {path}: the scale {tail!r} is not a number: write PATH:SCALE with a number, "
                                f"e.g. {head}:0.7")
            raise UserError(f"--lora {path}: no such file: give the path of a LoRA .safetensors file, with :SCALE "
                            "after it if wanted")


def load(request, pipeline, params, dtype):
    """params with each --lora merged, in order."""
    for path, scale in request.lora:
        try:
            params = pipeline.load_lora(params, os.path.expanduser(path), scale)
        except (OSError, ValueError) as e:  # LoraMismatchError: a LoRA for another model
            raise flag_error("--lora", path, e) from e
    return pipeline, params


def settings(request, checkpoint) -> dict:
    """Lists in the order of merging (JSON in the PNG)."""
    if not request.lora:
        return {}
    return {"lora": [path for path, _ in request.lora], "lora_scale": [scale for _, scale in request.lora]}


def prompt_parameters(s) -> str:
    """A1111 writes a LoRA into the prompt as <lora:NAME:WEIGHT>, NAME the file name without its extension."""
    return "".join(f" <lora:{os.path.splitext(os.path.basename(path))[0]}:{scale}>"
                   for path, scale in zip(s.get("lora", ()), s.get("lora_scale", ())))
