"""Small image helpers."""

from __future__ import annotations


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
