"""The pictures a request names (--image, --mask, --control-image, --adapter-image): read and checked before anything
loads, and resized to the output size."""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np

from ..utils import is_float32
from .request import MAX_PICTURE_SIDE, UserError


def read_picture(flag, path):
    """The picture, 8-bit (`eight_bit`: 16-bit greyscale scaled, not clipped); its size is checked against
    MAX_PICTURE_SIDE² from the header, before the pixels are decoded (a small PNG can claim 30000x30000)."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    from ..pipeline.images import eight_bit

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


@dataclasses.dataclass(frozen=True)
class Controls:
    """The --control-image pictures (RGB) and the --control-scale values given (none, one, or one per net)."""

    pictures: tuple
    scales: tuple


def check_counts(models, flag, pictures, picture_flag, scales, scale_flag, noun):
    """One picture per model, in their order, and one scale for all or one per model (`noun`: "nets")."""
    if len(pictures) != len(models):
        raise UserError(f"{len(models)} {flag} and {len(pictures)} {picture_flag}: give one {picture_flag} per "
                        f"{flag}, in the same order")
    if len(scales) not in (0, 1, len(models)):
        raise UserError(f"{len(scales)} {scale_flag} for {len(models)} {flag}: give one for all {noun} or one per "
                        f"{noun[:-1]}")


def read_controls(request) -> Controls | None:
    """The ControlNet flags checked against each other, and the control images read."""
    nets, images, scales = request.controlnet, request.control_image, request.control_scale
    if not nets and not images and not scales:
        return None
    if scales and not nets:
        raise UserError("--control-scale without --controlnet: it says how strongly the nets steer; add "
                        "--controlnet and --control-image, or leave it out")
    check_counts(nets, "--controlnet", images, "--control-image", scales, "--control-scale", "nets")
    for scale in scales:
        if not is_float32(scale):
            raise UserError(f"--control-scale {scale}: give a finite float32 number (1 steers fully, 0 not at all)")
    return Controls(tuple(read_picture("--control-image", path).convert("RGB") for path in images), tuple(scales))


def read_pictures(request) -> dict:
    """--image (RGB) and --mask (greyscale) as PIL images, checked: readable, the same size, a grey mask."""
    pictures = {flag: read_picture(f"--{flag}", getattr(request, flag)) for flag in ("image", "mask")
                if getattr(request, flag) is not None}
    if "mask" in pictures:
        image, mask = pictures["image"], pictures["mask"]
        if mask.size != image.size:
            raise UserError(f"--mask {request.mask} is {mask.size[0]}x{mask.size[1]} but --image {request.image} is "
                            f"{image.size[0]}x{image.size[1]}: give a mask of the image's size")
        from ..pipeline.images import has_transparency

        if has_transparency(mask):  # its alpha would be dropped, not read as the mask: refused, not guessed
            raise UserError(f"--mask {request.mask}: the mask has transparency, which sdflax does not read as the "
                            "mask: give a greyscale mask, white where to repaint and black where to keep")
        rgb = np.asarray(mask.convert("RGB"), np.int16)
        if (rgb != rgb[..., :1]).any():  # a coloured mask would silently become its luma
            raise UserError(f"--mask {request.mask} has colours (its red, green and blue differ): give a greyscale "
                            "mask, white where to repaint and black where to keep")
        pictures["mask"] = mask.convert("L")
    if pictures:  # an alpha channel is dropped, as diffusers does: the colours under it are used as they are
        pictures["image"] = pictures["image"].convert("RGB")
    return pictures


def fit_pictures(request, default, factor, pictures, controls, adapters=(), what="the VAE scale factor"):
    """(height, width, pictures, controls, adapters): --height/--width must be multiples of `factor` (`what`: the
    VAE scale factor, SD 3.x's times its patch size).
    Without them the size is --image's, else the first --control-image's (as diffusers' pipelines take it), else the
    first --adapter-image's, each side rounded down to a multiple (with a warning line), else the model's. Every
    input picture is resized to it (scaled, not cropped; Lanczos, as diffusers resizes an adapter's picture)."""
    for flag, value in (("--height", request.height), ("--width", request.width)):
        if value is not None and value > MAX_PICTURE_SIDE:  # its latents and attention would exhaust any memory
            raise UserError(f"{flag} {value} is larger than sdflax makes ({MAX_PICTURE_SIDE} pixels at most)")
        if value is not None and value % factor:
            raise UserError(f"{flag} {value} is not a multiple of {factor}, {what} of {request.model}: "
                            f"use {max(factor, value // factor * factor)} or {(value // factor + 1) * factor}")
    if pictures:
        flag, path, source = "--image", request.image, pictures["image"]
    elif controls:
        flag, path, source = "--control-image", request.control_image[0], controls.pictures[0]
    elif adapters:
        flag, path, source = "--adapter-image", request.adapter_image[0], adapters[0]
    else:
        return request.height or default, request.width or default, pictures, controls, adapters
    from PIL import Image

    own_width, own_height = source.size
    height = request.height or own_height - own_height % factor
    width = request.width or own_width - own_width % factor
    if not height or not width:
        raise UserError(f"{flag} {path} is {own_width}x{own_height}, smaller than {factor} pixels, {what}: give a "
                        "larger image")
    if (width, height) != (own_width, own_height) and (
            (request.height is None and height != own_height) or (request.width is None and width != own_width)):
        print(f"sdflax: warning: {flag} {path} is {own_width}x{own_height}: resized to {width}x{height}, "
              f"a multiple of {factor} ({what})", file=sys.stderr)

    def resize(picture):
        return picture if picture.size == (width, height) else picture.resize((width, height), Image.LANCZOS)

    pictures = {name: resize(picture) for name, picture in pictures.items()}
    if controls:
        controls = dataclasses.replace(controls, pictures=tuple(resize(picture) for picture in controls.pictures))
    return height, width, pictures, controls, tuple(resize(picture) for picture in adapters)
