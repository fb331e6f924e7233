"""--t2i-adapter, --adapter-image, --adapter-scale and --adapter-factor: the flags checked against each other and
the pictures read (before anything loads), each adapter's config (kilobytes) against the checkpoint's UNet and the
output size, the adapters loaded, and the call's adapter inputs."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from .pictures import check_counts, read_picture
from .request import UserError


@dataclasses.dataclass(frozen=True)
class Adapters:
    """The --adapter-image pictures (RGB, at the output size), one scale per adapter, and SDXL's factor (None for
    SD, whose adapter pipeline has none)."""

    pictures: tuple
    scales: tuple
    factor: float | None


def check_adapter_flags(request):
    """The T2I-Adapter flags agree and every --adapter-image is readable (the pictures are read again, at the
    output size, by `read_adapter_pictures`)."""
    names, images, scales = request.t2i_adapter, request.adapter_image, request.adapter_scale
    if not names:
        for flag, given in (("--adapter-image", images), ("--adapter-scale", scales),
                            ("--adapter-factor", request.adapter_factor is not None)):
            if given:
                raise UserError(f"{flag} applies with --t2i-adapter (the picture's adapter): add --t2i-adapter "
                                "ID_OR_DIR, or leave it out")
        return
    check_counts(names, "--t2i-adapter", images, "--adapter-image", scales, "--adapter-scale", "adapters")
    read_adapter_pictures(request)


def read_adapter_pictures(request) -> tuple:
    return tuple(read_picture("--adapter-image", path).convert("RGB") for path in request.adapter_image)


def adapter_config(name):
    """The T2IAdapterConfig of a folder or hub id (its config.json alone is fetched)."""
    from ..loading.hub import ModelNotFoundError, resolve_folder
    from ..models.config import read_config_file
    from ..models.t2i_adapter import T2IAdapterConfig

    flag = f"--t2i-adapter {name}"
    if os.path.isfile(os.path.expanduser(name)):
        raise UserError(f"{flag} is a file: give the folder of a diffusers T2IAdapter (config.json beside its "
                        "weights) or a hub id, e.g. TencentARC/t2iadapter_canny_sd15v2")
    try:
        folder = resolve_folder(name, None, allow_patterns=["config.json"])
        config = read_config_file(os.path.join(folder, "config.json"))
        kind = config.get("_class_name", "T2IAdapter")
        if kind != "T2IAdapter":
            raise UserError(f"{flag} is a {kind}, not a T2IAdapter: give the folder or hub id of a T2I-Adapter, e.g. "
                            "TencentARC/t2iadapter_canny_sd15v2")
        return T2IAdapterConfig.from_dict(config)
    except (ModelNotFoundError, ValueError, TypeError, OSError) as e:
        raise UserError(f"{flag}: {e}") from e


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


def check_t2i_adapters(request, unet, vae_scale_factor, family) -> tuple:
    """Each --t2i-adapter's config: a T2IAdapter of grey or RGB pictures whose features fit the UNet's down blocks
    (width and size, level by level); --adapter-factor is for a family whose adapter class takes one (SDXL's). The
    configs, in order."""
    if request.adapter_factor is not None and not takes_factor(family):
        raise UserError(f"--adapter-factor is for SDXL's T2I-Adapters, but {request.model} is not an SDXL checkpoint "
                        "(its adapters steer every step): drop --adapter-factor")
    configs = tuple(adapter_config(name) for name in request.t2i_adapter)
    wanted = unet_levels(unet, vae_scale_factor)
    for name, config in zip(request.t2i_adapter, configs):
        if config.in_channels not in (1, 3):
            raise UserError(f"--t2i-adapter {name} takes pictures of {config.in_channels} channels: sdflax gives a "
                            "T2I-Adapter RGB (3) or grey (1) pictures")
        own = feature_levels(config)
        if own[:len(wanted)] != wanted[:len(own)]:
            raise UserError(f"--t2i-adapter {name} does not fit {request.model}: its features are {levels_text(own)} "
                            f"of the picture, the UNet's down blocks take {levels_text(wanted)}: use a T2I-Adapter "
                            "made for this base model")
    return configs


def levels_text(levels) -> str:
    return ", ".join(f"{width} wide at 1/{scale}" for width, scale in levels)


def fit_adapters(request, configs, pictures, height, width, defaults, family) -> Adapters | None:
    """The adapters' pictures (at the output size) with their scales and SDXL's factor (`defaults`: the pipeline
    class's), once the output size is a multiple of every adapter's total downscale factor (its smallest
    feature's)."""
    if not configs:
        return None
    for name, config in zip(request.t2i_adapter, configs):
        factor = config.total_downscale_factor
        if height % factor or width % factor:
            fit = [max(factor, side // factor * factor) for side in (width, height)]
            raise UserError(f"--t2i-adapter {name} needs an output size of multiples of {factor} (its total downscale "
                            f"factor), not {width}x{height}: give --width and --height multiples of {factor}, e.g. "
                            f"--width {fit[0]} --height {fit[1]}")
    scales = request.adapter_scale or (defaults["adapter_conditioning_scale"],)
    factor = None if not takes_factor(family) else request.adapter_factor if request.adapter_factor is not None else defaults[
        "adapter_conditioning_factor"]
    return Adapters(pictures, tuple(scales) * (len(configs) if len(scales) == 1 else 1), factor)


def adapter_class(family) -> type:
    """generate's class with T2I-Adapters and no ControlNet: diffusers' StableDiffusion(XL)AdapterPipeline's."""
    from ..pipeline.t2i_adapter import T2IAdapters

    return next((cls for cls in family.classes.values() if T2IAdapters in cls.wrappers), None)


def takes_factor(family) -> bool:
    """Whether the family's adapters stop after a fraction of the steps (--adapter-factor: SDXL's)."""
    cls = adapter_class(family)
    return cls is not None and "adapter_conditioning_factor" in cls.defaults


def load_t2i_adapters(request, dtype) -> list:
    """[(adapter, params)] of the --t2i-adapter folders or hub ids."""
    from .. import T2IAdapter

    loaded = []
    for name in request.t2i_adapter:
        try:
            loaded.append(T2IAdapter.from_pretrained(os.path.expanduser(name), dtype=dtype))
        except (OSError, ValueError) as e:  # weights missing, or not matching the config
            raise UserError(f"--t2i-adapter {name}: {e}") from e
    return loaded


def adapter_inputs(pipeline, adapters, rows) -> tuple[list, dict]:
    """(the positional arrays, the keywords) of the call: each picture as its adapter takes it (grey for one
    channel), the same for every row; the StableDiffusion(XL)Adapter classes take the pictures as their `image`,
    the others as `adapter_image`."""
    from ..pipeline.images import preprocess_adapter_images
    from ..pipeline.t2i_adapter import T2IAdapters

    if adapters is None:
        return [], {}
    images = [np.repeat(preprocess_adapter_images([picture], pipeline.vae_scale_factor, adapter.config.in_channels),
                        rows, axis=0) for picture, adapter in zip(adapters.pictures, pipeline.adapters)]
    keywords = {"adapter_conditioning_scale": list(adapters.scales)}
    if adapters.factor is not None:
        keywords["adapter_conditioning_factor"] = adapters.factor
    if T2IAdapters in pipeline.wrappers:
        return [images], keywords
    return [], {"adapter_image": images, **keywords}
