"""The pictures a metric reads: a folder (its image files, sorted by name, as RGB, as pytorch-fid reads them), an
array of one or many (H, W, C) pictures, or a list of arrays and PIL images; each comes out (H, W, 3), uint8 or
float32 in [0, 1], one at a time, so a folder of 50,000 is never held at once."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MAX_PIXELS = 8192 * 8192  # as sdflax reads pictures elsewhere: a small file can claim 30000 x 30000


class PictureError(ValueError):
    """A picture or a folder of them that a metric cannot read; the message names it in one line."""


def picture_files(folder) -> list[Path]:
    """The image files directly in `folder`, sorted by name (pytorch-fid's choice: no subfolders)."""
    path = Path(os.path.expanduser(folder))
    if not path.is_dir():
        raise PictureError(f"{folder}: {'not a folder' if path.exists() else 'no such folder'} of pictures")
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in SUFFIXES and p.is_file())
    if not files:
        raise PictureError(f"{folder}: no pictures in it ({', '.join(SUFFIXES)})")
    return files


def read_file(path) -> np.ndarray:
    """One image file as uint8 RGB (H, W, 3): PIL's convert("RGB"), as pytorch-fid and CLIP's processor read it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as picture:
                if picture.width * picture.height > MAX_PIXELS:
                    raise PictureError(f"{path}: {picture.width}x{picture.height} pixels, more than sdflax reads")
                return np.asarray(picture.convert("RGB"))
    except PictureError:
        raise
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombWarning,
            Image.DecompressionBombError) as e:
        raise PictureError(f"{path}: cannot read it as a picture ({' '.join(str(e).split())[:200]})") from None


def as_rgb(picture, what="picture") -> np.ndarray:
    """A PIL image or an (H, W), (H, W, 1|3|4) array -> (H, W, 3) uint8, or float32 for float arrays (alpha
    dropped, as PIL's convert("RGB") drops it)."""
    from PIL import Image

    if isinstance(picture, Image.Image):
        return np.asarray(picture.convert("RGB"))
    array = np.asarray(picture)
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4) or min(array.shape[:2]) < 1:
        hint = " (channels last: (H, W, 3), not (3, H, W))" if array.ndim == 3 and array.shape[0] in (1, 3) else ""
        raise PictureError(f"a {what} of shape {array.shape}: expected (H, W, 3){hint}")
    if array.dtype == np.uint8:
        pass
    elif array.dtype.kind == "f":
        array = array.astype(np.float32)
    else:
        raise PictureError(f"a {what} of dtype {array.dtype}: expected uint8, or float in [0, 1]")
    if array.shape[-1] == 1:
        return np.repeat(array, 3, axis=-1)
    return array[..., :3]


def pictures(images) -> Iterator[np.ndarray]:
    """Each picture of `images` (a folder path, an array (N, H, W, C) or (H, W, C), a PIL image, or an iterable of
    arrays and PIL images) as `as_rgb` makes it."""
    from PIL import Image

    if isinstance(images, (str, os.PathLike)):
        for path in picture_files(images):
            yield read_file(path)
        return
    if isinstance(images, Image.Image) or (hasattr(images, "ndim") and images.ndim in (2, 3)):
        yield as_rgb(images)
        return
    if hasattr(images, "ndim") and images.ndim != 4:
        raise PictureError(f"an array of shape {tuple(images.shape)}: expected pictures (N, H, W, 3) or one (H, W, 3)")
    for picture in images:
        yield as_rgb(picture)


def batches(items, size) -> Iterator[list]:
    """Lists of `size` items in order (the last shorter)."""
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
