"""`sdflax grid PROMPT --x NAME=V1,V2 [--y ...] [--z ...]`: A1111's X/Y/Z plot. Every option of `sdflax generate`
may be an axis; each cell is the request `sdflax generate` builds from the same flags with the cell's values, so it
makes the same pixels. Cells that differ only in the call's inputs (seeds, prompts, guidance, scales) share the
loaded pipeline and one compiled program, and those that differ only in seed and prompt are rows of one batch.
Written: one labelled grid PNG per z value, each cell as its own PNG with its settings, and a JSON of the cells."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import os
import sys

from .options import add_options
from .output import image_settings, png_info, slug, unused_run, write_png
from .parse import prompt_text, strength
from .request import Request, UserError

ALIASES = {"sampler": "scheduler", "cfg": "guidance"}  # A1111's axis names
NOT_AXES = ("--out", "--grid", "--num-images", "--progress", "--cache-dir", "--trajectory", "--trajectory-sheet",
            "--attention-maps")  # one per grid, or one file for every cell
# Read only by the call, after loading: cells that differ in these alone share the loaded pipeline.
CALL_FIELDS = ("prompt", "negative_prompt", "prompt_2", "negative_prompt_2", "prompt_3", "negative_prompt_3", "seed",
               "guidance", "steps", "height", "width", "strength", "image", "mask", "control_scale", "control_image",
               "adapter_scale", "adapter_image", "ip_image", "guider", "guider_arg", "true_cfg", "slg_scale")
ROW_FIELDS = ("prompt", "negative_prompt", "prompt_2", "negative_prompt_2", "prompt_3", "negative_prompt_3", "seed")


def axis(text):
    """NAME=V1,V2,... -> (NAME, (V1, V2, ...)), NAME as the flag is spelled, without its dashes."""
    name, equals, values = text.partition("=")
    values = tuple(value.strip() for value in values.split(","))
    if not equals or not name.strip() or not all(values):
        raise argparse.ArgumentTypeError(f"expected NAME=V1,V2,... with NAME an option of sdflax generate (e.g. "
                                         f"steps=10,20,30 or \"sampler=Euler,DPM++ 2M Karras\"), got {text!r}")
    return name.strip().lower().replace("_", "-"), values


def add_command(commands):
    g = commands.add_parser("grid", help="X/Y/Z plot: an option's values per axis -> labelled grid PNGs",
                            description="Make one image per combination of the axes' values (any option of "
                            "sdflax generate: sampler, steps, guidance, seed, strength, lora, guider-arg, "
                            "control-scale, ...) and draw them as a labelled grid per --z value, as A1111's X/Y/Z "
                            "plot. Each cell is also written as the PNG sdflax generate writes for its options.")
    g.add_argument("prompt", type=prompt_text, help="what to draw")
    for letter, role in (("x", "the columns"), ("y", "the rows"), ("z", "one grid per value")):
        g.add_argument(f"--{letter}", type=axis, required=letter == "x", metavar="NAME=V1,V2,...",
                       help=f"{role}: an option of sdflax generate (without its dashes; sampler is --scheduler, cfg "
                       "--guidance) and its values; a repeatable option's value is added to those given outside")
    g.add_argument("--image", metavar="IN.png", help="start from this picture (img2img; with --mask, inpaint)")
    g.add_argument("--mask", metavar="MASK.png", help="with --image: white is repainted, black kept")
    g.add_argument("--strength", type=strength, help="with --image: how far to noise it, in (0, 1]")
    g.add_argument("--metrics", action="store_true", help="write each cell's CLIP score with its prompt under it "
                   "(sdflax.metrics.clip_score; needs --clip)")
    g.add_argument("--clip", metavar="ID_OR_DIR", help="with --metrics: a transformers CLIPModel folder or hub id")
    add_options(g, "generate", exclude=NOT_AXES)
    g.add_argument("--out", default="grids", metavar="DIR", help="the folder of the grids, cells and JSON "
                   "(default: grids/); names already there are never reused")
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="print only the "
                   "files written")
    g.set_defaults(cell_parser=g)


@dataclasses.dataclass(frozen=True)
class Cell:
    place: tuple  # (x, y, z) indices
    values: tuple  # the axes' values, in the order of the axes
    request: Request


def cells_of(args) -> tuple[list, list[Cell]]:
    """(axes, cells): each cell's request is the grid's flags with its axes' values, parsed as generate parses
    them."""
    axes = [(letter, *getattr(args, letter)) for letter in "xyz" if getattr(args, letter)]
    names = [name for _, name, _ in axes]
    if len(set(names)) < len(names):
        raise UserError(f"--x/--y/--z: {', '.join(sorted({n for n in names if names.count(n) > 1}))} is on two axes: "
                        "give each option one axis")
    actions = [action_of(args.cell_parser, letter, name) for letter, name, _ in axes]
    command = "inpaint" if args.mask else "img2img" if args.image else "generate"
    cells = []
    sizes = [len(values) for _, _, values in axes] + [1] * (3 - len(axes))
    for place in itertools.product(*(range(n) for n in reversed(sizes))):  # row by row, z outermost
        place = place[::-1]
        namespace = copy.copy(args)
        values = tuple(values[i] for (_, _, values), i in zip(axes, place))
        for (letter, name, _), action, value in zip(axes, actions, values):
            set_value(args.cell_parser, namespace, action, f"--{letter} {name}={value}", value)
        cells.append(Cell(place, values, Request.from_args(namespace, command=command)))
    return axes, cells


def action_of(parser, letter, name):
    """The parser's action of an axis' option (or the prompt)."""
    flag = "--" + ALIASES.get(name, name)
    for action in parser._actions:
        if (flag in action.option_strings or action.dest == name == "prompt") and flag not in NOT_AXES \
                and flag not in ("--x", "--y", "--z", "--metrics", "--clip") and action.nargs != 0:
            return action
    raise UserError(f"--{letter} {name}=...: {name} is no option of sdflax grid that takes a value: give an option "
                    "of sdflax generate without its dashes (sampler, steps, guidance, seed, lora, ...)")


def set_value(parser, namespace, action, given, value):
    """The value parsed by the action's type, stored as the action stores it (a repeatable option adds it)."""
    try:
        parsed = action.type(value) if action.type else value
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        raise UserError(f"{given}: {e}") from None
    if action.choices is not None and parsed not in action.choices:
        raise UserError(f"{given}: choose from {', '.join(map(str, action.choices))}")
    setattr(namespace, action.dest, copy.copy(getattr(namespace, action.dest)))
    action(parser, namespace, parsed, given)


def label(name, value) -> str:
    return f"{name}: {value}"


def run(args) -> int:
    from .run import check_flags, load, sample_rows, use_compile_cache
    from .pictures import read_pictures
    from .preflight import check_checkpoint

    status = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.progress is not False else (lambda m: 0)
    if args.out.lower().endswith(".png") or (os.path.exists(args.out) and not os.path.isdir(args.out)):
        raise UserError(f"--out {args.out}: sdflax grid writes a folder of PNGs and a JSON: give a folder")
    if args.metrics and not args.clip:
        raise UserError("--metrics scores each cell with CLIP: add --clip ID_OR_DIR (a transformers CLIPModel, e.g. "
                        "openai/clip-vit-large-patch14)")
    axes, cells = cells_of(args)
    pictures, checked = {}, []
    for cell in cells:
        key = (cell.request.image, cell.request.mask)
        if key not in pictures:
            pictures[key] = read_pictures(cell.request)
        check_flags(cell.request)
        checkpoint, resized = check_checkpoint(cell.request, pictures[key])
        checked.append((dataclasses.replace(cell.request, steps=checkpoint.steps), checkpoint, resized))
    os.makedirs(args.out, exist_ok=True)

    import jax

    from ..parallel import device_mesh, replicate_on

    use_compile_cache(checked[0][0])
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    mesh = device_mesh()
    base_seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    checked = [(r if r.seed is not None else dataclasses.replace(r, seed=base_seed), c, p) for r, c, p in checked]
    images, settings = [None] * len(cells), [None] * len(cells)
    for loads in grouped(range(len(cells)), lambda i: without(checked[i][0], CALL_FIELDS)).values():
        request, checkpoint, _ = checked[loads[0]]
        status(f"Loading {request.model} for {len(loads)} cell(s) ...")
        pipeline, params = load(request, checkpoint, dtype)
        replicated = replicate_on(params, mesh)
        for batch in grouped(loads, lambda i: without(checked[i][0], ROW_FIELDS)).values():
            request, checkpoint, resized = checked[batch[0]]
            rows = [checked[i][0] for i in batch]
            rows += [rows[-1]] * (-len(rows) % mesh.size)  # every device a row
            status(f"Sampling {len(batch)} cell(s): {request.steps} steps at {checkpoint.width}x{checkpoint.height}")
            made = sample_rows(pipeline, replicated, mesh, checkpoint, rows, resized)()
            for i, image in zip(batch, pipeline.numpy_to_pil(made)):
                images[i] = image
                settings[i] = {**image_settings(checked[i][0], pipeline.scheduler, checkpoint, dtype),
                               "seed": checked[i][0].seed}
    scores = clip_scores(args, images, [r.prompt for r, _, _ in checked]) if args.metrics else None
    write(args, axes, cells, images, settings, scores)
    return 0


def grouped(indices, key) -> dict:
    groups = {}
    for i in indices:
        groups.setdefault(key(i), []).append(i)
    return groups


def without(request, fields) -> Request:
    return dataclasses.replace(request, **{field: None for field in fields})


def clip_scores(args, images, prompts) -> list[float]:
    from .. import metrics

    return [float(s) for s in metrics.clip_scores(images, prompts, metrics.load_clip(args.clip))]


def write(args, axes, cells, images, settings, scores):
    """The cells' PNGs, a labelled grid per z value and the JSON, under names not yet taken."""
    from .sheets import labelled_grid, labelled_strip

    stem = os.path.join(args.out, slug(args.prompt))
    letters = [letter for letter, _, _ in axes]
    names = [stem + "-" + "-".join(f"{letter}{i}" for letter, i in zip(letters, cell.place)) for cell in cells]
    z_count = len(axes[2][2]) if len(axes) == 3 else 1
    grids = [f"{stem}-grid" + (f"-z{k}" if len(axes) == 3 else "") for k in range(z_count)]
    paths = unused_run(names + grids + [f"{stem}-grid-cells"])
    json_path = paths.pop()[:-4] + ".json"
    try:
        for path, image, s in zip(paths, images, settings):
            write_png(path, image, png_info(s))
        shown = images if scores is None else [labelled_strip([image], [f"CLIP {score:.2f}"])
                                               for image, score in zip(images, scores)]
        by_place = {cell.place: picture for cell, picture in zip(cells, shown)}
        x_name, x_values = axes[0][1:]
        y_name, y_values = axes[1][1:] if len(axes) > 1 else ("", ("",))
        for k, path in enumerate(paths[len(cells):]):
            rows = [[by_place[(i, j, k)] for i in range(len(x_values))] for j in range(len(y_values))]
            title = label(*axes[2][1:2], axes[2][2][k]) if len(axes) == 3 else None
            grid = labelled_grid(rows, [label(x_name, v) for v in x_values],
                                 [label(y_name, v) if y_name else "" for v in y_values], title)
            write_png(path, grid, png_info({**settings[0], "grid": json.dumps([list(a) for a in axes])}))
        with open(json_path, "x") as file:
            json.dump({"prompt": args.prompt, "axes": [{"axis": letter, "option": name, "values": list(values)}
                                                       for letter, name, values in axes],
                       "cells": [{**{name: value for (_, name, _), value in zip(axes, cell.values)},
                                  "place": dict(zip(letters, cell.place)), "path": path, "seed": s["seed"],
                                  **({"clip_score": scores[i]} if scores is not None else {})}
                                 for i, (cell, path, s) in enumerate(zip(cells, paths, settings))]}, file, indent=1)
        print(json_path)
    except FileExistsError as e:
        raise UserError(f"--out {args.out}: {e.filename} exists now: sdflax never overwrites a file; run again") from e
