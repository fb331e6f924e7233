"""Flux.1's own flag: --true-cfg, classifier-free guidance on top of the guidance dev was distilled to take
(--guidance, the call's `guidance_scale`), run against a negative prompt as diffusers' `true_cfg_scale`; with
--guider, the guider's scale. Other families refuse it (`Family.flags`). Its PNG text, for every Flux.1 image:
`true_cfg_scale`, and A1111's CFG scale is that one, the distilled guidance Forge's "Distilled CFG Scale"."""

from __future__ import annotations

from ..parse import scale
from ..request import UserError

FLAG = "--true-cfg"
NEEDS_NEGATIVE = ("--true-cfg runs classifier-free guidance against a negative prompt, as diffusers' true_cfg_scale "
                  "(without one it does nothing)")


def add_flags(add, command):
    add("--true-cfg", type=scale, metavar="SCALE", help="Flux.1: the scale of classifier-free guidance against "
        "--negative-prompt, on top of --guidance, the guidance dev was distilled to take (diffusers' true_cfg_scale: "
        "twice the transformer's work); with --guider, its scale (default: 1, none)")


def used(request) -> bool:
    return request.true_cfg is not None


def check_flags(request, batch):
    """A negative prompt to guide against, or a guider (whose unconditional prediction is the empty prompt's); in
    `sdflax batch` each line may give its own (`check_lines`)."""
    if request.true_cfg is not None and not batch and request.guider is None and not (
            request.negative_prompt or request.negative_prompt_2):
        raise UserError(f"{NEEDS_NEGATIVE}: add --negative-prompt TEXT, or drop --true-cfg")


def check_lines(request, lines, prompts):
    """`sdflax batch`: each line has a negative prompt, its own or --negative-prompt."""
    if request.guider is not None or request.negative_prompt_2:
        return
    line = next((line for line in lines if not line.negative_prompt), None)
    if line is not None:
        raise UserError(f"PROMPTS {prompts} line {line.number}: {NEEDS_NEGATIVE}: give the line a negative_prompt, "
                        "or --negative-prompt TEXT for every line, or drop --true-cfg")


def call_arguments(pipeline, value, rows) -> tuple[list, dict]:
    """The call's true_cfg_scale (a guider takes the scale itself: `cfg_scale` of Flux.1's command-line side)."""
    request = rows[0]
    return [], ({} if request.guider is not None else {"true_cfg_scale": request.true_cfg})


def settings(request, checkpoint) -> dict:
    """For a pipeline that takes a true CFG scale (Flux.1's), its scale, given or the pipeline's default; and where
    the transformer takes no distilled guidance (schnell), that it is off."""
    defaults = checkpoint.pipeline.defaults
    if "true_cfg_scale" not in defaults:
        return {}
    values = {"true_cfg_scale": request.true_cfg if request.true_cfg is not None else defaults["true_cfg_scale"]}
    if not getattr(checkpoint.denoiser, "guidance_embeds", True):
        values["distilled_guidance"] = "off"
    return values


def scale_parameters(s) -> str | None:
    """A1111's CFG scale, the true CFG's, and Forge's Distilled CFG Scale where the transformer takes one, as Forge
    writes a Flux image's."""
    if "true_cfg_scale" not in s:
        return None
    text = f"CFG scale: {s['true_cfg_scale']}"
    return text if s.get("distilled_guidance") == "off" else f"{text}, Distilled CFG Scale: {s['guidance_scale']}"
