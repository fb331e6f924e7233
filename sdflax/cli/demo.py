"""`sdflax demo FAMILY [--out DIR]`: tiny random-weight stand-ins of the hub's checkpoints (`sdflax.demo`), written
without torch, so that every page of the docs runs offline."""

from __future__ import annotations

from ..demo import FAMILIES  # names only: the writers import JAX when they run
from .request import UserError


def add_command(commands):
    d = commands.add_parser("demo", help="write tiny random-weight stand-ins of the hub's checkpoints (offline)",
                            description="Write small random-weight checkpoints in the hub's diffusers layout, which "
                            "sdflax and diffusers both read: put one where a docs page names a hub id to run the page "
                            "offline. They draw noise, not pictures. An existing folder is never overwritten.")
    d.add_argument("family", choices=(*FAMILIES, "all"), help="sd15 (tiny-sd15), sdxl (tiny-sdxl and "
                   "tiny-sdxl-refiner), sd35 (tiny-sd35), sd15-controlnet and sdxl-controlnet (for tiny-sd15, "
                   "tiny-sdxl), ip-adapter (h94's layout, for tiny-sd15), t2i-adapter (a canny one, for tiny-sd15), "
                   "or all")
    d.add_argument("--out", default="weights", metavar="DIR", help="the folder to write them in (default: weights)")


def run(args) -> int:
    from ..demo import write_demo

    try:
        written = write_demo(args.family, args.out)
    except FileExistsError as e:
        raise UserError(str(e)) from None
    except OSError as e:  # --out cannot be written
        raise UserError(f"--out {args.out}: {e.strerror or e} ({e.filename or args.out})") from None
    for path in written:
        print(path)
    return 0
