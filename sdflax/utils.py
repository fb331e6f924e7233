"""Small helpers: an image grid, and the number check every entry point shares."""

from __future__ import annotations

import math

FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max


def is_float32(value: float) -> bool:
    """Finite, and finite once cast to float32, the type the programs compute in (1e39 is not)."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def make_image_grid(images, rows: int, cols: int):
    """Paste `rows * cols` PIL images (all the same size) into one grid image, row by row."""
    if len(images) != rows * cols:
        raise ValueError(f"a {rows}x{cols} grid takes {rows * cols} images, got {len(images)}")
    from PIL import Image

    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, image in enumerate(images):
        grid.paste(image, ((i % cols) * w, (i // cols) * h))
    return grid
