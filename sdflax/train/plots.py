"""The pictures of a run, drawn with PIL alone: `loss.png` (the loss per update, light, and smoothed, dark) and
`progress.png` (one row per validation: that step's images, the step written beside them)."""

from __future__ import annotations

import numpy as np

RAW = (160, 190, 230)  # the loss per update
SMOOTH = (20, 60, 160)  # its exponential moving average
AXES = (90, 90, 90)
LABEL_WIDTH = 64  # progress.png: the column left of each row, with its step


def loss_plot(steps, losses, smoothed, size=(640, 360)):
    """A PIL image of the loss curves over the updates (no axis text beyond the ranges: PIL's small font)."""
    from PIL import Image, ImageDraw

    width, height = size
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    left, right, top, bottom = 56, width - 12, 12, height - 28
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=AXES)
    values = np.asarray([*losses, *smoothed], np.float64)
    values = values[np.isfinite(values)]
    if len(steps) == 0 or len(values) == 0:
        return image
    low, high = float(values.min()), float(values.max())
    high = high if high > low else low + 1.0
    first, last = steps[0], max(steps[-1], steps[0] + 1)

    def point(step, value):
        return (left + (step - first) / (last - first) * (right - left),
                bottom - (value - low) / (high - low) * (bottom - top))

    for series, colour, line_width in ((losses, RAW, 1), (smoothed, SMOOTH, 2)):
        points = [point(s, v) for s, v in zip(steps, series) if np.isfinite(v)]
        if len(points) == 1:
            draw.ellipse([points[0][0] - 2, points[0][1] - 2, points[0][0] + 2, points[0][1] + 2], fill=colour)
        elif points:
            draw.line(points, fill=colour, width=line_width)
    draw.text((4, top), f"{high:.3g}", fill=AXES)
    draw.text((4, bottom - 10), f"{low:.3g}", fill=AXES)
    draw.text((left, bottom + 8), f"step {first}", fill=AXES)
    draw.text((right - 60, bottom + 8), f"step {steps[-1]}", fill=AXES)
    return image


def image_row(images):
    """Images (PIL, one size) side by side."""
    from PIL import Image

    width, height = images[0].size
    row = Image.new("RGB", (width * len(images), height), "white")
    for i, image in enumerate(images):
        row.paste(image, (i * width, 0))
    return row


def progress_picture(rows):
    """[(step, row image)] -> one picture, a row per validation step, its step written in a column at the left."""
    from PIL import Image, ImageDraw

    width = max(row.size[0] for _, row in rows)
    heights = [row.size[1] for _, row in rows]
    picture = Image.new("RGB", (LABEL_WIDTH + width, sum(heights)), "white")
    draw = ImageDraw.Draw(picture)
    y = 0
    for (step, row), height in zip(rows, heights):
        picture.paste(row, (LABEL_WIDTH, y))
        draw.text((4, y + height // 2 - 5), f"{step}", fill=(0, 0, 0))
        y += height
    return picture
