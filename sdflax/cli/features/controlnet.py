"""--controlnet, --controlnet-config, --control-image, --control-scale and --control-mode: ControlNets steering by
condition pictures (edges, pose, depth, ...), from hub ids, diffusers folders or original-layout files; each net's
config checked against the checkpoint's denoiser before anything loads (SD 3.x: text-to-image, and inpainting by its
inpainting net, which reads --image and --mask). Flux.1's nets (diffusers folders) are checked by the family's
command-line side (`families/flux_cli.py`), which also runs a Flux Control checkpoint (Canny / Depth dev) on
--control-image alone."""

from __future__ import annotations

import dataclasses
import os

from ...utils import is_float32
from ..pictures import check_counts, read_picture
from ..request import STARTS, UserError, flag_error

FLAG = "--controlnet"
DENOISERS = ("unet",)
FAMILIES = ("sd3", "flux")  # SD 3.x's ControlNets (SD3ControlNetModel) and Flux.1's, as diffusers has them
# config.json's _class_name of the nets sdflax reads
NET_CLASSES = ("ControlNetModel", "SD3ControlNetModel", "FluxControlNetModel")


@dataclasses.dataclass(frozen=True)
class Controls:
    """The --control-image pictures (RGB, at the output size) and one scale per net."""

    pictures: tuple
    scales: tuple
    modes: tuple = ()  # a Flux Union net's mode per picture (-1: none), where --control-mode gives them


def add_flags(add, command):
    if command == "batch":  # a batch's lines share no picture
        return
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
    add("--control-mode", action="append", default=[], type=int, metavar="N",
        help="a Flux Union ControlNet's mode of each --control-image, the kind of picture (its model card lists "
             "them, e.g. 0 canny); one per --control-image")
    add("--control-scale", action="append", default=[], type=float, metavar="S",
        help="how strongly the nets steer: one value for all or one per net (default: the pipeline's, as diffusers: "
             "1.0 for generate, 0.8 for img2img, 0.5 for inpaint)")


def used(request) -> bool:
    return bool(request.controlnet or request.control_image)


def check_flags(request, batch):
    """The flags agree, the scales are finite, the pictures readable."""
    nets, images, scales = request.controlnet, request.control_image, request.control_scale
    if scales and not nets:
        raise UserError("--control-scale without --controlnet: it says how strongly the nets steer; add "
                        "--controlnet and --control-image, or leave it out")
    if request.control_mode and not nets:
        raise UserError("--control-mode without --controlnet: it is a Union ControlNet's mode; add --controlnet, "
                        "or leave it out")
    if not nets and not images:
        return
    if not nets and len(images) == 1:  # a Flux Control checkpoint's picture (check_configs says if it is not)
        pictures(request)
        return
    # inpaint without --control-image: an inpainting ControlNet's (SD 3.x's) pictures are --image and --mask, and
    # the checkpoint's net says whether it is one (check_configs)
    given = nets if request.command == "inpaint" and not images else images
    check_counts(nets, "--controlnet", given, "--control-image", scales, "--control-scale", "nets")
    for scale in scales:
        if not is_float32(scale):
            raise UserError(f"--control-scale {scale}: give a finite float32 number (1 steers fully, 0 not at all)")
    pictures(request)


def pictures(request) -> tuple:
    return "--control-image", request.control_image, tuple(read_picture("--control-image", path).convert("RGB")
                                                             for path in request.control_image)


def pipeline_class(request, family, cls):
    if not request.controlnet:  # Flux Control: the checkpoint's own class reads the picture
        return cls
    try:
        return family.pipeline_class(request.start, True)
    except ValueError:  # a cell the family lacks (SD 3.x's image-to-image, as diffusers')
        what = {"noise": "text-to-image", "image": "image-to-image", "image_mask": "inpainting"}[request.start]
        commands = " and ".join(f"sdflax {command}" for command, start in STARTS.items() if has_cell(family, start))
        raise UserError(f"--controlnet with {family.title} checkpoints is for {commands}: sdflax has no "
                        f"{family.title} ControlNet {what} pipeline, as diffusers 0.39 has none") from None


def has_cell(family, start) -> bool:
    """Whether the family has a ControlNet pipeline of that start."""
    try:
        return bool(family.pipeline_class(start, True))
    except ValueError:
        return False


def controlnet_configs(request) -> tuple:
    """Each --controlnet's --controlnet-config: the original-layout files take them in order, the others None."""
    files = [os.path.isfile(os.path.expanduser(name)) for name in request.controlnet]
    given = request.controlnet_config
    if given and not any(files):
        raise UserError("--controlnet-config applies to original-layout --controlnet files (.safetensors, .pth), but "
                        "no --controlnet is one: drop --controlnet-config (a folder or hub id has its config.json)")
    if given and len(given) != sum(files):
        raise UserError(f"{len(given)} --controlnet-config for {sum(files)} original-layout --controlnet files: give "
                        "one per file, in their order")
    configs = iter(given)
    return tuple(next(configs) if is_file and given else None for is_file in files)


def check_configs(request, configs):
    """Each --controlnet exists and, where its config.json can be read (a folder's, a hub id's or an original-layout
    file's --controlnet-config: kilobytes), was made for the checkpoint's model family and latent size. An
    original-layout file without one is checked when it loads."""
    from ...loading.hub import ModelNotFoundError, resolve_folder
    from ...models.config import read_config_file
    from ...pipeline.controlnet import ControlNet, condition_scale_mismatch
    from ...pipeline.core import control_piece

    piece = control_piece(configs.pipeline)  # ControlNet for a UNet, SD 3.x's for its transformer, Flux.1's
    if request.controlnet and piece is not None and piece.picture is None:  # SD 3.x's inpainting net: --image, --mask
        if request.control_image:
            raise UserError(f"--control-image with {configs.family.title} inpainting: its inpainting ControlNet reads "
                            "--image and --mask: drop --control-image")
        if request.strength is not None:
            raise UserError(f"--strength with {configs.family.title} ControlNet inpainting: sampling starts from pure "
                            "noise and pastes nothing back, as diffusers': drop --strength")
    elif request.controlnet:  # a picture per net (check_flags leaves inpaint without pictures to this check)
        check_counts(request.controlnet, "--controlnet", request.control_image, "--control-image", (),
                     "--control-scale", "nets")
    own = getattr(configs.side, "check_controlnets", None)
    if own is not None or not request.controlnet:
        if own is None:  # a UNet's control picture needs its net
            check_counts(request.controlnet, "--controlnet", request.control_image, "--control-image", (),
                         "--control-scale", "nets")
        return own(request, configs)
    unet, vae_scale_factor = configs.denoiser, configs.vae.scale_factor
    for name, config_source in zip(request.controlnet, controlnet_configs(request)):
        if os.path.isfile(os.path.expanduser(name)):
            if piece is not ControlNet:
                raise UserError(f"--controlnet {name}: original-layout ControlNet files are read for UNets (SD "
                                f"1.x / 2.x); for {configs.family.title} give a diffusers ControlNet folder or hub id")
            if config_source is None:
                continue
            flag, source = f"--controlnet-config {config_source}", config_source
        else:
            flag, source = f"--controlnet {name}", name
        try:
            folder = resolve_folder(source, None, allow_patterns=["config.json"])
            raw = read_config_file(os.path.join(folder, "config.json"))
            config = piece.net_class.config_class.from_dict(raw)
        except (ModelNotFoundError, ValueError, TypeError, OSError) as e:
            raise UserError(f"{flag}: {e}") from e
        kind = raw.get("_class_name", piece.net_class.__name__)
        if kind in NET_CLASSES and kind != piece.net_class.__name__:
            raise UserError(f"{flag} is a {kind}, but {request.model}'s ControlNets are {piece.net_class.__name__}s: "
                            "use a ControlNet trained for this base model")
        if piece is not ControlNet:  # another denoiser's nets (SD 3.x's): its piece says what fits
            if problem := piece.config_problem(config, unet, configs.vae):
                raise UserError(f"{flag} {problem}")
            continue
        if (config.cross_attention_dim, config.addition_embed_type) != (unet.cross_attention_dim,
                                                                        unet.addition_embed_type):
            raise UserError(f"{flag} was made for another model family than {request.model} (text "
                            f"width {config.cross_attention_dim} vs {unet.cross_attention_dim}): use a ControlNet "
                            "trained for this base model")
        if config.condition_scale != vae_scale_factor:
            raise UserError(f"{flag}: {condition_scale_mismatch(config, vae_scale_factor)}")


def resolve(request, configs, pictures) -> Controls:
    """The pictures at the output size, with one scale per net (the pipeline's default where none is given)."""
    if not request.controlnet:  # Flux Control: the picture alone
        return Controls(pictures, ())
    scales = request.control_scale or (configs.pipeline.defaults["controlnet_conditioning_scale"],)
    modes = tuple(None if mode < 0 else mode for mode in request.control_mode)
    return Controls(pictures, tuple(scales) * (len(request.controlnet) if len(scales) == 1 else 1), modes)


def components(request, dtype) -> tuple[dict, dict]:
    """The nets, from folders, hub ids or original-layout files (none: a Flux Control checkpoint's picture alone)."""
    from ... import ControlNetModel, FluxControlNetModel, SD3ControlNetModel

    if not request.controlnet:
        return {}, {}

    nets = []
    for name, config in zip(request.controlnet, controlnet_configs(request)):
        if os.path.isfile(os.path.expanduser(name)):  # an original-layout file
            nets.append(load_file(name, config, dtype, request.attention))
        else:
            cls = {c.__name__: c for c in (SD3ControlNetModel, FluxControlNetModel)}.get(class_name(name),
                                                                                          ControlNetModel)
            nets.append(cls.from_pretrained(name, dtype=dtype, attention=request.attention))
    return {"controlnet": [net for net, _ in nets]}, {"controlnet": [params for _, params in nets]}


def class_name(name) -> str | None:
    """The `_class_name` of a ControlNet folder's or hub id's config.json (checked by check_configs)."""
    from ...loading.hub import resolve_folder
    from ...models.config import read_config_file

    folder = resolve_folder(name, None, allow_patterns=["config.json"])
    return read_config_file(os.path.join(folder, "config.json")).get("_class_name")


def load_file(name, config, dtype, attention):
    """(controlnet, params) of an original-layout --controlnet file, its config from --controlnet-config or read
    off its tensors."""
    from ... import ControlNetModel
    from ...loading.single_file import SingleFileError
    try:
        return ControlNetModel.from_single_file(os.path.expanduser(name), config=config, dtype=dtype,
                                                attention=attention)
    except SingleFileError as e:  # the library's advice names its Python argument, config=: here it is a flag
        raise flag_error("--controlnet", name, str(e).replace("pass config=<", "pass --controlnet-config <")) from e


def call_arguments(pipeline, controls, rows) -> tuple[list, dict]:
    """The condition pictures (one per net, the same for every row) and the scales."""
    import numpy as np

    from ...pipeline.images import preprocess_control_images

    if not pipeline.controlnets:  # Flux Control: its control picture's latents beside the latents
        return [np.repeat(preprocess_control_images(controls.pictures, pipeline.vae_scale_factor), len(rows),
                          axis=0)], {}
    images = [np.repeat(preprocess_control_images([picture], pipeline.vae_scale_factor), len(rows), axis=0)
              for picture in controls.pictures]
    modes = {"control_mode": list(controls.modes)} if controls.modes else {}
    scales = {"controlnet_conditioning_scale": list(controls.scales), **modes}
    return ([images] if images else []), scales  # none: an inpainting ControlNet reads the call's image and mask


def settings(request, checkpoint) -> dict:
    """Lists, one entry per net in their order (JSON in the PNG)."""
    if not request.controlnet:
        return {"control_image": list(request.control_image)} if request.control_image else {}
    values = {"controlnet": list(request.controlnet),
              **({"control_image": list(request.control_image)} if request.control_image else {}),
              "control_scale": list(checkpoint.features["controlnet"].scales)}
    if request.control_mode:
        values["control_mode"] = list(request.control_mode)
    if request.controlnet_config:  # one per original-layout file of `controlnet`
        values["controlnet_config"] = list(request.controlnet_config)
    return values


def parameters(s) -> str:
    """As A1111's ControlNet extension."""
    return "".join(f', ControlNet {k}: "Model: {net}, Weight: {scale}"'
                   for k, (net, scale) in enumerate(zip(s.get("controlnet", ()), s.get("control_scale", ()))))
