"""--guider and --guider-arg: a guider (sdflax.guiders) in place of plain classifier-free guidance, its guidance
scale --guidance's (Flux.1's --true-cfg's: the family's command-line side says, `cfg_scale`), its every argument
written into the PNG."""

from __future__ import annotations

import argparse
import dataclasses

from ...utils import is_float32
from ..parse import is_number
from ..request import UserError

FLAG = "--guider"


def add_flags(add, command):
    add("--guider", type=guider_name, metavar="NAME",
        help="a guider in place of plain classifier-free guidance: cfg, apg, apg_mix, cfg_zero_star, tcfg, mag, fdg, "
             "pag, seg, slg, autoguidance (or diffusers' class names); its guidance scale is --guidance's (Flux.1: "
             "the classifier-free one's)")
    add("--guider-arg", action="append", default=[], type=guider_argument, metavar="KEY=VALUE",
        help="an argument of --guider by diffusers' name or its last words (momentum=-0.5 for "
             "adaptive_projected_guidance_momentum, start=0.2, eta=0; the layers pag, seg, slg and autoguidance "
             "perturb as config=FQN:INDICES, e.g. config=mid_block.attentions.0.transformer_blocks:0); repeat for "
             "several")


def guider_name(text):
    """A guider's short name ("apg") or diffusers' class name."""
    from ...guiders.names import guider_class

    try:
        guider_class(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def guider_argument(text):
    """KEY=VALUE -> (KEY, VALUE): a number, true/false, none, numbers separated by commas (a tuple), or words
    (a layer config, "FQN:INDICES", which the guider reads)."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. momentum=-0.5), got {text!r:.60}")
    words = {"true": True, "false": False, "none": None}
    if value.strip().lower() in words:
        return key.strip(), words[value.strip().lower()]
    parts = value.split(",")
    if not all(is_number(part) for part in parts):
        return key.strip(), value.strip()
    numbers = tuple(int(p) if p.strip().lstrip("+-").isdigit() else float(p) for p in parts)
    if not all(is_float32(n) for n in numbers):
        raise argparse.ArgumentTypeError(f"{key.strip()}={value!r:.60}: must be finite as float32, the type the "
                                         "programs compute in")
    return key.strip(), numbers[0] if len(numbers) == 1 else numbers


def used(request) -> bool:
    return request.guider is not None


def check_flags(request, batch):
    if request.guider is None and request.guider_arg:
        raise UserError("--guider-arg applies with --guider: add --guider NAME, or drop it")


def resolve(request, configs, pictures):
    """--guider with its --guider-arg values, its guidance scale the classifier-free guidance's (--guidance, Flux.1's
    --true-cfg; or the pipeline's default), for the checkpoint's scheduler and denoiser."""
    from ...guiders import guider_from_name
    from ...guiders.names import guider_class

    cls = guider_class(request.guider)
    configs.side.check_guider(request, cls)  # a method the family's denoiser does not take, before its arguments
    arguments = dict(request.guider_arg)
    layers = [field.name for field in dataclasses.fields(cls) if field.name.endswith("_config")]
    if layers and not any(key in (layers[0], "config") or layers[0].endswith(f"_{key}") for key in arguments):
        raise UserError(f"--guider {request.guider} perturbs the layers you name: add --guider-arg "
                        f"config=FQN:INDICES, the list of modules and the indices of those perturbed, e.g. "
                        f"config={configs.side.LAYER_EXAMPLE}")
    flag, given, scale = configs.side.cfg_scale(request, configs)
    if "guidance_scale" in arguments:
        raise UserError(f"--guider-arg guidance_scale=...: give the scale as {flag}")
    if any(f.name == "guidance_scale" for f in dataclasses.fields(cls)):
        arguments["guidance_scale"] = scale
    elif given is not None:  # FDG: a scale per frequency level
        raise UserError(f"--guider {request.guider} has a guidance scale per frequency level: give them as "
                        f"--guider-arg guidance_scales=10,5 instead of {flag}")
    try:
        guider = guider_from_name(request.guider, **arguments)
    except ValueError as e:
        raise UserError(f"--guider {request.guider}: {e}") from None
    if getattr(configs.scheduler, "takes_unconditional", False):
        raise UserError(f"--guider {request.guider} with --scheduler {request.scheduler!r}: a CFG++ scheduler "
                        "re-noises with classifier-free guidance's unconditional prediction, which the guider "
                        "replaces: use another scheduler with it")
    return guider


def configure(pipeline, guider):
    return pipeline.with_guider(guider)


def settings(request, checkpoint) -> dict:
    """Its every argument, the defaults written out (JSON in the PNG)."""
    from ...guiders.base import arguments

    guider = checkpoint.features.get("guider")
    if guider is None:
        return {}
    return {"guider": type(guider).__name__,
            "guider_args": {name: plain(getattr(guider, name)) for name in arguments(guider)
                            if name != "guidance_scale"}}


def plain(value):
    """A guider's argument as JSON holds it: layer configs as dicts, tuples as lists."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
