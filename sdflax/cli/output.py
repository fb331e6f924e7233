"""Where the PNGs go (`--out`: a folder or NAME.png, never over a file) and what they carry: one text chunk per
setting, and A1111's `parameters` line, which other image tools read."""

from __future__ import annotations

import errno
import math
import os
import re
import tempfile

from .features import having
from .manifest import as_text, link_png
from .request import UserError


class OutputTarget:
    """`--out`: a folder (PROMPT-SEED.png, never overwriting: a rerun's files are PROMPT-SEED-run2.png, ...) or one
    NAME.png."""

    def __init__(self, out):
        self.out = out
        self.file = out.lower().endswith(".png")
        self.folder = (os.path.dirname(out) or ".") if self.file else out

    def paths(self, prompt, seeds, grid):
        if self.file:
            if len(seeds) == 1 and not grid:
                return [self.out], None
            stem = self.out[:-4]
            return [f"{stem}-{s}.png" for s in seeds], (self.out if grid else None)
        stem = os.path.join(self.folder, slug(prompt))
        names = [f"{stem}-{s}" for s in seeds] + ([f"{stem}-{seeds[0]}-grid"] if grid else [])
        paths = unused_run(names)
        return paths[:len(seeds)], (paths[-1] if grid else None)

    def check_unused(self, prompt, seeds, grid):
        """Refuse, before loading, to write over a file: NAME.png's names are the user's, not sdflax's to change."""
        if not self.file:
            return  # in a folder, a run whose names are taken writes NAME-run2.png, NAME-run3.png, ...
        paths, grid_path = self.paths(prompt, seeds, grid)
        taken = [path for path in [*paths, grid_path] if path and os.path.lexists(path)]
        if taken:
            refuse_taken(self.out, taken)


def refuse_taken(out, taken):
    names = ", ".join(taken[:3]) + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
    raise UserError(f"--out {out}: {names} {'exists' if len(taken) == 1 else 'exist'}: sdflax never overwrites a "
                    "file; choose another --out, or a folder (--out DIR: names there are never reused)")


def output_target(out, grid=False, num_images=None) -> OutputTarget:
    """Check that PNGs can be written there now, before minutes of loading and compiling."""
    root, ext = os.path.splitext(out)
    if ext.lower() in (".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"):
        raise UserError(f"--out {out}: sdflax writes PNG files (they carry the settings): use {root}.png or a folder")
    target = OutputTarget(out)
    folder = target.folder
    if target.file and os.path.isdir(out):
        raise UserError(f"--out {out} is a folder: write {out}{os.sep} to put the images in it, or give another "
                        "NAME.png")
    if target.file and os.path.lexists(out) and (grid or num_images == 1):  # NAME.png is written: the image or
        refuse_taken(out, [out])  # the grid (else check_unused decides, once the device count and seeds are known)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"--out {out}: {folder} is a file, not a folder: give a folder or a NAME.png")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UserError(f"--out {out}: cannot write in {folder} ({e.strerror or e}): choose another --out") from e
    return target


def unused_run(stems):
    """STEM.png for each stem, or, where one of them is taken, STEM-runN.png with the first N >= 2 for which none is:
    the files of one run share their suffix, and the seed stays the last number before it."""
    paths, n = [f"{stem}.png" for stem in stems], 2
    while any(os.path.lexists(path) for path in paths):
        paths, n = [f"{stem}-run{n}.png" for stem in stems], n + 1
    return paths


def slug(text, limit=40):
    """A file-name-safe short form of the prompt: "A photo, of X!" -> "a-photo-of-x"."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    out = ""
    for word in words:
        if len(out) + len(word) + 1 > limit:
            break
        out = f"{out}-{word}" if out else word
    return out or (words[0][:limit] if words else "image")


def grid_shape(n):
    """(rows, cols) with rows * cols == n, as square as n allows, wider than tall."""
    rows = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    return rows, n // rows


def image_settings(request, scheduler, checkpoint, dtype) -> dict:
    """What a PNG records of the request that made it (`png_info`), all but the seed: the core settings, then each
    feature's."""
    settings = {"prompt": request.prompt, "negative_prompt": request.negative_prompt, "steps": checkpoint.steps,
                "scheduler": request.scheduler or scheduler_name(scheduler), "sampler": a1111_sampler(scheduler),
                "guidance_scale": checkpoint.guidance, "width": checkpoint.width, "height": checkpoint.height,
                "model": request.model, "revision": request.revision or ("main" if not checkpoint.local else ""),
                "commit": checkpoint.commit, "dtype": dtype, "software": f"sdflax {sdflax_version()}"}
    if checkpoint.strength is not None:  # none where sampling starts from noise (SD 3.x's inpainting ControlNet)
        settings["strength"] = checkpoint.strength
    if request.image is not None:
        settings.update(image=request.image, **({"mask": request.mask} if request.mask is not None else {}))
    settings.update({key: value for key, value in (("prompt_2", request.prompt_2),
                                                   ("negative_prompt_2", request.negative_prompt_2))
                     if value is not None})
    if checkpoint.single_file and request.config:
        settings["config"] = request.config
    for _, feature_settings in having("settings"):
        settings.update(feature_settings(request, checkpoint))
    return settings


def png_info(settings):
    """PNG text chunks: one per setting, and A1111's `parameters` line, which other image tools read."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in settings.items():  # iTXt (UTF-8) where Latin-1 cannot hold the text
        info.add_text(key, as_text(value))
    s = settings
    in_prompt = "".join(text(s) for _, text in having("prompt_parameters"))  # A1111's <lora:NAME:WEIGHT>
    negative = f"\nNegative prompt: {s['negative_prompt']}" if s["negative_prompt"] else ""  # none: no line, as A1111
    sampler, schedule = a1111_parameters_sampler(s.get("sampler", s["scheduler"]))
    schedule = f", Schedule type: {schedule}" if schedule else ""
    scales = next(filter(None, (text(s) for _, text in having("scale_parameters"))), None)
    scales = scales or f"CFG scale: {s['guidance_scale']}"
    parameters = (f"{s['prompt']}{in_prompt}{negative}\nSteps: {s['steps']}, Sampler: {sampler}{schedule}, {scales}, "
                  f"Seed: {s['seed']}, Size: {s['width']}x{s['height']}, Model: {s['model']}")
    if "strength" in s:
        parameters += f", Denoising strength: {s['strength']}"
    parameters += "".join(text(s) for _, text in having("parameters"))
    info.add_text("parameters", parameters)
    return info


def save(request, target, images, seeds, settings) -> list[str]:
    """Each image as a PNG with the settings that make it again (and the grid), never over an existing file: the
    images' paths."""
    paths, grid_path = target.paths(request.prompt, seeds, request.grid)
    try:
        for path, image, s in zip(paths, images, seeds):
            write_png(path, image, png_info({**settings, "seed": s}))
        if grid_path:
            from ..utils import make_image_grid

            rows, cols = grid_shape(len(images))
            write_png(grid_path, make_image_grid(images, rows, cols),
                      png_info({**settings, "seed": seeds[0], "seeds": ",".join(map(str, seeds))}))
    except FileExistsError as e:  # made since the check before loading
        raise UserError(f"--out {request.out}: {e.filename} exists now: sdflax never overwrites a file; choose "
                        "another --out, or a folder") from e
    except OSError as e:
        raise UserError(f"cannot write {e.filename or request.out}: {e.strerror or e}") from e
    return paths


def write_png(path, image, info):
    """The PNG whole or not at all, as `batch` writes its own: under a temporary name, then linked into place. A
    full disk leaves no partial file under the name (which the next run would refuse as taken), and a file that
    appeared while sampling is never replaced."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        link_png(folder, name, image, info, os.getpid())
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path) from None
    print(path)


def a1111_sampler(scheduler):
    """A1111's name of the sampler and its schedule type, else sdflax's name."""
    from ..schedulers import a1111_name

    return a1111_name(scheduler) or scheduler_name(scheduler)


def a1111_parameters_sampler(name):
    """(Sampler, Schedule type or None) as A1111 writes them for a scheduler's name ("Euler a SGM Uniform" ->
    "Euler a", "SGM Uniform"), so that A1111 runs the same schedule."""
    from ..schedulers import SCHEDULERS, names

    return names.parameters_sampler(name, SCHEDULERS)


def scheduler_name(scheduler):
    from ..schedulers import SCHEDULERS

    return next((name for name, cls in SCHEDULERS.items() if type(scheduler) is cls), type(scheduler).__name__)


def sdflax_version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sdflax")
    except PackageNotFoundError:
        return "unknown"
