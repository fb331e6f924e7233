"""The pictures a request names (--image, --mask, and the features' pictures: a ControlNet's, a T2I-Adapter's): read
and checked before anything loads, and resized to the output size."""

from __future__ import annotations

import os
import sys

import numpy as np

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


def check_counts(models, flag, pictures, picture_flag, scales, scale_flag, noun):
    """One picture per model, in their order, and one scale for all or one per model (`noun`: "nets")."""
    if len(pictures) != len(models):
        raise UserError(f"{len(models)} {flag} and {len(pictures)} {picture_flag}: give one {picture_flag} per "
                        f"{flag}, in the same order")
    if len(scales) not in (0, 1, len(models)):
        raise UserError(f"{len(scales)} {scale_flag} for {len(models)} {flag}: give one for all {noun} or one per "
                        f"{noun[:-1]}")


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


def fit_pictures(request, default, factor, pictures, conditions=(), what="the VAE scale factor"):
    """(height, width, pictures, the conditions' pictures): --height/--width must be multiples of `factor` (`what`:
    the VAE scale factor, SD 3.x's times its patch size). `conditions`: the features' (flag, paths, pictures).
    Without them the size is --image's, else the first condition picture's (as diffusers' pipelines take a
    ControlNet's), each side rounded down to a multiple (with a warning line), else the model's. Every input picture
    is resized to it (scaled, not cropped; Lanczos, as diffusers resizes an adapter's picture)."""
    for flag, value in (("--height", request.height), ("--width", request.width)):
        if value is not None and value > MAX_PICTURE_SIDE:  # its latents and attention would exhaust any memory
            raise UserError(f"{flag} {value} is larger than sdflax makes ({MAX_PICTURE_SIDE} pixels at most)")
        if value is not None and value % factor:
            raise UserError(f"{flag} {value} is not a multiple of {factor}, {what} of {request.model}: "
                            f"use {max(factor, value // factor * factor)} or {(value // factor + 1) * factor}")
    given = [(flag, paths[0], shown[0]) for flag, paths, shown in conditions if shown]
    if pictures:
        flag, path, source = "--image", request.image, pictures["image"]
    elif given:
        flag, path, source = given[0]
    else:
        return request.height or default, request.width or default, pictures, [shown for _, _, shown in conditions]
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

    return height, width, {name: resize(picture) for name, picture in pictures.items()}, \
        [tuple(resize(picture) for picture in shown) for _, _, shown in conditions]
