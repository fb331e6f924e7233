"""`sdflax train METHOD --data DIR --out DIR`: the checks before anything is written (the settings, --out, the
model's configs, every picture and caption of the data), then the run (train_run.py). --out holds a run's
settings.toml, so the same command again continues it, and other settings are refused in one line."""

from __future__ import annotations

import dataclasses
import os
import sys

from .request import Request, UserError
from .train_options import METHODS, SETTINGS, first_difference, read_config, result_path, settings_of


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the checks found: the settings, the run on --out (None: a new one), the model's configs, the data."""

    settings: dict
    resumed: bool
    checkpoint: object  # preflight.Checkpoint of the model
    divisible: int  # the sides of a training picture are multiples of it
    pictures: list
    class_pictures: list
    result: str  # the result's path in --out
    processes: object  # --coordinator, --num-processes, --process-id (batch.join_processes reads them)


def run(args) -> int:
    plan = check(args)
    if os.path.lexists(plan.result):
        print(f"train: {plan.settings['out']} holds a finished run ({os.path.basename(plan.result)}); use another "
              "--out to train again", file=sys.stderr)
        return 0
    from .train_run import train

    return train(plan)


def check(args) -> Plan:
    """Every check that needs no JAX, in the order of their cost; nothing is written."""
    settings = settings_of(args)
    check_method(settings)
    from .train_log import check_report_to

    check_report_to(settings["report_to"])
    out = settings["out"]
    resumed = earlier_run(out, settings)
    checkpoint, divisible = check_model(settings)
    settings["resolution"] = checkpoint.height
    from ..train.data import DataError, read_folder

    default_caption = settings["instance_prompt"]
    try:
        pictures = read_folder(settings["data"], settings["caption_column"], default_caption)
        class_pictures = []
        if settings["class_prompt"] and os.path.isdir(os.path.expanduser(settings["class_data_dir"])):
            class_pictures = read_folder(settings["class_data_dir"], settings["caption_column"],
                                         settings["class_prompt"], label="--class-data-dir", empty_ok=True)
    except DataError as e:
        raise UserError(str(e)) from None
    token = settings["placeholder_token"]
    if token:
        missing = [p for p in pictures if token not in p.caption.split()]
        if missing:
            raise UserError(f"{missing[0].path}: its caption {missing[0].caption[:60]!r} does not hold the new token "
                            f"{token}: write it in every caption (or give --instance-prompt 'a photo of {token}' to "
                            "pictures without one)")
    return Plan(settings, resumed, checkpoint, divisible, pictures, class_pictures, result_path(settings), args)


def check_method(settings):
    method = settings["method"]
    if method not in METHODS:
        raise UserError(f"METHOD {method!r}: choose one of {', '.join(METHODS)}")
    textual = method == "textual-inversion"
    if textual and not (settings["placeholder_token"] and settings["initializer_token"]):
        raise UserError("textual-inversion needs --placeholder-token (the new token, e.g. '<cat-toy>') and "
                        "--initializer-token (a word it starts from, e.g. 'toy')")
    if not textual and (settings["placeholder_token"] or settings["initializer_token"]):
        raise UserError(f"--placeholder-token and --initializer-token are for textual-inversion, not {method}")
    if method == "dreambooth" and not settings["instance_prompt"]:
        raise UserError("dreambooth needs --instance-prompt, e.g. 'a photo of sks dog' (the caption of every "
                        "picture without its own)")
    if (settings["class_prompt"] or settings["class_data_dir"]) and method != "dreambooth":
        raise UserError(f"--class-prompt and --class-data-dir are for dreambooth, not {method}")
    if bool(settings["class_prompt"]) != bool(settings["class_data_dir"]):
        raise UserError("give --class-prompt and --class-data-dir together (prior preservation), or neither")
    if settings["cache_text_encoder_outputs"] and (textual or settings["train_text_encoder"]):
        raise UserError("--cache-text-encoder-outputs is for frozen text encoders: drop it, or "
                        + ("--train-text-encoder" if settings["train_text_encoder"] else "train another method"))
    if settings["output_format"] == "kohya" and method == "full":
        raise UserError("--output-format kohya is for LoRAs and embeddings; full writes a diffusers folder")
    if settings["train_text_encoder"] and textual:
        raise UserError("textual-inversion trains the new token's embedding only: drop --train-text-encoder")


def earlier_run(out, settings) -> bool:
    """Whether --out holds a run of these settings (to continue); another run's, or other files, are refused."""
    if not os.path.lexists(out):
        return False
    if not os.path.isdir(out):
        raise UserError(f"--out {out} is a file: give a folder (new, or a run's to continue it)")
    saved_path = os.path.join(out, SETTINGS)
    if not os.path.lexists(saved_path):
        # the other processes' locks: process 0 writes settings.toml once it holds its own
        if [name for name in os.listdir(out) if not (name.startswith(".sdflax-train.") and name.endswith(".lock"))]:
            raise UserError(f"--out {out} holds files but no run of sdflax train ({SETTINGS}): sdflax never "
                            "overwrites a file; choose a new or empty folder")
        return False
    if os.path.islink(saved_path) or not os.path.isfile(saved_path):
        raise UserError(f"--out {out}: {saved_path} is not a file sdflax wrote: choose another --out")
    try:
        saved = read_config(saved_path)
    except UserError as e:
        raise UserError(f"--out {out}: {SETTINGS} is not one sdflax train wrote ({e}): choose another --out") from None
    if settings["seed"] is None:  # the seed the run drew
        settings["seed"] = saved.get("seed")
    if settings["resolution"] is None:
        settings["resolution"] = saved.get("resolution")
    differs = "method" if saved.get("method") != settings["method"] else first_difference(saved, settings)
    if differs:
        def shown(value):
            return ",".join(map(str, value)) if isinstance(value, list) else value

        raise UserError(f"--out {out} holds a run with {differs.replace('_', '-')} {shown(saved.get(differs))}, "
                        f"not {shown(settings[differs])}: give the same settings to continue it, or another --out")
    return True


def check_model(settings):
    """(preflight.Checkpoint, the multiple a training picture's sides are): the model's configs, read before it
    loads; the resolution checked as generate checks a size."""
    from .preflight import check_checkpoint, read_configs

    request = Request(command="generate", prompt="", model=settings["model"], revision=settings["revision"],
                      steps=settings["validation_inference_steps"], height=settings["resolution"],
                      width=settings["resolution"], progress=settings["progress"])
    try:
        checkpoint, _ = check_checkpoint(request, {})
    except UserError as e:
        raise UserError(str(e).replace("--height", "--resolution")) from None
    from ..models import UNetConfig

    vae, unet = read_configs(checkpoint.folder, checkpoint.family)
    if not isinstance(unet, UNetConfig):  # the training core trains UNets
        raise UserError(f"{settings['model']} is not a UNet checkpoint: sdflax train trains SD 1.x, 2.x and SDXL")
    divisible = vae.scale_factor * 2 ** (len(unet.block_out_channels) - 1)
    if checkpoint.height % divisible:
        raise UserError(f"--resolution {checkpoint.height} is not a multiple of {divisible} (the VAE's and UNet's "
                        f"downsampling): use {max(divisible, checkpoint.height // divisible * divisible)}")
    return checkpoint, divisible
