"""`sdflax COMMAND ...`: parse, build the request, run it; a user's mistake is one line and status 2, anything
else is a bug and keeps its traceback."""

from __future__ import annotations

import sys

from . import batch, demo, evaluate, grid, run, train_options
from .options import build_parser
from .request import Request, UserError, input_errors


def main(argv=None) -> int:
    parser = build_parser(batch.add_command, train_options.add_command, evaluate.add_command, grid.add_command,
                          demo.add_command)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed its line (or --help / --version)
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "batch":
            return batch.run(args)
        if args.command == "eval":
            return evaluate.run(args)
        if args.command == "demo":
            return demo.run(args)
        if args.command == "grid":
            return grid.run(args)
        if args.command == "train":
            from . import train

            return train.run(args)
        return run.run(Request.from_args(args))
    except Exception as e:
        # a UserError first: the library's error types import JAX, which a mistake found before it never needs
        if not isinstance(e, UserError) and not isinstance(e, input_errors()) and not raised_by_a_check(e):
            raise  # a bug of sdflax's: the traceback is what a report needs
        print(f"sdflax: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sdflax: interrupted", file=sys.stderr)
        return 130


def raised_by_a_check(error) -> bool:
    """A ValueError or TypeError raised by sdflax's own code: a check of the library's (which the command line
    reached before its own checks did), whose message is for the user; one raised inside numpy or JAX is a bug."""
    if not isinstance(error, (ValueError, TypeError)) or error.__traceback__ is None:
        return False
    frame = error.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    return frame.tb_frame.f_globals.get("__name__", "").split(".")[0] == "sdflax"
