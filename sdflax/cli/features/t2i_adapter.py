"""--t2i-adapter, --adapter-image, --adapter-scale and --adapter-factor: the flags checked against each other and
the pictures read (before anything loads), each adapter's config (kilobytes) against the checkpoint's UNet and the
output size, the adapters loaded, and the call's adapter inputs."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from ..parse import number, scale
from ..pictures import check_counts, read_picture
from ..manifest import quoted
from ..request import UserError
from .model_config import model_config

FLAG = "--t2i-adapter"
DENOISERS = ("unet",)

adapter_factor = number(lambda v: 0 <= v <= 1, "must be in [0, 1], got {value}: the fraction of the steps the "
                        "T2I-Adapters steer, the first ones (1: every step, 0: none)")


def add_flags(add, command):
    add("--t2i-adapter", action="append", default=[], metavar="ID_OR_DIR",
        help="a T2I-Adapter steering by --adapter-image (a sketch, edges, depth, pose, ...): a diffusers T2IAdapter "
             "folder or hub id (TencentARC/t2iadapter_canny_sd15v2, TencentARC/t2i-adapter-canny-sdxl-1.0); repeat "
             "for several")
    add("--adapter-image", action="append", default=[], metavar="IMG",
        help="the picture of each --t2i-adapter, in their order, grey for a one-channel adapter; resized to the "
             "output size, which the first one sets where no --height and --width, --image or --control-image do")
    add("--adapter-scale", action="append", default=[], type=scale, metavar="S",
        help="how strongly the T2I-Adapters steer: one value for all or one per adapter (default: 1.0)")
    add("--adapter-factor", type=adapter_factor, metavar="F",
        help="SDXL: the fraction of the steps, the first ones, the T2I-Adapters steer, in [0, 1] (default: 1.0)")


def used(request) -> bool:
    return bool(request.t2i_adapter)


@dataclasses.dataclass(frozen=True)
class Adapters:
    """The --adapter-image pictures (RGB, at the output size), one scale per adapter, and SDXL's factor (None for
    SD, whose adapter pipeline has none)."""

    pictures: tuple
    scales: tuple
    factor: float | None


def check_flags(request, batch):
    """The T2I-Adapter flags agree and every --adapter-image is readable (the pictures are read again, to be
    resized to the output size, by `pictures`)."""
    names, images, scales = request.t2i_adapter, request.adapter_image, request.adapter_scale
    if not names:
        for flag, given in (("--adapter-image", images), ("--adapter-scale", scales),
                            ("--adapter-factor", request.adapter_factor is not None)):
            if given:
                raise UserError(f"{flag} applies with --t2i-adapter (the picture's adapter): add --t2i-adapter "
                                "ID_OR_DIR, or leave it out")
        return
    check_counts(names, "--t2i-adapter", images, "--adapter-image", scales, "--adapter-scale", "adapters")
    pictures(request)


def pictures(request) -> tuple:
    return "--adapter-image", request.adapter_image, tuple(read_picture("--adapter-image", path).convert("RGB")
                                                             for path in request.adapter_image)


def pipeline_class(request, family, cls):
    """generate's class with T2I-Adapters and no ControlNet: diffusers' StableDiffusion(XL)AdapterPipeline's; the
    other classes take T2I-Adapters as they are (adapter=)."""
    if request.start == "noise" and not request.controlnet:
        return adapter_class(family) or cls
    return cls


def adapter_config(name):
    """The T2IAdapterConfig of a folder or hub id (its config.json alone is fetched)."""
    from ...models.t2i_adapter import T2IAdapterConfig

    return model_config(f"--t2i-adapter {name}", name, "T2IAdapter", T2IAdapterConfig, "a T2I-Adapter",
                        "TencentARC/t2iadapter_canny_sd15v2")


def feature_levels(config) -> list:
    """(width, picture pixels per feature pixel) of each of the adapter's features."""
    levels, scale = [], config.downscale_factor
    for width, halves in config.blocks():
        scale *= 2 if halves else 1
        levels.append((width, scale))
    return levels


def unet_levels(unet, vae_scale_factor) -> list:
    """(width, picture pixels per feature pixel) where the UNet adds each down block's feature: inside a
    cross-attention block before its downsampler, after a plain block's (as diffusers adds them)."""
    levels, scale = [], vae_scale_factor
    for i, (kind, width) in enumerate(zip(unet.down_block_types, unet.block_out_channels)):
        after = scale * 2 if i < len(unet.block_out_channels) - 1 else scale
        levels.append((width, scale if kind == "CrossAttnDownBlock2D" else after))
        scale = after
    return levels


def check_configs(request, configs):
    """Each --t2i-adapter's config: a T2IAdapter of grey or RGB pictures whose features fit the UNet's down blocks
    (width and size, level by level); --adapter-factor is for a family whose adapter class takes one (SDXL's)."""
    family, unet, vae_scale_factor = configs.family, configs.denoiser, configs.vae.scale_factor
    if request.adapter_factor is not None and not takes_factor(family):
        raise UserError(f"--adapter-factor is for SDXL's T2I-Adapters, but {request.model} is not an SDXL checkpoint "
                        "(its adapters steer every step): drop --adapter-factor")
    adapters = tuple(adapter_config(name) for name in request.t2i_adapter)
    wanted = unet_levels(unet, vae_scale_factor)
    for name, config in zip(request.t2i_adapter, adapters):
        if config.in_channels not in (1, 3):
            raise UserError(f"--t2i-adapter {name} takes pictures of {config.in_channels} channels: sdflax gives a "
                            "T2I-Adapter RGB (3) or grey (1) pictures")
        own = feature_levels(config)
        if own[:len(wanted)] != wanted[:len(own)]:
            raise UserError(f"--t2i-adapter {name} does not fit {request.model}: its features are {levels_text(own)} "
                            f"of the picture, the UNet's down blocks take {levels_text(wanted)}: use a T2I-Adapter "
                            "made for this base model")


def levels_text(levels) -> str:
    return ", ".join(f"{width} wide at 1/{scale}" for width, scale in levels)


def resolve(request, configs, pictures) -> Adapters:
    """The adapters' pictures (at the output size) with their scales and SDXL's factor (the pipeline class's
    defaults), once the output size is a multiple of every adapter's total downscale factor (its smallest
    feature's)."""
    height, width, defaults, family = configs.height, configs.width, configs.pipeline.defaults, configs.family
    for name in request.t2i_adapter:
        config = adapter_config(name)
        factor = config.total_downscale_factor
        if height % factor or width % factor:
            fit = [max(factor, side // factor * factor) for side in (width, height)]
            raise UserError(f"--t2i-adapter {name} needs an output size of multiples of {factor} (its total downscale "
                            f"factor), not {width}x{height}: give --width and --height multiples of {factor}, e.g. "
                            f"--width {fit[0]} --height {fit[1]}")
    scales = request.adapter_scale or (defaults["adapter_conditioning_scale"],)
    factor = None
    if takes_factor(family):
        given = request.adapter_factor
        factor = given if given is not None else defaults["adapter_conditioning_factor"]
    return Adapters(pictures, tuple(scales) * (len(request.t2i_adapter) if len(scales) == 1 else 1), factor)


def adapter_class(family) -> type:
    """generate's class with T2I-Adapters and no ControlNet: diffusers' StableDiffusion(XL)AdapterPipeline's."""
    from ...pipeline.t2i_adapter import T2IAdapters

    return next((cls for cls in family.classes.values() if T2IAdapters in cls.wrappers), None)


def takes_factor(family) -> bool:
    """Whether the family's adapters stop after a fraction of the steps (--adapter-factor: SDXL's)."""
    cls = adapter_class(family)
    return cls is not None and "adapter_conditioning_factor" in cls.defaults


def components(request, dtype) -> tuple[dict, dict]:
    """The adapters of the --t2i-adapter folders or hub ids."""
    from ... import T2IAdapter

    loaded = []
    for name in request.t2i_adapter:
        try:
            loaded.append(T2IAdapter.from_pretrained(os.path.expanduser(name), dtype=dtype))
        except (OSError, ValueError) as e:  # weights missing, or not matching the config
            raise UserError(f"--t2i-adapter {name}: {e}") from e
    return {"adapter": [adapter for adapter, _ in loaded]}, {"adapter": [params for _, params in loaded]}


def call_arguments(pipeline, adapters, rows) -> tuple[list, dict]:
    """(the positional arrays, the keywords) of the call: each picture as its adapter takes it (grey for one
    channel), the same for every row; the StableDiffusion(XL)Adapter classes take the pictures as their `image`,
    the others as `adapter_image`."""
    from ...pipeline.images import preprocess_adapter_images
    from ...pipeline.t2i_adapter import T2IAdapters

    images = [np.repeat(preprocess_adapter_images([picture], pipeline.vae_scale_factor, adapter.config.in_channels),
                        len(rows), axis=0) for picture, adapter in zip(adapters.pictures, pipeline.adapters)]
    keywords = {"adapter_conditioning_scale": list(adapters.scales)}
    if adapters.factor is not None:
        keywords["adapter_conditioning_factor"] = adapters.factor
    if T2IAdapters in pipeline.wrappers:
        return [images], keywords
    return [], {"adapter_image": images, **keywords}


def settings(request, checkpoint) -> dict:
    """Lists, one entry per adapter in their order (JSON in the PNG)."""
    adapters = checkpoint.features.get("t2i_adapter")
    if adapters is None:
        return {}
    values = {"t2i_adapter": list(request.t2i_adapter), "adapter_image": list(request.adapter_image),
              "adapter_scale": list(adapters.scales)}
    if adapters.factor is not None:  # SDXL's
        values["adapter_factor"] = adapters.factor
    return values


def parameters(s) -> str:
    """As the IP-Adapters: an entry of sdflax's own."""
    if "t2i_adapter" not in s:
        return ""
    adapters = ", ".join(f"{name} ({scale})" for name, scale in zip(s["t2i_adapter"], s["adapter_scale"]))
    return (f", T2I-Adapter: {quoted(adapters)}, T2I-Adapter image: {quoted(', '.join(s['adapter_image']))}"
            + (f", T2I-Adapter factor: {s['adapter_factor']}" if "adapter_factor" in s else ""))
