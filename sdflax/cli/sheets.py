"""Pictures with their labels drawn in: `sdflax grid`'s X/Y plot (column labels above, row labels to the left, a
title over both, as A1111's X/Y/Z plot) and `--trajectory-sheet`'s strip of steps with a label under each."""

from __future__ import annotations

INK = (0, 0, 0)  # labels are black on white: a reader (or a test) finds them as the band's dark pixels
PAPER = (255, 255, 255)


def font_for(height):
    """PIL's own font (no font file to find), sized to the pictures: one line is about a twelfth of a cell."""
    from PIL import ImageFont

    return ImageFont.load_default(size=max(10, height // 12))


def wrapped(text, font, width) -> list[str]:
    """`text`'s lines broken at spaces so that each fits in `width` pixels where its words allow."""
    lines = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            trial = f"{line} {word}" if line else word
            if line and font.getlength(trial) > width:
                lines.append(line)
                line = word
            else:
                line = trial
        lines.append(line)
    return lines


def line_height(font) -> int:
    top, bottom = font.getbbox("Ag")[1::2]
    return bottom - top + max(2, (bottom - top) // 3)


def draw_lines(draw, lines, font, box):
    """Lines centred in `box` (left, top, width, height)."""
    left, top, width, height = box
    step = line_height(font)
    y = top + (height - step * len(lines)) // 2
    for line in lines:
        draw.text((left + (width - font.getlength(line)) / 2, y), line, fill=INK, font=font)
        y += step


def labelled_grid(cells, x_labels, y_labels, title=None):
    """cells[row][col] (PIL images of one size) pasted in a grid on white, each column's label above it, each
    row's to its left, and `title` (a z value) above everything."""
    from PIL import Image, ImageDraw

    w, h = cells[0][0].size
    font = font_for(h)
    step = line_height(font)
    pad = step // 2
    column_lines = [wrapped(label, font, w - pad) for label in x_labels]
    row_lines = [label.split("\n") for label in y_labels]
    left = max((max(font.getlength(line) for line in lines) for lines in row_lines if any(lines)), default=0)
    left = int(left) + 2 * pad if any(y_labels) else 0
    title_lines = wrapped(title, font, left + w * len(x_labels)) if title else []
    title_h = step * len(title_lines) + pad if title_lines else 0
    top = title_h + step * max(len(lines) for lines in column_lines) + pad
    sheet = Image.new("RGB", (left + w * len(x_labels), top + h * len(y_labels)), PAPER)
    draw = ImageDraw.Draw(sheet)
    if title_lines:
        draw_lines(draw, title_lines, font, (0, 0, sheet.width, title_h))
    for col, lines in enumerate(column_lines):
        draw_lines(draw, lines, font, (left + col * w, title_h, w, top - title_h))
    for row, lines in enumerate(row_lines):
        draw_lines(draw, lines, font, (0, top + row * h, left, h))
        for col, cell in enumerate(cells[row]):
            sheet.paste(cell, (left + col * w, top + row * h))
    return sheet


def labelled_strip(pictures, labels):
    """PIL pictures of one size side by side, each label under its picture."""
    from PIL import Image, ImageDraw

    w, h = pictures[0].size
    font = font_for(h)
    lines = [wrapped(label, font, w) for label in labels]
    band = line_height(font) * max(len(text) for text in lines) + line_height(font) // 2
    strip = Image.new("RGB", (w * len(pictures), h + band), PAPER)
    draw = ImageDraw.Draw(strip)
    for i, (picture, text) in enumerate(zip(pictures, lines)):
        strip.paste(picture, (i * w, 0))
        draw_lines(draw, text, font, (i * w, h, w, band))
    return strip
