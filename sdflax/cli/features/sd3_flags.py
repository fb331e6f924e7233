"""SD 3.x's own flags: --prompt-3 and --negative-prompt-3 (T5's prompts), --no-t5, and skip-layer guidance
(--slg-layers, --slg-scale, diffusers' skip_guidance_layers). Other families refuse them (`Family.flags`); T5's
--max-sequence-length, which Flux.1 takes too, is `t5.py`."""

from __future__ import annotations

import argparse

from ..parse import prompt_text, scale
from ..manifest import quoted
from ..request import UserError

DEFAULT_SLG_SCALE = 2.8  # diffusers' skip_layer_guidance_scale


def add_flags(add, command):
    text = dict(type=prompt_text, metavar="TEXT")
    add("--prompt-3", help="SD 3.x: the prompt of the third text encoder, T5 (default: the prompt)", **text)
    add("--negative-prompt-3", help="SD 3.x: the negative prompt of T5 (default: the negative prompt)", **text)
    add("--no-t5", action="store_true", help="SD 3.x: load without T5, the third text encoder (its states zeros, "
        "as diffusers' text_encoder_3=None): less memory, less faithful text")
    add("--slg-layers", type=layer_list, default=(), metavar="I,J,...", help="SD 3.x: skip-layer guidance, an "
        "extra pass without these transformer blocks steering away from it (SD 3.5 Medium: 7,8,9), as diffusers' "
        "skip_guidance_layers")
    add("--slg-scale", type=scale, metavar="S", help="with --slg-layers: its scale (default: 2.8, as diffusers)")


def layer_list(text):
    """"7,8,9" -> (7, 8, 9): transformer block indices."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected block indices separated by commas (SD 3.5 Medium: 7,8,9), got "
                                         f"{text!r:.60}")
    return tuple(int(part) for part in parts)


def used(request) -> bool:
    return any(value not in (None, False, ()) for value in (
        request.prompt_3, request.negative_prompt_3, request.no_t5, request.slg_layers, request.slg_scale))


def check_flags(request, batch):
    """T5's prompts need T5."""
    for flag, value in (("--prompt-3", request.prompt_3), ("--negative-prompt-3", request.negative_prompt_3)):
        if value is not None and request.no_t5:
            raise UserError(f"{flag} is T5's prompt, but --no-t5 loads no T5: drop one of them")


def check_configs(request, configs):
    """--slg-scale goes with --slg-layers, which run with the pipeline's own guidance and name blocks of the
    transformer."""
    if request.slg_scale is not None and not request.slg_layers:
        raise UserError("--slg-scale applies with --slg-layers: add --slg-layers I,J,... (SD 3.5 Medium: 7,8,9), or "
                        "drop it")
    if request.guider is not None and request.slg_layers:
        raise UserError("--slg-layers runs with the pipeline's classifier-free guidance, as diffusers' SD 3 pipeline: "
                        "drop --guider or --slg-layers")
    blocks = configs.denoiser.num_layers
    if any(i >= blocks for i in request.slg_layers):
        raise UserError(f"--slg-layers {','.join(map(str, request.slg_layers))}: {request.model}'s transformer has "
                        f"blocks 0 .. {blocks - 1}: give blocks among them (SD 3.5 Medium: 7,8,9)")


def prompt_arguments(rows, negative) -> dict:
    """T5's prompts (each row's prompt where it gives none)."""
    prefix = "negative_prompt" if negative else "prompt"
    given = [getattr(r, f"{prefix}_3") for r in rows]
    return {"prompts_3": [g or getattr(r, prefix) for g, r in zip(given, rows)]} if any(given) else {}


def components(request, dtype) -> tuple[dict, dict]:
    """--no-t5: the pipeline made without T5, as diffusers' text_encoder_3=None."""
    return ({"text_encoder_3": None} if request.no_t5 else {}), {}


def call_arguments(pipeline, value, rows) -> tuple[list, dict]:
    """The pipeline's skip-layer guidance keywords."""
    request = rows[0]
    if not request.slg_layers:
        return [], {}
    return [], {"skip_guidance_layers": tuple(request.slg_layers), "skip_layer_guidance_scale": slg_scale(request)}


def slg_scale(request) -> float:
    return request.slg_scale if request.slg_scale is not None else DEFAULT_SLG_SCALE


def settings(request, checkpoint) -> dict:
    """The flags given, and a T5 left out (--no-t5, or a checkpoint without)."""
    values = {key: value for key, value in (("prompt_3", request.prompt_3),
                                            ("negative_prompt_3", request.negative_prompt_3)) if value is not None}
    if checkpoint.without_t5:
        values["t5"] = "off"
    if request.slg_layers:
        values.update(slg_layers=list(request.slg_layers), slg_scale=slg_scale(request))
    return values


def parameters(s) -> str:
    """Entries of sdflax's own, as the adapters'."""
    text = ", T5: off" if s.get("t5") == "off" else ""
    if "slg_layers" in s:
        text += f", SLG layers: {quoted(','.join(map(str, s['slg_layers'])))}, SLG scale: {s['slg_scale']}"
    return text
