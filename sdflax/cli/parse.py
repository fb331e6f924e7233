"""The command line's flags: argparse types that refuse bad values in one line, and the parser of generate,
img2img and inpaint (batch adds its command with `add_options`)."""

from __future__ import annotations

import argparse
import re

from .. import cache
from ..utils import is_float32
from .output import sdflax_version
from .request import DEFAULT_MODEL


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # "--guidance -1e6": a number, not an option (argparse's own pattern misses exponents)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message):  # one line instead of argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
fraction = number(lambda v: 0 < v < 1, "must be in (0, 1), got {text}: the fraction of the schedule the base runs "
                  "before the refiner takes over (e.g. 0.8)")
adapter_factor = number(lambda v: 0 <= v <= 1, "must be in [0, 1], got {value}: the fraction of the steps the "
                        "T2I-Adapters steer, the first ones (1: every step, 0: none)")
# NaN or inf guidance, or 1e39 (inf in float32, the programs' type): a black image
finite = number(is_float32, "must be a finite number (as float32, the type the programs compute in), got "
                "{text!r}")


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


IP_ADAPTER_SUFFIXES = (".safetensors", ".bin")  # h94's files; diffusers reads nothing else as an IP-Adapter


def ip_adapter_argument(text):
    """ID_OR_FILE[:SCALE] -> (ID_OR_FILE, SCALE): an IP-Adapter is a .safetensors or .bin file, so a ':' after that
    suffix starts the scale."""
    name, colon, tail = text.rpartition(":")
    if not (colon and name.lower().endswith(IP_ADAPTER_SUFFIXES)):
        name, tail = text, None
    if not name.lower().endswith(IP_ADAPTER_SUFFIXES):
        raise argparse.ArgumentTypeError(f"{text!r:.80} is not an IP-Adapter file (.safetensors or .bin): give its "
                                         "path or hub file, e.g. h94/IP-Adapter/models/ip-adapter_sd15.safetensors")
    if tail is None:
        return name, 1.0
    if not is_number(tail):
        raise argparse.ArgumentTypeError(f"{text}: the scale {tail!r} is not a number: write ID_OR_FILE:SCALE with a "
                                         f"number, e.g. {name}:0.6")
    if not is_float32(float(tail)):
        raise argparse.ArgumentTypeError(f"{text}: the scale must be a finite float32 number (1 is the adapter's "
                                         "full strength, 0 turns it off)")
    return name, float(tail)


def layer_list(text):
    """"7,8,9" -> (7, 8, 9): transformer block indices."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected block indices separated by commas (SD 3.5 Medium: 7,8,9), got "
                                         f"{text!r:.60}")
    return tuple(int(part) for part in parts)


def sequence_length(text):
    from ..pipeline.sd3_text import MAX_SEQUENCE_LENGTH

    value = positive_int(text)
    if value > MAX_SEQUENCE_LENGTH:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SEQUENCE_LENGTH} (T5's longest), got {value}")
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


def guider_name(text):
    """A guider's short name ("apg") or diffusers' class name."""
    from ..guiders.names import guider_class

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


def build_parser(*more) -> argparse.ArgumentParser:
    """generate, img2img and inpaint; `more`: `add_command(subparsers)` functions of other commands (batch's)."""
    parser = Parser(prog="sdflax", description="Stable Diffusion in JAX/Flax.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {sdflax_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = " Images are spread over all local devices; image i uses seed S+i."
    g = commands.add_parser("generate", help="text -> PNG images", description="Generate images from a prompt and "
                            "write them as PNGs that carry their settings." + common)
    g.add_argument("prompt", type=prompt_text, help="what to draw")
    g.add_argument("--refiner", metavar="ID_OR_DIR", help="an SDXL refiner (hub id or diffusers folder) that "
                   "finishes an SDXL base model's images: the base runs the first --high-noise-frac of the schedule "
                   "and hands its latents to the refiner, which runs the rest of the --steps and decodes (diffusers' "
                   "ensemble of expert denoisers); it reads --prompt and --negative-prompt (its one text encoder), "
                   "--lora and --embedding apply to the base")
    g.add_argument("--high-noise-frac", type=fraction, metavar="F", help="with --refiner: the fraction of the "
                   "schedule the base runs, in (0, 1) (default: 0.8)")
    add_options(g)

    i = commands.add_parser("img2img", help="image + text -> PNG images", description="Redraw an image after a "
                            "prompt (SDEdit): the image is noised as far as --strength says, then denoised." + common)
    i.add_argument("prompt", type=prompt_text, help="what to draw")
    i.add_argument("--image", required=True, metavar="IN.png", help="the picture to start from")
    i.add_argument("--strength", type=strength, help="how far to noise the image, in (0, 1]: 1 repaints "
                   "everything, small values keep the image; runs int(steps * strength) steps (default: the "
                   "pipeline's, as diffusers: 0.8; 0.3 for SDXL, 0.6 for SD 3.x)")
    add_options(i, image=True)

    p = commands.add_parser("inpaint", help="image + mask + text -> PNG images", description="Repaint the white part "
                            "of a mask after a prompt and keep the black part (an inpainting checkpoint, or any "
                            "other: the kept part is pasted back after every step)." + common)
    p.add_argument("prompt", type=prompt_text, help="what to draw in the masked region")
    p.add_argument("--image", required=True, metavar="IN.png", help="the picture to repaint")
    p.add_argument("--mask", required=True, metavar="MASK.png", help="greyscale, the image's size: white is "
                   "repainted, black kept (binarised at 0.5)")
    p.add_argument("--strength", type=strength, help="in (0, 1]: 1 starts the masked region from pure noise, "
                   "smaller values from the noised image (default: the pipeline's, as diffusers: 1; 0.9999 for SDXL, "
                   "0.6 for SD 3.x)")
    add_options(p, image=True)
    for add_command in more:
        add_command(commands)
    return parser


def add_options(command, image=False, exclude=()):
    """The options all commands share (but those named in `exclude`: `sdflax batch` has its own --out)."""
    from ..models.layers import ATTENTION_IMPLEMENTATIONS

    def add(flag, **kwargs):
        if flag not in exclude:
            command.add_argument(flag, **kwargs)

    text = dict(type=prompt_text, metavar="TEXT")
    add("--negative-prompt", default="", help="what to steer away from", **text)
    add("--prompt-2", help="SDXL and SD 3.x: the prompt of the second text encoder (default: the prompt)", **text)
    add("--negative-prompt-2", help="SDXL and SD 3.x: the negative prompt of the second text encoder (default: the "
        "negative prompt)", **text)
    add("--prompt-3", help="SD 3.x: the prompt of the third text encoder, T5 (default: the prompt)", **text)
    add("--negative-prompt-3", help="SD 3.x: the negative prompt of T5 (default: the negative prompt)", **text)
    add("--model", default=DEFAULT_MODEL, metavar="ID_DIR_OR_FILE",
        help=f"hub id, local diffusers folder, or one .safetensors/.ckpt file (SD 1.x, 2.x, SDXL base or SD 3.x, told "
             f"apart by its tensor names) (default: {DEFAULT_MODEL})")
    add("--revision", metavar="REV", help="hub branch, tag or commit (default: main)")
    add("--config", metavar="ID_OR_DIR", help="with a single-file --model: a diffusers folder or hub id of the "
        "same architecture, for the model, scheduler and tokenizer configs, and the models an SD 3.x file lacks "
        "(default: sdflax's bundled SD 1.5, SD 2.1 (768 px, v-prediction), SDXL base, SD 3 / 3.5 Medium or 3.5 Large "
        "configs)")
    add("--lora", action="append", default=[], type=lora_argument, metavar="PATH[:SCALE]",
        help="a LoRA file (kohya/A1111 or diffusers/PEFT) merged into the model at SCALE (default: 1.0); repeat for "
             "several, merged in order. A file whose name ends in :NUMBER needs its :SCALE written out")
    add("--embedding", action="append", default=[], metavar="PATH",
        help="a textual-inversion embedding (A1111 .pt/.safetensors, diffusers learned_embeds); its token is the "
             "file name without the extension, as in A1111: write it in the prompt; repeat for several")
    add("--scheduler", type=scheduler_argument, metavar="NAME", help="sampler: sdflax's name (dpmpp_2m, "
        "euler_ancestral, ...) or A1111's (\"DPM++ 2M Karras\", \"Euler a\", \"UniPC\", ...) (default: the "
        "checkpoint's own)")
    add("--steps", type=positive_int, help="denoising steps (default: the pipeline's, as diffusers: 50; 28 for SD 3.x "
        "generate)")
    add("--guidance", type=finite, default=None, metavar="SCALE",
        help="classifier-free guidance scale (default: the pipeline's, as diffusers: 7.5; 5.0 for SDXL but its "
             "inpaint; 7.0 for SD 3.x)")
    add("--no-t5", action="store_true", help="SD 3.x: load without T5, the third text encoder (its states zeros, "
        "as diffusers' text_encoder_3=None): less memory, less faithful text")
    add("--max-sequence-length", type=sequence_length, metavar="N", help="SD 3.x: T5's tokens, at most 512 "
        "(default: 256, as diffusers)")
    add("--slg-layers", type=layer_list, default=(), metavar="I,J,...", help="SD 3.x: skip-layer guidance, an "
        "extra pass without these transformer blocks steering away from it (SD 3.5 Medium: 7,8,9), as diffusers' "
        "skip_guidance_layers")
    add("--slg-scale", type=finite, metavar="S", help="with --slg-layers: its scale (default: 2.8, as diffusers)")
    add("--guider", type=guider_name, metavar="NAME",
        help="a guider in place of plain classifier-free guidance: cfg, apg, apg_mix, cfg_zero_star, tcfg, mag, fdg, "
             "pag, seg, slg, autoguidance (or diffusers' class names); its guidance scale is --guidance's")
    add("--guider-arg", action="append", default=[], type=guider_argument, metavar="KEY=VALUE",
        help="an argument of --guider by diffusers' name or its last words (momentum=-0.5 for "
             "adaptive_projected_guidance_momentum, start=0.2, eta=0; the layers pag, seg, slg and autoguidance "
             "perturb as config=FQN:INDICES, e.g. config=mid_block.attentions.0.transformer_blocks:0); repeat for "
             "several")
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
    add("--controlnet", action="append", default=[], metavar="ID_OR_PATH",
        help="a ControlNet to steer by --control-image: hub id, diffusers folder, or an original-layout "
             ".safetensors/.pth file (SD 1.x/2.x); repeat for several nets")
    add("--controlnet-config", action="append", default=[], metavar="ID_OR_DIR",
        help="a diffusers ControlNet folder or hub id of the same architecture as an original-layout --controlnet "
             "file, for its config; one per such file, in their order; needed where the tensors do not tell the "
             "architecture (SDXL nets, the shuffle net)")
    add("--control-image", action="append", default=[], metavar="IMG",
        help="the condition image (edges, pose, depth, ...) of each --controlnet, in their order; resized to the "
             "output size")
    add("--control-scale", action="append", default=[], type=float, metavar="S",
        help="how strongly the nets steer: one value for all or one per net (default: the pipeline's, as diffusers: "
             "1.0 for generate, 0.8 for img2img, 0.5 for inpaint)")
    add("--ip-adapter", action="append", default=[], type=ip_adapter_argument, metavar="ID_OR_FILE[:SCALE]",
        help="an IP-Adapter steering by an image prompt (--ip-image) at SCALE (default: 1.0): an h94-layout "
             ".safetensors/.bin file, its CLIP image encoder in image_encoder/ beside it, or a hub file "
             "org/name/subfolder/file (h94/IP-Adapter/models/ip-adapter_sd15.safetensors); repeat for several, "
             "from one folder")
    add("--ip-image", action="append", default=[], metavar="IMG",
        help="the image prompt of each --ip-adapter, in their order")
    add("--ip-image-encoder", metavar="ID_OR_DIR",
        help="the --ip-adapter files' CLIP image encoder where it is not image_encoder/ beside them: a folder, hub "
             "id, or hub folder org/name/subfolder (h94's SDXL vit-h adapters: h94/IP-Adapter/models/image_encoder)")
    add("--t2i-adapter", action="append", default=[], metavar="ID_OR_DIR",
        help="a T2I-Adapter steering by --adapter-image (a sketch, edges, depth, pose, ...): a diffusers T2IAdapter "
             "folder or hub id (TencentARC/t2iadapter_canny_sd15v2, TencentARC/t2i-adapter-canny-sdxl-1.0); repeat "
             "for several")
    add("--adapter-image", action="append", default=[], metavar="IMG",
        help="the picture of each --t2i-adapter, in their order, grey for a one-channel adapter; resized to the "
             "output size, which the first one sets where no --height and --width, --image or --control-image do")
    add("--adapter-scale", action="append", default=[], type=finite, metavar="S",
        help="how strongly the T2I-Adapters steer: one value for all or one per adapter (default: 1.0)")
    add("--adapter-factor", type=adapter_factor, metavar="F",
        help="SDXL: the fraction of the steps, the first ones, the T2I-Adapters steer, in [0, 1] (default: 1.0)")
    add("--out", default="outputs", metavar="PATH",
        help="a folder (default: outputs/), or NAME.png: the image, or the grid when there are several")
    add("--grid", action="store_true", help="also write all images as one grid PNG")
    add("--progress", action=argparse.BooleanOptionalAction, default=None,
        help="--progress adds a per-step bar to the status lines and download bars (its program is compiled on "
        "every run: JAX keeps no program with a host callback in its disk cache); --no-progress prints only the "
        "results (default: status lines and download bars)")
    add("--cache-dir", metavar="DIR", help=f"compiled programs, reused by later runs (default: ${cache.CACHE_ENV} "
        f"or ~/.cache/sdflax/jax; {cache.CACHE_ENV}={cache.OFF} keeps none)")
