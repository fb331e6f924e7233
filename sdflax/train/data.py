"""A folder of pictures as training rows: kohya's layout (`a.png` beside its caption `a.txt`, a subfolder `10_name`
repeated ten times an epoch) or the Hugging Face imagefolder's (`metadata.jsonl` / `metadata.csv` naming each
`file_name` and its caption), every file checked before the first step; aspect-ratio buckets; each update's rows,
a pure function of the seed and the step (so a resumed run reads what an uninterrupted one would); a row's pixels
as diffusers' scripts make them (resized, flipped, cropped; SDXL's original size and crop corner recorded).

No JAX here: the command line checks a folder before anything starts."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import re
import warnings

import numpy as np

PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
CAPTION_SUFFIXES = (".txt", ".caption")
METADATA_FILES = ("metadata.jsonl", "metadata.csv")
MAX_PIXELS = 8192 * 8192  # a picture's header is read first: a small file may claim 30000x30000
MAX_CAPTION_BYTES = 16384  # a caption is 77 tokens: a larger file is a mistake
MAX_METADATA_BYTES = 64 * 2**20
REPEATS = re.compile(r"^(\d+)_")  # kohya's "10_fox": the folder's pictures ten times an epoch


class DataError(ValueError):
    """A file of the data that cannot be trained on; the message is one line naming it and saying how to fix it."""


@dataclasses.dataclass(frozen=True)
class Picture:
    path: str
    caption: str
    width: int
    height: int
    repeats: int = 1


def read_folder(folder, caption_column="text", default_caption=None, label="--data",
                empty_ok=False) -> list[Picture]:
    """The folder's pictures with their captions, every picture decoded once and every caption read, in a stable
    order. `default_caption`: the caption of a picture without one (DreamBooth's instance prompt), else one is
    needed (`empty_ok`: a folder without pictures is no error). A problem is a DataError naming the file."""
    folder = os.path.expanduser(os.fspath(folder))
    if not os.path.isdir(folder):
        what = "does not exist" if not os.path.lexists(folder) else "is not a folder"
        raise DataError(f"{label} {folder} {what}: give a folder of pictures with their captions (a.png + a.txt) or "
                        "a metadata.jsonl")
    metadata = [os.path.join(folder, name) for name in METADATA_FILES if os.path.lexists(os.path.join(folder, name))]
    if metadata:
        rows = [(path, caption, 1, picture_size(path)) for path, caption in
                read_metadata(metadata[0], folder, caption_column)]
    else:
        rows = []
        for path, repeats in walk(folder):
            size = picture_size(path)
            stem = os.path.splitext(path)[0]
            caption_files = [stem + suffix for suffix in CAPTION_SUFFIXES if os.path.lexists(stem + suffix)]
            if caption_files:
                caption = read_caption(caption_files[0])
            elif default_caption is not None:
                caption = default_caption
            else:
                raise DataError(f"{path} has no caption: write it in {os.path.basename(stem)}.txt beside it (or give "
                                "--instance-prompt, the caption of every picture without one)")
            rows.append((path, caption, repeats, size))
    if not rows and not empty_ok:
        raise DataError(f"{label} {folder} holds no picture ({', '.join(PICTURE_SUFFIXES)}): put the pictures "
                        "there, each with its caption in a .txt file of the same name")
    return [Picture(path, caption, *size, repeats) for path, caption, repeats, size in rows]


def walk(folder):
    """(picture path, repeats) under `folder`, sorted, subfolders followed once (a link back up is refused)."""
    seen = set()

    def visit(directory, repeats):
        try:
            status = os.stat(directory)
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as e:
            raise DataError(f"{directory}: cannot read it ({e.strerror or e})") from None
        if (status.st_dev, status.st_ino) in seen:
            raise DataError(f"{directory} is a symbolic link to a folder it is in (a loop): remove the link")
        seen.add((status.st_dev, status.st_ino))
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                is_folder = entry.is_dir()
            except OSError as e:  # a link that points to itself
                raise DataError(f"{entry.path}: cannot read it ({e.strerror or e}): remove or replace it") from None
            if is_folder:
                match = REPEATS.match(entry.name)
                yield from visit(entry.path, int(match.group(1)) if match else repeats)
            elif entry.name.lower().endswith(PICTURE_SUFFIXES):
                yield entry.path, max(repeats, 1)

    yield from visit(folder, 1)


def read_caption(path) -> str:
    """A caption file's text, on one line; a file that is too large or not text is refused."""
    try:
        size = os.stat(path).st_size
        if size > MAX_CAPTION_BYTES:
            raise DataError(f"{path} is {size} bytes, over {MAX_CAPTION_BYTES // 1024} KiB: a caption is a line of "
                            "text (77 tokens are read); is it the right file?")
        with open(path, "rb") as f:
            data = f.read(MAX_CAPTION_BYTES + 1)
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    return caption_text(path, data)


def caption_text(where, data) -> str:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = None
    if text is None or any(ord(c) < 32 and c not in "\t\n\r" for c in text):
        raise DataError(f"{where} is not a caption: its bytes are not UTF-8 text; write the caption as text")
    return " ".join(text.split())


def read_metadata(path, folder, caption_column) -> list:
    """(picture, caption) of an imagefolder's metadata.jsonl / .csv: `file_name` (relative to the folder) and
    the caption column."""
    try:
        if os.stat(path).st_size > MAX_METADATA_BYTES:
            raise DataError(f"{path} is over {MAX_METADATA_BYTES // 2**20} MiB: split the data set")
        with open(path, "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text: write it as UTF-8") from None
    if path.endswith(".csv"):
        try:
            records = list(csv.DictReader(io.StringIO(text)))
        except csv.Error as e:
            raise DataError(f"{path}: not CSV ({e})") from None
        numbered = [(i + 2, r) for i, r in enumerate(records)]  # line 1 is the header
    else:
        numbered = []
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                raise DataError(f"{path} line {number}: not JSON: write one object a line, e.g. "
                                '{"file_name": "a.png", "text": "a photo of a fox"}') from None
            if not isinstance(record, dict):
                raise DataError(f'{path} line {number}: not an object: write {{"file_name": ..., "text": ...}}')
            numbered.append((number, record))
    rows = []
    for number, record in numbered:
        name, caption = record.get("file_name"), record.get(caption_column)
        if not isinstance(name, str) or not name:
            raise DataError(f"{path} line {number}: no file_name: every row names its picture")
        if not isinstance(caption, str):
            raise DataError(f"{path} line {number}: no {caption_column!r} caption (text): every row needs one "
                            "(--caption-column names another column)")
        if len(caption.encode()) > MAX_CAPTION_BYTES:
            raise DataError(f"{path} line {number}: a caption over {MAX_CAPTION_BYTES // 1024} KiB")
        picture = os.path.normpath(os.path.join(folder, name))
        if os.path.isabs(name) or not picture.startswith(os.path.normpath(folder) + os.sep):
            raise DataError(f"{path} line {number}: file_name {name!r} is outside the folder: name pictures "
                            "relative to it")
        rows.append((picture, caption_text(f"{path} line {number}", caption.encode())))
    return rows


def picture_size(path) -> tuple[int, int]:
    """(width, height) of a picture, decoded once to prove it reads; its size checked from the header first."""
    from PIL import Image, UnidentifiedImageError

    def too_large(size):
        return DataError(f"{path} is {size} pixels, larger than sdflax reads (8192x8192 at most): make it smaller")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as picture:
                width, height = picture.size
                if width * height > MAX_PIXELS:
                    raise too_large(f"{width}x{height}")
                picture.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise too_large(f"more than {Image.MAX_IMAGE_PIXELS}") from None
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as e:
        reason = "not a picture PIL reads" if isinstance(e, UnidentifiedImageError) else \
            getattr(e, "strerror", None) or e
        raise DataError(f"{path}: cannot read the picture ({reason}): replace or remove it") from None
    return width, height


# ---- buckets ------------------------------------------------------------------------------------------------

def bucket_sizes(resolution, divisible, max_ratio=2.0) -> list[tuple[int, int]]:
    """(width, height) of every bucket: multiples of `divisible`, at most the area of resolution², no longer than
    `max_ratio` to one; the square resolution² among them (kohya's make_bucket_resolutions)."""
    area, sizes = resolution * resolution, {(resolution, resolution)}
    for width in range(divisible, int(resolution * max_ratio) + 1, divisible):
        height = area // width // divisible * divisible
        if height >= divisible and max(width / height, height / width) <= max_ratio:
            sizes.add((width, height))
    return sorted(sizes)


def nearest_bucket(width, height, buckets) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest the picture's (in log ratio; a tie: the larger, then the wider)."""
    ratio = math.log(width / height)
    return min(buckets, key=lambda b: (round(abs(math.log(b[0] / b[1]) - ratio), 9), -b[0] * b[1], -b[0]))


def row_sizes(pictures, resolution, buckets=None) -> list[tuple[int, int]]:
    """Each picture's training size (width, height): its bucket, or resolution² without buckets."""
    return [nearest_bucket(p.width, p.height, buckets) if buckets else (resolution, resolution) for p in pictures]


# ---- the order of the rows ----------------------------------------------------------------------------------

def epoch_batches(sizes, repeats, rows, seed, epoch, stream=0) -> list[list[int]]:
    """One epoch's updates, each `rows` picture indices of one size: every picture `repeats` times, shuffled within
    its size, a size's last update filled from its start, the updates shuffled; a function of (seed, epoch, stream:
    0 for the pictures, 1 for DreamBooth's class pictures)."""
    rng = np.random.default_rng([seed, epoch, 2 * stream])
    groups = {}
    for index, (size, times) in enumerate(zip(sizes, repeats)):
        groups.setdefault(size, []).extend([index] * times)
    batches = []
    for size in sorted(groups):
        members = [groups[size][i] for i in rng.permutation(len(groups[size]))]
        members += members * (-(-rows // len(members)))  # enough to fill the last update
        count = -(-len(groups[size]) // rows)
        batches += [members[i * rows:(i + 1) * rows] for i in range(count)]
    return [batches[i] for i in rng.permutation(len(batches))]


def batch_at(step, sizes, repeats, rows, seed, stream=0) -> list[int]:
    """The picture indices of update `step` (from 0): a pure function, so a resumed run reads the same rows."""
    per_epoch = len(epoch_batches(sizes, repeats, rows, seed, 0, stream))
    return epoch_batches(sizes, repeats, rows, seed, step // per_epoch, stream)[step % per_epoch]


def row_draws(seed, step, count, caption_dropout=0.0, random_flip=False, stream=0):
    """Update `step`'s per-row choices: (captions dropped, flipped, a crop position in [0, 1)² per row)."""
    rng = np.random.default_rng([seed, step, 2 * stream + 1])
    dropped = rng.random(count) < caption_dropout
    flipped = (rng.random(count) < 0.5) & random_flip
    return dropped, flipped, rng.random((count, 2))


# ---- pixels -------------------------------------------------------------------------------------------------

def load_row(path, size, flip=False, crop=None):
    """(pixels (3, H, W) float32 in [-1, 1], original (h, w), crop corner (top, left)) of a picture at `size`
    (width, height), as diffusers' SDXL script makes a row: resized (bilinear) until it covers the size (a square
    size: the shorter side to it, as torchvision's Resize(resolution)), flipped, then cropped: at the centre, or at
    `crop` ((y, x) in [0, 1)) of the room left."""
    from PIL import Image

    with Image.open(path) as picture:
        image = picture.convert("RGB")
    original = (image.height, image.width)
    width, height = size
    if width * image.height >= height * image.width:  # the width fits first: torchvision's Resize, its rounding
        resized = (width, max(height, int(width * image.height / image.width)))
    else:
        resized = (max(width, int(height * image.width / image.height)), height)
    if resized != image.size:
        image = image.resize(resized, Image.BILINEAR)
    if flip:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    if crop is None:
        top, left = max(0, round((image.height - height) / 2)), max(0, round((image.width - width) / 2))
    else:
        top, left = int(crop[0] * (image.height - height + 1)), int(crop[1] * (image.width - width + 1))
    image = image.crop((left, top, left + width, top + height))
    pixels = np.asarray(image, np.float32).transpose(2, 0, 1) / 127.5 - 1
    return pixels, original, (top, left)


# ---- the latent cache ---------------------------------------------------------------------------------------

def file_digest(path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class FileCache:
    """A folder of safetensors files, one `<key>.safetensors` an entry, which runs (and processes) may share: an entry
    is written whole under a temporary name and renamed, and one that does not read is made again."""

    def __init__(self, folder, identity: str):
        self.folder, self.identity = os.fspath(folder), identity  # identity: the weights' digest and dtype

    def digest(self, *parts) -> str:
        import hashlib

        return hashlib.sha256(json.dumps([*parts, self.identity]).encode()).hexdigest()

    def path(self, key) -> str:
        return os.path.join(self.folder, f"{key}.safetensors")

    def read_entry(self, key):
        """({name: array}, metadata), or None where the entry is missing or unreadable."""
        from ..loading.files import read_safetensors, safetensors_metadata

        path = self.path(key)
        if not os.path.isfile(path):
            return None
        try:
            return {name: np.array(a) for name, a in read_safetensors(path).items()}, safetensors_metadata(path)
        except (OSError, ValueError, KeyError, TypeError):
            return None  # cut short or not ours: encoded again

    def write_entry(self, key, tensors, metadata=None):
        from .files import write_safetensors

        os.makedirs(self.folder, exist_ok=True)
        write_safetensors(self.path(key), {name: np.asarray(a, np.float32) for name, a in tensors.items()},
                          metadata or {}, overwrite=True)


class LatentCache(FileCache):
    """The VAE's posteriors of pictures: the mean and std scaled as the UNet sees latents (a row's latents are
    mean + std * noise, as the VAE's own sample), the original size and the crop corner. The key is a digest of the
    picture file's bytes, its training size, flip and crop (the centre) and the identity (the VAE's weights' digest
    and dtype): a changed picture or setting is encoded again."""

    def key(self, digest, size, flip) -> str:
        return self.digest(digest, list(size), bool(flip), "centre")

    def read(self, key):
        """(mean, std, original (h, w), corner (top, left)), or None."""
        entry = self.read_entry(key)
        try:
            tensors, info = entry
            return (tensors["mean"], tensors["std"], tuple(json.loads(info["original"])),
                    tuple(json.loads(info["corner"])))
        except (KeyError, TypeError, ValueError):
            return None

    def write(self, key, mean, std, original, corner):
        self.write_entry(key, {"mean": mean, "std": std},
                         {"original": json.dumps(list(original)), "corner": json.dumps(list(corner))})


class StateCache(FileCache):
    """The frozen text encoders' states of captions ({"prompt_embeds"}, SDXL's with "pooled_prompt_embeds"), keyed by
    the caption, its token ids (what the tokenizer made of it) and the identity (the encoders' weights' digest and
    the compute dtype): another caption, tokenizer or encoder is encoded again."""

    def key(self, caption, ids) -> str:
        return self.digest(caption, np.asarray(ids).tolist())

    def read(self, key):
        entry = self.read_entry(key)
        return None if entry is None or "prompt_embeds" not in entry[0] else entry[0]
