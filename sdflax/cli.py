"""`sdflax generate "PROMPT"`, `sdflax img2img "PROMPT" --image IN.png`, `sdflax inpaint "PROMPT" --image IN.png
--mask MASK.png`: PNG files made on all local devices, each carrying the settings that made it.

User errors (bad flags, a folder that is not a checkpoint, an unknown or uncached model, an unwritable output
path) print one line on stderr and exit with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import sys
import threading
import time

import numpy as np

from . import cache

DEFAULT_MODEL = "stable-diffusion-v1-5/stable-diffusion-v1-5"
# The events JAX records for tracing, lowering and compiling (or loading from the disk cache) one program.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CONFIG_FILES = ["model_index.json", "*/config.json", "scheduler/*", "tokenizer/*", "tokenizer_2/*"]
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")  # --model as one file in the CompVis / A1111 / SGM layout
MAX_PICTURE_SIDE = 8192  # --image, --mask, --control-image: at most 8192x8192 pixels (64 Mpx), read from the header


class UserError(Exception):
    """Something the user can fix; the message is one line that names it and says how."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _input_errors() -> tuple[type, ...]:
    """The library's error types for bad files and arguments: their message is the one line a user sees, wherever
    in a command they are raised (imported late: they are only needed once something failed)."""
    from .checkpoint_files import CheckpointFileError
    from .hub import ModelNotFoundError
    from .lora import LoraMismatchError
    from .models.config import ConfigError
    from .single_file import SingleFileError
    from .weights import CheckpointMismatchError

    return CheckpointFileError, ConfigError, CheckpointMismatchError, LoraMismatchError, ModelNotFoundError, \
        SingleFileError


def _use_cache_dir(args) -> str | None:
    """Point JAX's compilation cache at --cache-dir or sdflax's cache folder (None: SDFLAX_CACHE_DIR=off), before
    the first compile."""
    import jax

    cache_dir = os.path.expanduser(args.cache_dir) if args.cache_dir else cache.cache_dir()
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    return cache_dir


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seed(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be between 0 and {2**32 - 1}, got {value}")
    return value


def _number(check, problem):
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


_strength = _number(lambda v: 0 < v <= 1, "must be in (0, 1], got {value}: 1 repaints everything, small values keep "
                    "the image")
_fraction = _number(lambda v: 0 < v < 1, "must be in (0, 1), got {text}: the fraction of the schedule the base runs "
                    "before the refiner takes over (e.g. 0.8)")
_finite = _number(math.isfinite, "must be a finite number, got {text!r}")  # NaN or inf guidance: a black image


def _lora(text):
    """PATH[:SCALE] -> (PATH, SCALE): the scale is read only where the part after the last ':' is a number, so
    C:\\loras\\x.safetensors and names with colons are paths."""
    path, colon, tail = text.rpartition(":")
    try:
        scale = float(tail) if colon and path else None
    except ValueError:
        scale = None
    if scale is None:
        return text, 1.0
    if not math.isfinite(scale):
        raise argparse.ArgumentTypeError(f"{text}: the scale must be a finite number (1 is the LoRA's full "
                                         "strength, 0 leaves the model as it is)")
    return path, scale


def _scheduler(text):
    """sdflax's scheduler names, diffusers' class names and A1111's sampler names ("DPM++ 2M Karras")."""
    from .schedulers import scheduler_from_config

    try:
        scheduler_from_config({}, text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser(*more) -> argparse.ArgumentParser:
    parser = _Parser(prog="sdflax", description="Stable Diffusion in JAX/Flax.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = " Images are spread over all local devices (jax.pmap); image i uses seed S+i."
    g = commands.add_parser("generate", help="text -> PNG images", description="Generate images from a prompt and "
                            "write them as PNGs that carry their settings." + common)
    g.add_argument("prompt", help="what to draw")
    g.add_argument("--refiner", metavar="ID_OR_DIR", help="an SDXL refiner (hub id or diffusers folder) that "
                   "finishes an SDXL base model's images: the base runs the first --high-noise-frac of the schedule "
                   "and hands its latents to the refiner, which runs the rest of the --steps and decodes (diffusers' "
                   "ensemble of expert denoisers); it reads --prompt and --negative-prompt (its one text encoder), "
                   "--lora and --embedding apply to the base")
    g.add_argument("--high-noise-frac", type=_fraction, metavar="F", help="with --refiner: the fraction of the "
                   "schedule the base runs, in (0, 1) (default: 0.8)")
    _add_options(g)

    i = commands.add_parser("img2img", help="image + text -> PNG images", description="Redraw an image after a "
                            "prompt (SDEdit): the image is noised as far as --strength says, then denoised." + common)
    i.add_argument("prompt", help="what to draw")
    i.add_argument("--image", required=True, metavar="IN.png", help="the picture to start from")
    i.add_argument("--strength", type=_strength, help="how far to noise the image, in (0, 1]: 1 repaints "
                   "everything, small values keep the image; runs int(steps * strength) steps (default: 0.8; 0.3 for "
                   "SDXL, as diffusers)")
    _add_options(i, image=True)

    p = commands.add_parser("inpaint", help="image + mask + text -> PNG images", description="Repaint the white part "
                            "of a mask after a prompt and keep the black part (an inpainting checkpoint, or any "
                            "other: the kept part is pasted back after every step)." + common)
    p.add_argument("prompt", help="what to draw in the masked region")
    p.add_argument("--image", required=True, metavar="IN.png", help="the picture to repaint")
    p.add_argument("--mask", required=True, metavar="MASK.png", help="greyscale, the image's size: white is "
                   "repainted, black kept (binarised at 0.5)")
    p.add_argument("--strength", type=_strength, help="in (0, 1]: 1 starts the masked region from pure noise, "
                   "smaller values from the noised image (default: 1; 0.9999 for SDXL, as diffusers)")
    _add_options(p, image=True)
    for add_command in more:  # commands built on these pieces in their own modules (batch.py)
        add_command(commands)
    return parser


def _add_options(command, image=False, exclude=()):
    """The options all commands share (but those named in `exclude`: `sdflax batch` has its own --out)."""
    from .models.layers import ATTENTION_IMPLEMENTATIONS

    size = "resize the image to" if image else "pixels,"

    def add(flag, **kwargs):
        if flag not in exclude:
            command.add_argument(flag, **kwargs)

    add("--negative-prompt", default="", metavar="TEXT", help="what to steer away from")
    add("--prompt-2", metavar="TEXT", help="SDXL: the prompt of the second text encoder (default: the prompt)")
    add("--negative-prompt-2", metavar="TEXT", help="SDXL: the negative prompt of the second text encoder "
        "(default: the negative prompt)")
    add("--model", default=DEFAULT_MODEL, metavar="ID_DIR_OR_FILE",
        help=f"hub id, local diffusers folder, or one .safetensors/.ckpt file (SD 1.x, 2.x or SDXL base, told apart "
             f"by its tensor names) (default: {DEFAULT_MODEL})")
    add("--revision", metavar="REV", help="hub branch, tag or commit (default: main)")
    add("--config", metavar="ID_OR_DIR", help="with a single-file --model: a diffusers folder or hub id of the "
        "same architecture, for the model, scheduler and tokenizer configs (default: sdflax's bundled SD 1.5, SD 2.1 "
        "(768 px, v-prediction) or SDXL base configs)")
    add("--lora", action="append", default=[], type=_lora, metavar="PATH[:SCALE]",
        help="a LoRA file (kohya/A1111 or diffusers/PEFT) merged into the model at SCALE (default: 1.0); repeat for "
             "several, merged in order. A file whose name ends in :NUMBER needs its :SCALE written out")
    add("--embedding", action="append", default=[], metavar="PATH",
        help="a textual-inversion embedding (A1111 .pt/.safetensors, diffusers learned_embeds); its token is the "
             "file name without the extension, as in A1111: write it in the prompt; repeat for several")
    add("--scheduler", type=_scheduler, metavar="NAME", help="sampler: sdflax's name (dpmpp_2m, euler_ancestral, "
        "...) or A1111's (\"DPM++ 2M Karras\", \"Euler a\", \"UniPC\", ...) (default: the checkpoint's own)")
    add("--steps", type=_positive_int, default=50, help="denoising steps (default: 50)")
    add("--guidance", type=_finite, default=None, metavar="SCALE",
        help="classifier-free guidance scale (default: 7.5; 5.0 for SDXL but its inpaint, as diffusers)")
    add("--height", type=_positive_int, metavar="H", help=f"{size} H pixels, a multiple of the VAE scale factor "
        + ("(default: the image's own, cut down to a multiple)" if image else "(default: the model's own, 512 for "
           "SD 1.x)"))
    add("--width", type=_positive_int, metavar="W", help=f"{size} W pixels (default: the "
        + ("image's own)" if image else "model's own)"))
    add("--seed", type=_seed, help="seed of the first image (default: random, printed and saved)")
    add("--num-images", type=_positive_int, metavar="N",
        help="images to keep (default: one per device; computed in multiples of the device count)")
    add("--dtype", choices=("bfloat16", "float32"),
        help="weights and activations (default: bfloat16 on an accelerator, float32 on the CPU)")
    add("--attention", choices=ATTENTION_IMPLEMENTATIONS, default="auto",
        help="UNet attention: cuDNN flash attention where it runs (NVIDIA GPU, bfloat16), else XLA (auto, the "
             "default), or either forced")
    add("--controlnet", action="append", default=[], metavar="ID_OR_PATH",
        help="a ControlNet to steer by --control-image: hub id, diffusers folder, or an original-layout "
             ".safetensors/.pth file (SD 1.x/2.x); repeat for several nets")
    add("--control-image", action="append", default=[], metavar="IMG",
        help="the condition image (edges, pose, depth, ...) of each --controlnet, in their order; resized to the "
             "output size")
    add("--control-scale", action="append", default=[], type=float, metavar="S",
        help="how strongly the nets steer: one value for all or one per net (default: 1.0 for generate, 0.8 for "
             "img2img, 0.5 for inpaint, as diffusers)")
    add("--out", default="outputs", metavar="PATH",
        help="a folder (default: outputs/), or NAME.png: the image, or the grid when there are several")
    add("--grid", action="store_true", help="also write all images as one grid PNG")
    add("--progress", action=argparse.BooleanOptionalAction, default=None,
        help="--progress adds a per-step bar to the status lines and download bars (its program is compiled on "
        "every run: JAX keeps no program with a host callback in its disk cache); --no-progress prints only the "
        "results (default: status lines and download bars)")
    add("--cache-dir", metavar="DIR", help=f"compiled programs, reused by later runs (default: ${cache.CACHE_ENV} "
        f"or ~/.cache/sdflax/jax; {cache.CACHE_ENV}={cache.OFF} keeps none)")
    command.set_defaults(run=run)


def main(argv=None, commands=()) -> int:
    """`commands`: more `add_command(subparsers)` functions (`sdflax.__main__` adds batch's)."""
    parser = build_parser(*commands)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed its line (or --help / --version)
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except Exception as e:
        if not isinstance(e, UserError) and not isinstance(e, _input_errors()):
            raise  # a bug of sdflax's: the traceback is what a report needs
        print(f"sdflax: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sdflax: interrupted", file=sys.stderr)
        return 130


# ---- generate, img2img, inpaint ------------------------------------------------------------------------------

def run(args) -> int:
    """All three commands: check everything cheap, load, prepare the inputs, compile and run, write the PNGs."""
    status = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.progress is not False else (lambda m: 0)
    target = _output_target(args.out, args.grid, args.num_images)  # before anything slow
    pictures = _read_pictures(args)  # {"image": ..., "mask": ...} for img2img / inpaint
    controls = _read_controls(args)  # the --control-image pictures, one per --controlnet
    if args.progress is False:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    _check_lora_and_embedding_files(args)
    checkpoint = _check_checkpoint(args, pictures, controls)

    import jax  # after the checks above, so that mistakes are reported without starting JAX

    cache_dir = _use_cache_dir(args)
    backend = jax.default_backend()
    dtype = args.dtype or ("float32" if backend == "cpu" else "bfloat16")
    _check_attention(args, backend, dtype)
    devices = jax.local_device_count()
    num_images = args.num_images or devices
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    target.check_unused(args.prompt, [(seed + i) % 2**32 for i in range(num_images)], args.grid)  # NAME-SEED.png

    status(f"Loading {args.model} in {dtype} ...")
    start = time.perf_counter()
    pipeline, params = _load(args, checkpoint, dtype)
    refiner = _load_refiner(args, dtype) if checkpoint.high_noise_frac is not None else None
    seeds, call = _prepare(args, pipeline, params, checkpoint, pictures, controls, seed, refiner)
    load_s = time.perf_counter() - start

    where = f"{devices} {backend.upper()} device" + ("s" if devices > 1 else "")
    strength = f" (strength {checkpoint.strength})" if pictures else ""
    status(f"Compiling for {args.steps} steps{strength} at {checkpoint.width}x{checkpoint.height}, {len(seeds)} "
           f"image(s) on {where} (once per setting; {f'kept in {cache_dir}' if cache_dir else 'not kept'}) ...")
    step_bar = _StepBar() if args.progress else None
    with _CompileClock() as clock:
        start = time.perf_counter()
        try:
            images = call(jit=True, callback=step_bar).images
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise UserError(f"out of memory making {len(seeds)} image(s) of {checkpoint.width}x{checkpoint.height} on "
                            f"{where}: use fewer --num-images, a smaller size, or --dtype bfloat16") from None
        total_s = time.perf_counter() - start
    if step_bar is not None:
        step_bar.close()
    images = pipeline.numpy_to_pil(images)[:num_images]

    settings = image_settings(args, pipeline, checkpoint, dtype)
    if pictures:
        settings.update(strength=checkpoint.strength, image=args.image,
                        **({"mask": args.mask} if "mask" in pictures else {}))
    settings.update({key: value for key, value in (("prompt_2", args.prompt_2),
                                                   ("negative_prompt_2", args.negative_prompt_2)) if value is not None})
    if checkpoint.high_noise_frac is not None:
        settings.update(refiner=args.refiner, high_noise_frac=checkpoint.high_noise_frac)
    if checkpoint.single_file and args.config:
        settings["config"] = args.config
    if args.lora:  # lists in the order of merging (JSON in the PNG), as the ControlNet entries
        settings.update(lora=[path for path, _ in args.lora], lora_scale=[scale for _, scale in args.lora])
    if args.embedding:
        settings["embedding"] = list(args.embedding)
    if controls:  # lists, one entry per net in their order (JSON in the PNG)
        settings.update(controlnet=args.controlnet, control_image=args.control_image,
                        control_scale=list(controls.scales))
    _save(args, target, images, seeds[:num_images], settings)

    cached = " (from the disk cache)" if clock.cache_hits else ""
    print(f"seed {seeds[0]}: load {load_s:.1f} s, compile {clock.seconds:.1f} s{cached}, "
          f"generate {max(total_s - clock.seconds, 0.0):.1f} s for {len(seeds)} image(s)", file=sys.stderr)
    return 0


@dataclasses.dataclass(frozen=True)
class _Checkpoint:
    """What the configs say, read before any weight: the folder, the kind of pipeline, the image size."""

    folder: str
    local: bool
    commit: str
    xl: bool
    guidance: float
    height: int
    width: int
    single_file: bool = False  # --model is one .safetensors / .ckpt file; `folder` holds the configs used for it
    strength: float | None = None  # img2img and inpaint: --strength, or the pipeline's default
    high_noise_frac: float | None = None  # with --refiner: where the base hands over to it


# diffusers' pipelines' default strengths (SD, SDXL), which the CLI's follow
DEFAULT_STRENGTHS = {"img2img": (0.8, 0.3), "inpaint": (1.0, 0.9999)}
DEFAULT_HIGH_NOISE_FRAC = 0.8  # diffusers' base + refiner example


def image_settings(args, pipeline, checkpoint, dtype) -> dict:
    """What a PNG records of the command that made it (`png_info`), all but the seed."""
    return {"prompt": args.prompt, "negative_prompt": args.negative_prompt, "steps": args.steps,
            "scheduler": args.scheduler or _scheduler_name(pipeline.scheduler),
            "sampler": _a1111_name(pipeline.scheduler),
            "guidance_scale": checkpoint.guidance, "width": checkpoint.width, "height": checkpoint.height,
            "model": args.model, "revision": args.revision or ("main" if not checkpoint.local else ""),
            "commit": checkpoint.commit, "dtype": dtype, "software": f"sdflax {_version()}"}


def _check_checkpoint(args, pictures, controls=None) -> _Checkpoint:
    """Read the checkpoint's configs (kilobytes) and check the command against them with the library's own
    checks, so that a size, step count or strength the model cannot take fails before gigabytes download."""
    from .hub import ModelNotFoundError, resolve_folder, snapshot_commit
    from .pipeline.starts import start_step
    from .loading import check_pipeline_folder, load_scheduler
    from .models import AutoencoderKL, UNet2DConditionModel
    from .models.config import read_config_file

    single_file = os.path.isfile(os.path.expanduser(args.model))
    local = single_file or os.path.isdir(os.path.expanduser(args.model))
    if local and args.revision:
        what = "a file" if single_file else "a local folder"
        raise UserError(f"--revision applies to hub ids, but {args.model} is {what}: drop --revision")
    if args.config is not None and not single_file:
        raise UserError(f"--config applies to a single-file --model ({', '.join(SINGLE_FILE_SUFFIXES)}), but "
                        f"{args.model} is not a file: drop --config")
    try:
        if single_file:
            folder, xl = _single_file_configs(args)
        else:
            folder = resolve_folder(args.model, args.revision, allow_patterns=CONFIG_FILES)
            check_pipeline_folder(folder, args.model)
            index = read_config_file(os.path.join(folder, "model_index.json"))
            xl = str(index.get("_class_name", "")).startswith("StableDiffusionXL")
        vae = AutoencoderKL.from_config(read_config_file(os.path.join(folder, "vae", "config.json")))
        unet = UNet2DConditionModel.from_config(read_config_file(os.path.join(folder, "unet", "config.json")))
        scheduler = load_scheduler(folder, args.scheduler)
        scheduler.check_steps(args.steps)
    except (ModelNotFoundError, ValueError, TypeError) as e:
        raise UserError(str(e)) from e
    strength = None
    if pictures:
        strength = args.strength if args.strength is not None else DEFAULT_STRENGTHS[args.command][xl]
        try:
            start_step(args.steps, strength)
        except ValueError:
            raise UserError(f"--strength {strength} with --steps {args.steps} runs no denoising step: raise "
                            f"--strength to at least {1 / args.steps:.3g} or --steps") from None
    if not xl:
        for flag, value in (("--prompt-2", args.prompt_2), ("--negative-prompt-2", args.negative_prompt_2)):
            if value is not None:
                raise UserError(f"{flag} is for SDXL's second text encoder, but {args.model} is not an SDXL "
                                f"checkpoint (it has one): drop {flag}")
    if xl and args.controlnet and args.command != "generate":
        raise UserError(f"--controlnet with an SDXL checkpoint runs with sdflax generate only, not {args.command}: "
                        "drop --controlnet, or use an SD 1.x/2.x checkpoint")
    latent, unet_channels = vae.config.latent_channels, unet.config.in_channels
    if args.command == "inpaint" and unet_channels not in (latent, 2 * latent + 1):
        raise UserError(f"{args.model}: its UNet takes {unet_channels} input channels; inpainting needs an "
                        f"ordinary ({latent}) or an inpainting ({2 * latent + 1}) UNet")
    if args.command != "inpaint" and unet_channels == 2 * latent + 1:
        raise UserError(f"{args.model} is an inpainting checkpoint (its UNet takes a mask): use sdflax inpaint")
    _check_controlnets(args, unet.config)
    factor = vae.config.scale_factor
    height, width = _output_size(args, unet.config.sample_size * factor, factor, pictures, controls)
    guidance = args.guidance if args.guidance is not None else (5.0 if xl and args.command != "inpaint" else 7.5)
    high_noise_frac = _check_refiner(args, xl, scheduler, vae.config) if getattr(args, "refiner", None) else None
    if getattr(args, "high_noise_frac", None) is not None and high_noise_frac is None:
        raise UserError("--high-noise-frac applies with --refiner: add --refiner ID_OR_DIR, or drop it")
    commit = "" if single_file else snapshot_commit(folder) or ""  # a hub --config's commit is not the model's
    return _Checkpoint(folder, local, commit, xl, guidance, height, width, single_file, strength, high_noise_frac)


def _check_refiner(args, xl, scheduler, vae) -> float:
    """The --high-noise-frac: --refiner's configs (kilobytes) are an SDXL checkpoint (a refiner or a base) whose
    latents are the base model's, and both halves of the schedule, cut there, run a step."""
    from .pipeline.types import Settings
    from .hub import ModelNotFoundError, resolve_folder
    from .pipeline.starts import schedule_window
    from .loading import check_pipeline_folder, load_scheduler
    from .models import AutoencoderKL, UNet2DConditionModel
    from .models.config import read_config_file
    from .pipeline import StableDiffusionXLImg2Img

    name = f"--refiner {args.refiner}"
    if not xl:
        raise UserError(f"{name}: a refiner finishes SDXL base images, but {args.model} is not an SDXL checkpoint: "
                        "drop --refiner, or give an SDXL base --model")
    if args.controlnet:
        raise UserError(f"{name} with --controlnet is not supported: drop one of them")
    if os.path.isfile(os.path.expanduser(args.refiner)):
        raise UserError(f"{name} is a file: sdflax takes a refiner as a hub id or diffusers folder")
    fraction = args.high_noise_frac if args.high_noise_frac is not None else DEFAULT_HIGH_NOISE_FRAC
    family = StableDiffusionXLImg2Img.conditioning
    try:
        folder = resolve_folder(args.refiner, None, allow_patterns=CONFIG_FILES)
        index_file = os.path.join(folder, "model_index.json")
        kind = read_config_file(index_file).get("_class_name") if os.path.isfile(index_file) else None
        if kind is not None and not str(kind).startswith("StableDiffusionXL"):  # before naming files it lacks
            raise UserError(f"{name} is a {kind} checkpoint, not an SDXL refiner or SDXL one: give the folder or hub "
                            "id of one, e.g. stabilityai/stable-diffusion-xl-refiner-1.0")
        check_pipeline_folder(folder, name, tuple(family.models), family.tokenizers)  # null parts need no files
        refiner_vae = AutoencoderKL.from_config(read_config_file(os.path.join(folder, "vae", "config.json")))
        unet = UNet2DConditionModel.from_config(read_config_file(os.path.join(folder, "unet", "config.json")))
        refiner_scheduler = load_scheduler(folder, args.scheduler)
    except (ModelNotFoundError, ValueError, TypeError) as e:
        raise UserError(str(e)) from e
    if kind is None or unet.config.addition_embed_type != "text_time":
        raise UserError(f"{name} is not an SDXL refiner or SDXL checkpoint: give the folder or hub id of one, e.g. "
                        "stabilityai/stable-diffusion-xl-refiner-1.0")
    latent = vae.latent_channels
    if (refiner_vae.config.latent_channels, unet.config.in_channels) != (latent, latent) \
            or refiner_vae.config.scale_factor != vae.scale_factor:
        raise UserError(f"{name} takes other latents than {args.model} ({refiner_vae.config.latent_channels} "
                        f"channels, UNet input {unet.config.in_channels}, VAE scale factor "
                        f"{refiner_vae.config.scale_factor}; the base: {latent}, {latent}, {vae.scale_factor}): give "
                        "a refiner made for this base")
    for which, which_scheduler, cut in (("the base", scheduler, dict(denoising_end=fraction)),
                                        (name, refiner_scheduler, dict(denoising_start=fraction))):
        try:
            schedule_window(which_scheduler, Settings(args.steps, **cut))
        except ValueError:
            raise UserError(f"--high-noise-frac {fraction} with --steps {args.steps} leaves {which} no step: raise "
                            "--steps, or move --high-noise-frac towards 0.5") from None
    return fraction


def _single_file_configs(args) -> tuple[str, bool]:
    """(the folder of configs for a single-file --model, whether it is SDXL): the version is told from the tensor
    names (a .safetensors header, a .ckpt's pickle: the tensors are memory-mapped, not read), the configs are
    --config's or sdflax's bundled ones for that version."""
    from .checkpoint_files import read_checkpoint
    from .hub import resolve_folder
    from .loading import check_pipeline_folder
    from .single_file import NAMES, bundled_config_folder, detect_version, file_contents

    suffix = os.path.splitext(args.model)[1].lower()
    if suffix not in SINGLE_FILE_SUFFIXES:
        raise UserError(f"--model {args.model} is a file but not a {' or '.join(SINGLE_FILE_SUFFIXES)} checkpoint: "
                        "give a single-file checkpoint, a diffusers folder or a hub id")
    try:
        version = detect_version(read_checkpoint(os.path.expanduser(args.model)))
    except ValueError as e:
        raise UserError(f"--model {args.model}: {e}") from e
    if version == "sdxl_refiner":
        raise UserError(f"--model {args.model} is {NAMES[version]} checkpoint (one OpenCLIP text encoder, no CLIP "
                        "ViT-L): a refiner finishes a base model's images and does not draw from a prompt alone; give "
                        "an SD 1.x, 2.x or SDXL base checkpoint")
    if args.config is None:
        return bundled_config_folder(version), version == "sdxl"
    contents = file_contents(version)
    folder = resolve_folder(args.config, None, allow_patterns=CONFIG_FILES)
    check_pipeline_folder(folder, f"--config {args.config}", tuple(contents.models), contents.tokenizers)
    return folder, version == "sdxl"


def _check_controlnets(args, unet):
    """Each --controlnet exists and, where its config.json can be read (a folder or hub id: kilobytes), was made
    for the checkpoint's model family. An original-layout file is checked when it loads."""
    from .hub import ModelNotFoundError, resolve_folder
    from .models.config import read_config_file
    from .models.controlnet import ControlNetConfig

    for name in args.controlnet:
        if os.path.isfile(os.path.expanduser(name)):
            continue
        try:
            folder = resolve_folder(name, None, allow_patterns=["config.json"])
            config = ControlNetConfig.from_dict(read_config_file(os.path.join(folder, "config.json")))
        except (ModelNotFoundError, ValueError, TypeError, OSError) as e:
            raise UserError(f"--controlnet {name}: {e}") from e
        if (config.cross_attention_dim, config.addition_embed_type) != (unet.cross_attention_dim,
                                                                        unet.addition_embed_type):
            raise UserError(f"--controlnet {name} was made for another model family than {args.model} (text width "
                            f"{config.cross_attention_dim} vs {unet.cross_attention_dim}): use a ControlNet trained "
                            "for this base model")


def _check_lora_and_embedding_files(args):
    """Each --lora and --embedding file is there, and no two embeddings claim one token (their file names); whether
    they fit the model is known once it is loaded."""
    for path, _ in args.lora:
        if not os.path.isfile(os.path.expanduser(path)):
            head, _, tail = path.rpartition(":")
            if head and os.path.isfile(os.path.expanduser(head)):
                raise UserError(f"--lora {path}: the scale {tail!r} is not a number: write PATH:SCALE with a number, "
                                f"e.g. {head}:0.7")
            raise UserError(f"--lora {path}: no such file: give the path of a LoRA .safetensors file, with :SCALE "
                            "after it if wanted")
    tokens = {}
    for path in args.embedding:
        if not os.path.isfile(os.path.expanduser(path)):
            raise UserError(f"--embedding {path}: no such file: give the path of a textual-inversion .pt or "
                            ".safetensors file")
        token = os.path.splitext(os.path.basename(path))[0]
        if token in tokens:
            raise UserError(f"--embedding {tokens[token]} and --embedding {path} both give the token {token!r} (the "
                            "file name): rename one of the files")
        tokens[token] = path


def _check_attention(args, backend, dtype):
    from .models.layers import attention_for

    if args.attention == "cudnn" and attention_for(64, dtype) != "cudnn":
        raise UserError(f"--attention cudnn needs an NVIDIA GPU and --dtype bfloat16 (here: {backend}, {dtype}): "
                        "use --attention auto")


def _load(args, checkpoint, dtype):
    """(pipeline, params) of the command's pipeline class."""
    import jax.numpy as jnp

    from . import (ControlNetModel, StableDiffusion, StableDiffusionControlNet, StableDiffusionControlNetImg2Img,
                   StableDiffusionControlNetInpaint, StableDiffusionImg2Img, StableDiffusionInpaint, StableDiffusionXL,
                   StableDiffusionXLControlNet, StableDiffusionXLImg2Img, StableDiffusionXLInpaint)

    if args.controlnet:
        kind = {"generate": StableDiffusionXLControlNet if checkpoint.xl else StableDiffusionControlNet,
                "img2img": StableDiffusionControlNetImg2Img, "inpaint": StableDiffusionControlNetInpaint}
    else:
        kind = {"generate": StableDiffusionXL if checkpoint.xl else StableDiffusion,
                "img2img": StableDiffusionXLImg2Img if checkpoint.xl else StableDiffusionImg2Img,
                "inpaint": StableDiffusionXLInpaint if checkpoint.xl else StableDiffusionInpaint}
    dtype = getattr(jnp, dtype)
    try:
        nets = []
        for name in args.controlnet:
            path = os.path.expanduser(name)
            if os.path.isfile(path):  # an original-layout file
                nets.append(ControlNetModel.from_single_file(path, dtype=dtype, attention=args.attention))
            else:
                nets.append(ControlNetModel.from_pretrained(name, dtype=dtype, attention=args.attention))
        extra = {"controlnet": [net for net, _ in nets]} if nets else {}
        kind = kind[args.command]
        if checkpoint.single_file:
            pipeline, params = _load_single_file(args, kind, dtype, extra)
        else:
            pipeline, params = kind.from_pretrained(args.model, revision=args.revision, dtype=dtype,
                                                    scheduler=args.scheduler, attention=args.attention, **extra)
    except (OSError, ValueError) as e:  # files missing, unreadable or not matching their config
        raise UserError(str(e)) from e
    if nets:
        params["controlnet"] = [net_params for _, net_params in nets]
    return pipeline, _add_loras_and_embeddings(args, pipeline, params)


def _load_refiner(args, dtype):
    """(pipeline, params) of --refiner, an SDXL image-to-image pipeline (a refiner: its second encoder alone)."""
    import jax.numpy as jnp

    from . import StableDiffusionXLImg2Img

    try:
        return StableDiffusionXLImg2Img.from_pretrained(args.refiner, dtype=getattr(jnp, dtype),
                                                        scheduler=args.scheduler, attention=args.attention)
    except (OSError, ValueError) as e:
        raise UserError(f"--refiner {args.refiner}: {e}") from e


def _load_single_file(args, kind, dtype, extra):
    """(pipeline, params) of `kind` from a single-file --model, with its configs from --config or the bundled ones
    (`kind.from_single_file`, which also takes the ControlNet pipelines' `controlnet=`)."""
    from .single_file import SingleFileError, load_single_file

    try:
        parts, params = load_single_file(os.path.expanduser(args.model), args.config, dtype, scheduler=args.scheduler,
                                         attention=args.attention, family=kind.conditioning, pipeline=kind.__name__)
    except SingleFileError as e:
        if args.config is not None:
            raise
        detail = str(e).partition("; the model configs came from")[0]  # the library's hint names its config=
        raise UserError(f"--model {args.model} does not fit sdflax's bundled configs for its version (another "
                        "architecture?): pass --config <a diffusers folder or hub id of the same model>; "
                        f"{detail}") from e
    return kind(**parts, **extra), params


def _add_loras_and_embeddings(args, pipeline, params):
    """params with each --lora merged in order, then each --embedding's token added (the pipeline's tokenizer
    learns it)."""
    for path, scale in args.lora:
        try:
            params = pipeline.load_lora(params, os.path.expanduser(path), scale)
        except (OSError, ValueError) as e:  # LoraMismatchError: a LoRA for another model
            raise _flag_error("--lora", path, e) from e
    for path in args.embedding:
        try:
            params = pipeline.load_textual_inversion(params, os.path.expanduser(path))
        except (OSError, ValueError) as e:
            raise _flag_error("--embedding", path, e) from e
    return params


def _flag_error(flag, path, error) -> UserError:
    """The library's message about a file, led by the flag that named it."""
    message = str(error)
    return UserError(f"{flag} {message}" if message.startswith(path) else f"{flag} {path}: {message}")


def _prepare(args, pipeline, params, checkpoint, pictures, controls, seed, refiner=None):
    """(seeds, the pipeline call with everything but `jit` and `callback`): the images fill every local device,
    and image i has its own key, seed + i, so it does not depend on the batch it was made in. With `refiner`
    (pipeline, params) the call runs the base to --high-noise-frac and the refiner from there."""
    import jax
    import jax.numpy as jnp

    from .parallel import replicate, shard

    devices = jax.local_device_count()
    per_device = -(-(args.num_images or devices) // devices)
    seeds = [(seed + i) % 2**32 for i in range(per_device * devices)]
    prompt_ids = shard(_prompt_ids(pipeline, args.prompt, args.prompt_2, len(seeds)))
    # Pass negative ids even for an empty prompt (it is SD's unconditional one): one program with or without them.
    # SDXL's default is zeros for no negative prompt (force_zeros_for_empty_prompt), so it gets None there.
    neg_ids = (None if checkpoint.xl and not args.negative_prompt and not args.negative_prompt_2
               else shard(_prompt_ids(pipeline, args.negative_prompt, args.negative_prompt_2, len(seeds))))
    keys = shard(jnp.stack([jax.random.key(s) for s in seeds]))  # one key per image (sdflax.random_draws)
    extra, control = {}, []
    if controls:
        from .pipeline.images import preprocess_control_images

        control = [shard(np.repeat(preprocess_control_images([picture], pipeline.vae_scale_factor), len(seeds), 0))
                   for picture in controls.pictures]  # the same control image for every seed
        extra["controlnet_conditioning_scale"] = list(controls.scales)
        if not pictures:
            return seeds, functools.partial(pipeline, prompt_ids, control, replicate(params), keys,
                                            num_inference_steps=args.steps, guidance_scale=checkpoint.guidance,
                                            neg_prompt_ids=neg_ids, **extra)
    if not pictures:
        call = functools.partial(pipeline, prompt_ids, replicate(params), keys, num_inference_steps=args.steps,
                                 height=checkpoint.height, width=checkpoint.width, guidance_scale=checkpoint.guidance,
                                 neg_prompt_ids=neg_ids)
        return seeds, (call if refiner is None else _refined(args, call, refiner, checkpoint, keys))
    from .pipeline.images import preprocess_images
    from .pipeline.images import preprocess_images_and_masks

    try:
        if "mask" in pictures:
            images = preprocess_images_and_masks([pictures["image"]], [pictures["mask"]], pipeline.vae_scale_factor)
        else:
            images = [preprocess_images([pictures["image"]], pipeline.vae_scale_factor)]
    except ValueError as e:
        raise UserError(str(e)) from e
    images = [shard(np.repeat(x, len(seeds), axis=0)) for x in images]  # the same picture for every seed
    return seeds, functools.partial(pipeline, prompt_ids, *images, *([control] if control else []),
                                    replicate(params), keys, checkpoint.strength, args.steps,
                                    guidance_scale=checkpoint.guidance, neg_prompt_ids=neg_ids, **extra)


def _prompt_ids(pipeline, prompt, prompt_2, n):
    """The ids of n copies of the prompt; `prompt_2` (SDXL's second encoder, refused before loading for other
    models) only where given: the SD pipelines' `prepare_inputs` do not all take it."""
    return pipeline.prepare_inputs([prompt] * n, **({"prompts_2": [prompt_2] * n} if prompt_2 else {}))


def _refined(args, base, refiner, checkpoint, keys):
    """The base call stopped at --high-noise-frac, returning its latents, and the refiner continuing from them with
    the same steps, guidance and per-image keys: diffusers' base + refiner, `denoising_end` then `denoising_start`.
    The refiner has one text encoder (the second): as diffusers, it reads the prompt and negative prompt."""
    from .parallel import replicate, shard

    pipe, params = refiner
    n = keys.shape[0] * keys.shape[1]
    ids = shard(pipe.prepare_inputs([args.prompt] * n))
    # No negative prompt: the refiner's own default (the empty prompt's embedding: it does not force zeros)
    neg_ids = shard(pipe.prepare_inputs([args.negative_prompt] * n)) if args.negative_prompt else None
    params = replicate(params)

    def call(jit, callback=None):
        latents = base(jit=jit, callback=callback, denoising_end=checkpoint.high_noise_frac,
                       output_type="latent").images
        if callback is not None:
            callback.close()  # the base's bar ends before the refiner's starts
        bar = _StepBar("refining") if callback is not None else None
        try:
            return pipe(ids, latents, params, keys, num_inference_steps=args.steps,
                        guidance_scale=checkpoint.guidance, neg_prompt_ids=neg_ids,
                        denoising_start=checkpoint.high_noise_frac, jit=jit, callback=bar)
        finally:
            if bar is not None:
                bar.close()
    return call


def _save(args, target, images, seeds, settings):
    """Each image as a PNG with the settings that make it again (and the grid), never over an existing file."""
    paths, grid_path = target.paths(args.prompt, seeds, args.grid)
    try:
        for path, image, s in zip(paths, images, seeds):
            _write_png(path, image, png_info({**settings, "seed": s}))
        if grid_path:
            from .utils import make_image_grid

            rows, cols = grid_shape(len(images))
            _write_png(grid_path, make_image_grid(images, rows, cols),
                       png_info({**settings, "seed": seeds[0], "seeds": ",".join(map(str, seeds))}))
    except FileExistsError as e:  # made since the check before loading
        raise UserError(f"--out {args.out}: {e.filename} exists now: sdflax never overwrites a file; choose another "
                        "--out, or a folder") from e
    except OSError as e:
        raise UserError(f"cannot write {e.filename or args.out}: {e.strerror or e}") from e


def _write_png(path, image, info):
    with open(path, "xb") as f:  # "x": fails rather than replace a file that appeared while sampling
        image.save(f, format="PNG", pnginfo=info)
    print(path)


def _read_picture(flag, path):
    """The picture, 8-bit (`eight_bit`: 16-bit greyscale scaled, not clipped); its size is checked against
    MAX_PICTURE_SIDE² from the header, before the pixels are decoded (a small PNG can claim 30000x30000)."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    from .pipeline.images import eight_bit

    def too_large(size):
        return UserError(f"{flag} {path}: the picture is {size} pixels, larger than sdflax reads "
                         f"({MAX_PICTURE_SIDE}x{MAX_PICTURE_SIDE} at most): give a smaller picture")

    try:
        with warnings.catch_warnings():  # Pillow's own bound: a warning up to twice its limit, then an error
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(os.path.expanduser(path)) as picture:
                width, height = picture.size
                if width * height > MAX_PICTURE_SIDE**2:
                    raise too_large(f"{width}x{height}")
                picture.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:  # past Pillow's limit, at open
        raise too_large(f"more than {Image.MAX_IMAGE_PIXELS}") from e
    except (OSError, UnidentifiedImageError, ValueError) as e:
        reason = "not an image file PIL can read" if isinstance(e, UnidentifiedImageError) else e.strerror or e
        raise UserError(f"{flag} {path}: cannot read it ({reason}): give a PNG or JPEG file") from e
    return eight_bit(picture)


@dataclasses.dataclass
class _Controls:
    """The --control-image pictures and the scale of each --controlnet, in their order."""

    pictures: list
    scales: tuple


DEFAULT_CONTROL_SCALES = {"generate": 1.0, "img2img": 0.8, "inpaint": 0.5}  # diffusers' pipelines' defaults


def _read_controls(args) -> _Controls | None:
    """The ControlNet flags checked against each other, and the control images read (RGB)."""
    nets, images, scales = args.controlnet, args.control_image, args.control_scale
    if not nets and not images and not scales:
        return None
    if len(images) != len(nets):
        raise UserError(f"{len(nets)} --controlnet and {len(images)} --control-image: give one --control-image per "
                        "--controlnet, in the same order")
    if len(scales) not in (0, 1, len(nets)):
        raise UserError(f"{len(scales)} --control-scale for {len(nets)} --controlnet: give one for all nets or one "
                        "per net")
    for scale in scales:
        if not math.isfinite(scale):
            raise UserError(f"--control-scale {scale}: give a finite number (1 steers fully, 0 not at all)")
    scales = tuple(scales) * (len(nets) if len(scales) == 1 else 1) or (DEFAULT_CONTROL_SCALES[args.command],) * len(nets)
    return _Controls([_read_picture("--control-image", path).convert("RGB") for path in images], scales)


def _read_pictures(args) -> dict:
    """--image (RGB) and --mask (greyscale) as PIL images, checked: readable, the same size, a grey mask."""
    pictures = {flag: _read_picture(f"--{flag}", getattr(args, flag)) for flag in ("image", "mask")
                if getattr(args, flag, None) is not None}
    if "mask" in pictures:
        image, mask = pictures["image"], pictures["mask"]
        if mask.size != image.size:
            raise UserError(f"--mask {args.mask} is {mask.size[0]}x{mask.size[1]} but --image {args.image} is "
                            f"{image.size[0]}x{image.size[1]}: give a mask of the image's size")
        from .pipeline.images import has_transparency

        if has_transparency(mask):  # its alpha would be dropped, not read as the mask: refused, not guessed
            raise UserError(f"--mask {args.mask}: the mask has transparency, which sdflax does not read as the mask: "
                            "give a greyscale mask, white where to repaint and black where to keep")
        rgb = np.asarray(mask.convert("RGB"), np.int16)
        if (rgb != rgb[..., :1]).any():  # a coloured mask would silently become its luma
            raise UserError(f"--mask {args.mask} has colours (its red, green and blue differ): give a greyscale "
                            "mask, white where to repaint and black where to keep")
        pictures["mask"] = mask.convert("L")
    if pictures:  # an alpha channel is dropped, as diffusers does: the colours under it are used as they are
        pictures["image"] = pictures["image"].convert("RGB")
    return pictures


def _output_size(args, default, factor, pictures, controls=None):
    """(height, width): --height/--width must be multiples of the VAE scale factor. Without them the size is
    --image's, else the first --control-image's (as diffusers' pipelines take it), cut down to multiples (with a
    warning line), else the model's. Every input picture is resized to it."""
    for flag, value in (("--height", args.height), ("--width", args.width)):
        if value is not None and value > MAX_PICTURE_SIDE:  # its latents and attention would exhaust any memory
            raise UserError(f"{flag} {value} is larger than sdflax makes ({MAX_PICTURE_SIDE} pixels at most)")
        if value is not None and value % factor:
            raise UserError(f"{flag} {value} is not a multiple of {factor}, the VAE scale factor of {args.model}: "
                            f"use {max(factor, value // factor * factor)} or {(value // factor + 1) * factor}")
    if pictures:
        flag, path, source = "--image", args.image, pictures["image"]
    elif controls:
        flag, path, source = "--control-image", args.control_image[0], controls.pictures[0]
    else:
        return args.height or default, args.width or default
    from PIL import Image

    own_width, own_height = source.size
    height = args.height or own_height - own_height % factor
    width = args.width or own_width - own_width % factor
    if not height or not width:
        raise UserError(f"{flag} {path} is {own_width}x{own_height}, smaller than {factor} pixels, the VAE "
                        f"scale factor: give a larger image")
    if (width, height) != (own_width, own_height) and (
            (args.height is None and height != own_height) or (args.width is None and width != own_width)):
        print(f"sdflax: warning: {flag} {path} is {own_width}x{own_height}: resized to {width}x{height}, "
              f"a multiple of {factor} (the VAE scale factor)", file=sys.stderr)
    resize = lambda picture: picture if picture.size == (width, height) else picture.resize(  # noqa: E731
        (width, height), Image.LANCZOS)
    for name, picture in pictures.items():
        pictures[name] = resize(picture)
    if controls:
        controls.pictures[:] = [resize(picture) for picture in controls.pictures]
    return height, width


class _StepBar:
    """A tqdm bar fed by the pipeline's per-step host callback; under pmap each device reports every step,
    so a step counts once, when the first device reaches it. One object per run: the callback is static."""

    def __init__(self, desc="denoising"):
        self.bar, self.done, self.lock, self.desc = None, 0, threading.Lock(), desc

    def __call__(self, step, num_steps, latents):
        with self.lock:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=num_steps, desc=self.desc, unit="step", file=sys.stderr, dynamic_ncols=True)
            if step + 1 > self.done:
                self.bar.update(step + 1 - self.done)
                self.done = step + 1

    def close(self):
        if self.bar is not None:
            self.bar.close()


class _CompileClock:
    """Seconds JAX spends tracing, lowering and compiling (or loading compiled programs) inside the block."""

    def __enter__(self):
        from jax import monitoring

        self.seconds, self.cache_hits = 0.0, 0
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc):
        from jax import monitoring

        monitoring.unregister_event_duration_listener(self._on_duration)
        monitoring.unregister_event_listener(self._on_event)

    def _on_duration(self, event, duration, **kwargs):
        if event in COMPILE_EVENTS:
            self.seconds += duration

    def _on_event(self, event, **kwargs):
        if event == CACHE_HIT_EVENT:
            self.cache_hits += 1


# ---- output -------------------------------------------------------------------------------------------------

class _OutputTarget:
    """`--out`: a folder (names from the prompt and seed, never overwriting) or one NAME.png."""

    def __init__(self, out):
        self.out = out
        self.file = out.lower().endswith(".png")
        self.folder = (os.path.dirname(out) or ".") if self.file else out

    def paths(self, prompt, seeds, grid):
        if self.file:
            if len(seeds) == 1 and not grid:
                return [self.out], None
            stem = self.out[:-4]
            return [f"{stem}-{s}.png" for s in seeds], (self.out if grid else None)
        stem = os.path.join(self.folder, slug(prompt))
        paths = [_unused(f"{stem}-{s}.png") for s in seeds]
        return paths, (_unused(f"{stem}-{seeds[0]}-grid.png") if grid else None)

    def check_unused(self, prompt, seeds, grid):
        """Refuse, before loading, to write over a file: NAME.png's names are the user's, not sdflax's to change."""
        if not self.file:
            return  # in a folder, names that are taken get a -1, -2, ... suffix
        paths, grid_path = self.paths(prompt, seeds, grid)
        taken = [path for path in [*paths, grid_path] if path and os.path.lexists(path)]
        if taken:
            _refuse_taken(self.out, taken)


def _refuse_taken(out, taken):
    names = ", ".join(taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
    raise UserError(f"--out {out}: {names} {'exists' if len(taken) == 1 else 'exist'}: sdflax never overwrites a "
                    "file; choose another --out, or a folder (--out DIR: names there are never reused)")


def _output_target(out, grid=False, num_images=None) -> _OutputTarget:
    """Check that PNGs can be written there now, before minutes of loading and compiling."""
    import tempfile

    root, ext = os.path.splitext(out)
    if ext.lower() in (".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"):
        raise UserError(f"--out {out}: sdflax writes PNG files (they carry the settings): use {root}.png or a folder")
    target = _OutputTarget(out)
    folder = target.folder
    if target.file and os.path.isdir(out):
        raise UserError(f"--out {out} is a folder: write {out}{os.sep} to put the images in it, or give another "
                        "NAME.png")
    if target.file and os.path.lexists(out) and (grid or num_images == 1):  # NAME.png is written: the image or
        _refuse_taken(out, [out])  # the grid (else check_unused decides, once the device count and seeds are known)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"--out {out}: {folder} is a file, not a folder: give a folder or a NAME.png")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UserError(f"--out {out}: cannot write in {folder} ({e.strerror or e}): choose another --out") from e
    return target


def _unused(path):
    stem, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(path):
        path, n = f"{stem}-{n}{ext}", n + 1
    return path


def slug(text, limit=40):
    """A file-name-safe short form of the prompt: "A photo, of X!" -> "a-photo-of-x"."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    out = ""
    for word in words:
        if len(out) + len(word) + 1 > limit:
            break
        out = f"{out}-{word}" if out else word
    return out or (words[0][:limit] if words else "image")


def grid_shape(n):
    """(rows, cols) with rows * cols == n, as square as n allows, wider than tall."""
    rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    return rows, n // rows


def png_info(settings):
    """PNG text chunks: one per setting, and A1111's `parameters` line, which other image tools read."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in settings.items():  # iTXt (UTF-8) where Latin-1 cannot hold the text
        info.add_text(key, json.dumps(value) if isinstance(value, list) else str(value))
    s = settings
    # A1111 writes a LoRA into the prompt as <lora:NAME:WEIGHT>, NAME the file name without its extension
    loras = "".join(f" <lora:{os.path.splitext(os.path.basename(path))[0]}:{scale}>"
                    for path, scale in zip(s.get("lora", ()), s.get("lora_scale", ())))
    parameters = (f"{s['prompt']}{loras}\nNegative prompt: {s['negative_prompt']}\nSteps: {s['steps']}, Sampler: "
                  f"{s.get('sampler', s['scheduler'])}, CFG scale: {s['guidance_scale']}, Seed: {s['seed']}, Size: "
                  f"{s['width']}x{s['height']}, Model: {s['model']}")
    if "strength" in s:
        parameters += f", Denoising strength: {s['strength']}"
    if "refiner" in s:  # as A1111 writes its refiner
        parameters += f", Refiner: {s['refiner']}, Refiner switch at: {s['high_noise_frac']}"
    for k, (net, scale) in enumerate(zip(s.get("controlnet", ()), s.get("control_scale", ()))):
        parameters += f', ControlNet {k}: "Model: {net}, Weight: {scale}"'  # as A1111's ControlNet extension
    info.add_text("parameters", parameters)
    return info


def _a1111_name(scheduler):
    """A1111's name of the sampler and its σ schedule, else sdflax's name."""
    from .schedulers import a1111_name

    return a1111_name(scheduler) or _scheduler_name(scheduler)


def _scheduler_name(scheduler):
    from .schedulers import SCHEDULERS

    return next((name for name, cls in SCHEDULERS.items() if type(scheduler) is cls), type(scheduler).__name__)


def _version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sdflax")
    except PackageNotFoundError:
        return "unknown"
