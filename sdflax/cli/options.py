"""The parser of generate, img2img and inpaint (batch adds its command with `add_options`): the options every
command shares, and each feature's (`features.FEATURES`)."""

from __future__ import annotations

import argparse
import re

from .. import cache
from .parse import num_images, positive_int, prompt_text, scale, scheduler_argument, seed, strength
from .features import FEATURES
from .request import DEFAULT_MODEL

# sdflax.models.layers.ATTENTION_IMPLEMENTATIONS, written out so that --help and argument errors start without JAX
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas")


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # "--guidance -1e6": a number, not an option (argparse's own pattern misses exponents)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message):  # one line instead of argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(*more) -> argparse.ArgumentParser:
    """generate, img2img and inpaint; `more`: `add_command(subparsers)` functions of other commands (batch's)."""
    from .output import sdflax_version

    parser = Parser(prog="sdflax", description="Stable Diffusion in JAX/Flax.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {sdflax_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = " Images are spread over all local devices; image i uses seed S+i."
    g = commands.add_parser("generate", help="text -> PNG images", description="Generate images from a prompt and "
                            "write them as PNGs that carry their settings." + common)
    g.add_argument("prompt", type=prompt_text, help="what to draw")
    add_options(g, "generate")

    i = commands.add_parser("img2img", help="image + text -> PNG images", description="Redraw an image after a "
                            "prompt (SDEdit): the image is noised as far as --strength says, then denoised." + common)
    i.add_argument("prompt", type=prompt_text, help="what to draw")
    i.add_argument("--image", required=True, metavar="IN.png", help="the picture to start from")
    i.add_argument("--strength", type=strength, help="how far to noise the image, in (0, 1]: 1 repaints "
                   "everything, small values keep the image; runs int(steps * strength) steps (default: the "
                   "pipeline's, as diffusers: 0.8; 0.3 for SDXL, 0.6 for SD 3.x and Flux.1)")
    add_options(i, "img2img", image=True)

    p = commands.add_parser("inpaint", help="image + mask + text -> PNG images", description="Repaint the white part "
                            "of a mask after a prompt and keep the black part (an inpainting checkpoint, or any "
                            "other: the kept part is pasted back after every step)." + common)
    p.add_argument("prompt", type=prompt_text, help="what to draw in the masked region")
    p.add_argument("--image", required=True, metavar="IN.png", help="the picture to repaint")
    p.add_argument("--mask", required=True, metavar="MASK.png", help="greyscale, the image's size: white is "
                   "repainted, black kept (binarised at 0.5)")
    p.add_argument("--strength", type=strength, help="in (0, 1]: 1 starts the masked region from pure noise, "
                   "smaller values from the noised image (default: the pipeline's, as diffusers: 1; 0.9999 for SDXL, "
                   "0.6 for SD 3.x and Flux.1, 1 for Flux.1 Fill)")
    add_options(p, "inpaint", image=True)
    for add_command in more:
        add_command(commands)
    return parser


def add_options(parser, command, image=False, exclude=()):
    """The options of `command` (generate, img2img, inpaint, batch): those all commands share (but those named in
    `exclude`: `sdflax batch` has its own --out), and each feature's."""
    def add(flag, **kwargs):
        if flag not in exclude:
            parser.add_argument(flag, **kwargs)

    text = dict(type=prompt_text, metavar="TEXT")
    add("--negative-prompt", default="", help="what to steer away from", **text)
    add("--prompt-2", help="SDXL, SD 3.x and Flux.1 (T5's): the prompt of the second text encoder (default: the "
        "prompt)", **text)
    add("--negative-prompt-2", help="SDXL, SD 3.x and Flux.1: the negative prompt of the second text encoder "
        "(default: the negative prompt)", **text)
    add("--model", default=DEFAULT_MODEL, metavar="ID_DIR_OR_FILE",
        help=f"hub id, local diffusers folder, or one .safetensors/.ckpt file (SD 1.x, 2.x, SDXL base, SD 3.x or a "
             f"FLUX.1 transformer, told apart by its tensor names) (default: {DEFAULT_MODEL})")
    add("--revision", metavar="REV", help="hub branch, tag or commit (default: main)")
    add("--config", metavar="ID_OR_DIR", help="with a single-file --model: a diffusers folder or hub id of the "
        "same architecture, for the model, scheduler and tokenizer configs, and the models an SD 3.x or FLUX.1 file "
        "lacks (default: sdflax's bundled SD 1.5, SD 2.1 (768 px, v-prediction), SDXL base, SD 3 / 3.5 Medium or 3.5 "
        "Large configs; none for FLUX.1)")
    add("--scheduler", type=scheduler_argument, metavar="NAME", help="sampler: sdflax's name (dpmpp_2m, "
        "euler_ancestral, ...) or A1111's (\"DPM++ 2M Karras\", \"Euler a\", \"UniPC\", ...) (default: the "
        "checkpoint's own)")
    add("--steps", type=positive_int, help="denoising steps (default: the pipeline's, as diffusers: 50; 28 for SD 3.x "
        "generate and Flux.1 but Fill's; 4 for Flux.1 schnell)")
    add("--guidance", type=scale, default=None, metavar="SCALE",
        help="classifier-free guidance scale (default: the pipeline's, as diffusers: 7.5; 5.0 for SDXL but its "
             "inpaint; 7.0 for SD 3.x); Flux.1: the guidance dev was distilled to take (default: 3.5; 7.0 for img2img "
             "and inpaint, 30 for Fill; schnell takes none)")
    if image:
        add("--height", type=positive_int, metavar="H", help="resize the picture to H pixels high, a multiple of the "
            "VAE scale factor (default: its height, rounded down to a multiple)")
        add("--width", type=positive_int, metavar="W", help="resize the picture to W pixels wide (default: its "
            "width, rounded down to a multiple)")
    else:
        add("--height", type=positive_int, metavar="H", help="image height in pixels, a multiple of the VAE scale "
            "factor (default: the model's own, 512 for SD 1.x)")
        add("--width", type=positive_int, metavar="W", help="image width in pixels (default: the model's own)")
    add("--seed", type=seed, help="seed of the first image (default: random, printed and saved)")
    add("--num-images", type=num_images, metavar="N",
        help="images to keep (default: one per device; computed in multiples of the device count)")
    add("--dtype", choices=("bfloat16", "float32"),
        help="weights and activations (default: bfloat16 on an accelerator, float32 on the CPU)")
    add("--attention", choices=ATTENTION_IMPLEMENTATIONS, default="auto",
        help="UNet attention: cuDNN flash attention where it runs (NVIDIA GPU, bfloat16), Pallas flash attention "
             "where it runs (TPU, layers of multiples of 128 tokens), else XLA (auto, the default), or one forced")
    for feature in FEATURES:
        if hasattr(feature, "add_flags"):
            feature.add_flags(add, command)
    add("--out", default="outputs", metavar="PATH",
        help="a folder (default: outputs/), or NAME.png: the image, or the grid when there are several")
    add("--grid", action="store_true", help="also write all images as one grid PNG")
    add("--progress", action=argparse.BooleanOptionalAction, default=None,
        help="status lines, download bars and a per-step bar, which the clock moves at the pace of the program's "
        "last run (default: the bar on a terminal only); --no-progress prints only the results")
    add("--cache-dir", metavar="DIR", help=f"compiled programs, reused by later runs (default: ${cache.CACHE_ENV} "
        f"or ~/.cache/sdflax/jax; {cache.CACHE_ENV}={cache.OFF} keeps none)")
