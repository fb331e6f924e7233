"""--ip-adapter, --ip-image and --ip-image-encoder: IP-Adapters steering by image prompts. Where the adapter files
and their image encoder are (checked before anything loads), the adapters loaded as diffusers' `load_ip_adapter`
loads them, and each row's image prompts as the pipeline takes them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from ...utils import is_float32
from ..parse import is_number
from ..pictures import read_picture
from ..manifest import quoted
from ..request import UserError

FLAG = "--ip-adapter"
DENOISERS = ("unet",)
FAMILIES = ("flux", "sd3")  # XLabs' Flux.1 IP-Adapter and InstantX's SD 3.5 Large one too (`load_ip_adapter`)
IP_ADAPTER_SUFFIXES = (".safetensors", ".bin")  # h94's files; diffusers reads nothing else as an IP-Adapter


def add_flags(add, command):
    add("--ip-adapter", action="append", default=[], type=ip_adapter_argument, metavar="ID_OR_FILE[:SCALE]",
        help="an IP-Adapter steering by an image prompt (--ip-image) at SCALE (default: 1.0): an h94-layout "
             ".safetensors/.bin file (Flux.1: XLabs', SD 3.5 Large: InstantX'), its image encoder in image_encoder/ "
             "beside it (CLIP's; SD 3.5: SigLIP's), or a hub "
             "file org/name/subfolder/file (h94/IP-Adapter/models/ip-adapter_sd15.safetensors); repeat for several, "
             "from one folder")
    add("--ip-image", action="append", default=[], metavar="IMG",
        help="the image prompt of each --ip-adapter, in their order")
    add("--ip-image-encoder", metavar="ID_OR_DIR",
        help="the --ip-adapter files' CLIP image encoder where it is not image_encoder/ beside them: a folder, hub "
             "id, or hub folder org/name/subfolder (h94's SDXL vit-h adapters: h94/IP-Adapter/models/image_encoder; "
             "XLabs' Flux.1 adapter: openai/clip-vit-large-patch14; InstantX' SD 3.5 one: "
             "google/siglip-so400m-patch14-384)")


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


def used(request) -> bool:
    return bool(request.ip_adapter)


def check_flags(request, batch):
    """A batch's lines may give their image prompts (`check_line_images`)."""
    check_ip_adapters(request, every_image=not batch)


def check_configs(request, configs):
    check_ip_adapter_width(request, configs.denoiser)


def load(request, pipeline, params, dtype):
    return load_ip_adapters(request, pipeline, params)


def call_arguments(pipeline, value, rows) -> tuple[list, dict]:
    return [], ip_adapter_inputs(pipeline, rows)


def settings(request, checkpoint) -> dict:
    """Lists, one entry per adapter in their order (JSON in the PNG)."""
    if not request.ip_adapter:
        return {}
    values = {"ip_adapter": [name for name, _ in request.ip_adapter], "ip_image": list(request.ip_image),
              "ip_adapter_scale": [scale for _, scale in request.ip_adapter]}
    if request.ip_image_encoder is not None:
        values["ip_image_encoder"] = request.ip_image_encoder
    return values


def parameters(s) -> str:
    """A1111 has no entry of its own for it."""
    if "ip_adapter" not in s:
        return ""
    adapters = ", ".join(f"{name} ({scale})" for name, scale in zip(s["ip_adapter"], s["ip_adapter_scale"]))
    return f", IP-Adapter: {quoted(adapters)}, IP-Adapter image: {quoted(', '.join(s['ip_image']))}"



@dataclasses.dataclass(frozen=True)
class Place:
    """Where one --ip-adapter is, as `load_ip_adapter` takes it: a folder or hub repo, its subfolder, the file."""

    source: str
    subfolder: str
    weight_name: str
    local: bool


def adapter_place(name) -> Place:
    """A local file (its folder, no subfolder: the image encoder is image_encoder/ beside it), else a hub file
    org/name/[subfolder/]file; a name whose folder is here is a local file that is missing."""
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        return Place(os.path.dirname(os.path.abspath(path)), "", os.path.basename(path), True)
    parts = name.split("/")
    local = name.startswith((".", "/", "~")) or "\\" in name or os.path.isdir(os.path.dirname(path))
    if local or len(parts) < 3 or "" in parts:
        raise UserError(f"--ip-adapter {name}: no such file: give the path of an IP-Adapter file (its image encoder "
                        "in image_encoder/ beside it) or a hub file org/name/subfolder/file.safetensors")
    return Place("/".join(parts[:2]), "/".join(parts[2:-1]), parts[-1], False)


def check_ip_adapters(request, every_image=True):
    """The IP-Adapter flags agree, the files are there, in one folder, with their image encoder, and (with
    `every_image`, as generate takes them) one readable --ip-image per adapter; `sdflax batch` lines may give
    theirs (`check_line_images`)."""
    adapters, images = request.ip_adapter, request.ip_image
    if not adapters:
        for flag, value in (("--ip-image", images), ("--ip-image-encoder", request.ip_image_encoder)):
            if value:
                raise UserError(f"{flag} applies with --ip-adapter (the image prompt's adapter): add --ip-adapter "
                                "ID_OR_FILE, or leave it out")
        return
    if len(images) != len(adapters) and (every_image or images):
        raise UserError(f"{len(adapters)} --ip-adapter and {len(images)} --ip-image: give one --ip-image per "
                        "--ip-adapter, in the same order")
    for path in images:
        read_picture("--ip-image", path)
    places = [adapter_place(name) for name, _ in adapters]
    for (name, _), place in zip(adapters[1:], places[1:]):
        if (place.source, place.subfolder) != (places[0].source, places[0].subfolder):
            raise UserError(f"--ip-adapter {adapters[0][0]} and --ip-adapter {name} are in different places: several "
                            "IP-Adapters load from one folder (or hub repo and subfolder), as diffusers' "
                            "load_ip_adapter takes them: put their files in one folder")
    if request.ip_image_encoder is not None:
        encoder_folder(request.ip_image_encoder)
        return
    place, name = places[0], adapters[0][0]
    encoder = "/".join(filter(None, (place.subfolder, "image_encoder", "config.json")))
    folder = place.source if place.local else hub_folder(f"--ip-adapter {name}", place.source, [encoder])
    if not os.path.isfile(os.path.join(folder, encoder)):
        raise UserError(f"--ip-adapter {name}: no image encoder beside it ({encoder}, as in h94's repository): give "
                        "its folder with --ip-image-encoder")


def check_ip_adapter_width(request, unet):
    """A local adapter file was made for the checkpoint's family: the width of its first to_k_ip kernel is the
    UNet's text width (its header, or its pickle's tensor records: nothing is read)."""
    from ...loading.files import read_safetensors, read_torch_object

    if not hasattr(unet, "cross_attention_dim"):
        return  # a transformer's adapter (Flux.1's, SD 3.5's): its shapes are checked as it loads
    for name, _ in request.ip_adapter:
        path = os.path.expanduser(name)
        if not os.path.isfile(path):
            continue  # a hub file: checked once it is downloaded
        try:
            if path.lower().endswith(".safetensors"):
                kernel = read_safetensors(path).get("ip_adapter.1.to_k_ip.weight")
            else:
                tensors = read_torch_object(path)
                kernel = tensors.get("ip_adapter", {}).get("1.to_k_ip.weight") if isinstance(tensors, dict) else None
        except (OSError, ValueError) as e:  # CheckpointFileError: not a file of tensors
            raise UserError(f"--ip-adapter {name}: {e}") from e
        if getattr(kernel, "ndim", 0) == 2 and kernel.shape[1] != unet.cross_attention_dim:  # else: told at load
            raise UserError(f"--ip-adapter {name} was made for another model family than {request.model} (text width "
                            f"{kernel.shape[1]} vs {unet.cross_attention_dim}): use an IP-Adapter made for this base "
                            "model")


def encoder_folder(name, weights=False) -> str:
    """--ip-image-encoder as a local folder: a folder as it is, a hub id or a hub folder org/name/subfolder
    downloaded (its config.json, and with `weights` its weights: .safetensors, else .bin)."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        folder = os.path.abspath(path)
    else:
        parts = name.split("/")
        if name.startswith((".", "/", "~")) or "\\" in name or len(parts) < 2 or "" in parts:
            raise UserError(f"--ip-image-encoder {name}: no such folder: give the folder of a CLIP image encoder, a "
                            "hub id, or a hub folder org/name/subfolder")
        repo, prefix = "/".join(parts[:2]), "".join(f"{part}/" for part in parts[2:])
        flag = f"--ip-image-encoder {name}"
        patterns = [f"{prefix}config.json"] + ([f"{prefix}*.safetensors"] if weights else [])
        folder = os.path.join(hub_folder(flag, repo, patterns), *parts[2:])
        if weights and os.path.isdir(folder) and not any(file.endswith(".safetensors") for file in os.listdir(folder)):
            hub_folder(flag, repo, [f"{prefix}config.json", f"{prefix}*.bin"])
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise UserError(f"--ip-image-encoder {name}: no config.json in it: give the folder of a CLIP image encoder "
                        "(transformers' CLIPVisionModelWithProjection)")
    return folder


def hub_folder(flag, repo, patterns) -> str:
    from ...loading.hub import ModelNotFoundError, resolve_folder

    try:
        return resolve_folder(repo, allow_patterns=patterns)
    except ModelNotFoundError as e:
        raise UserError(f"{flag}: {e}") from e


def load_ip_adapters(request, pipeline, params):
    """(pipeline, params) with the --ip-adapter files and their image encoder."""
    places = [adapter_place(name) for name, _ in request.ip_adapter]
    encoder = "image_encoder" if request.ip_image_encoder is None else encoder_folder(request.ip_image_encoder, True)
    try:
        return pipeline.load_ip_adapter(params, places[0].source, subfolder=places[0].subfolder,
                                        weight_name=[place.weight_name for place in places],
                                        image_encoder_folder=encoder)
    except (OSError, ValueError) as e:  # a file that is not an IP-Adapter, or not this UNet's
        raise UserError(f"--ip-adapter {', '.join(name for name, _ in request.ip_adapter)}: {e}") from e


def ip_adapter_inputs(pipeline, rows) -> dict:
    """The call's `ip_adapter_image` (per adapter, each row's image prompt as CLIP pixels) and `ip_adapter_scale`;
    each picture is read once."""
    import numpy as np

    if not rows[0].ip_adapter:
        return {}
    pixels = {path: encoder_pixels(pipeline, path) for path in {path for row in rows for path in row.ip_image}}
    images = [np.concatenate([pixels[row.ip_image[a]] for row in rows]) for a in range(len(rows[0].ip_adapter))]
    return {"ip_adapter_image": images, "ip_adapter_scale": [scale for _, scale in rows[0].ip_adapter]}


def encoder_pixels(pipeline, path):
    """One --ip-image as the image encoder's pixels; a picture the encoder's resize cannot take (a strip far from
    square, known once the encoder's size is) is refused naming the file."""
    try:
        return pipeline.prepare_ip_adapter_image(read_picture("--ip-image", path).convert("RGB"))
    except ValueError as e:
        raise UserError(f"--ip-image {path}: {e}") from None


# ---- sdflax batch: a line's own image prompts ------------------------------------------------------------------

def line_images(where, value, count) -> tuple:
    """A prompt line's `ip_image`: a path, or a list of one per --ip-adapter."""
    paths = [value] if isinstance(value, str) else value
    if not (isinstance(paths, list) and paths and all(isinstance(p, str) and p for p in paths)):
        raise UserError(f'{where}: ip_image must be a path or a list of paths, got {json.dumps(value):.60}')
    if count == 0:
        raise UserError(f"{where}: ip_image applies with --ip-adapter (the image prompt's adapter): add --ip-adapter "
                        "ID_OR_FILE to the command, or drop it")
    if len(paths) != count:
        raise UserError(f"{where}: {len(paths)} ip_image for {count} --ip-adapter: give a list of one per adapter, in "
                        "their order")
    return tuple(paths)


def check_line_images(base, lines, prompts):
    """Every line has its image prompts (its own, or --ip-image), each picture readable; a mistake names the
    line."""
    if not base.ip_adapter:
        return
    read = set()
    for line in lines:
        where = f"PROMPTS {prompts} line {line.number}"
        paths = line.ip_image or base.ip_image
        if not paths:
            raise UserError(f'{where}: no ip_image and no --ip-image: give the line an "ip_image" or the command '
                            "an --ip-image per --ip-adapter")
        for path in paths:
            if path not in read:
                try:
                    read_picture("--ip-image" if path in base.ip_image else "ip_image", path)
                except UserError as e:
                    raise UserError(f"{where}: {e}") from e
                read.add(path)
