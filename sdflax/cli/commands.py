"""`sdflax COMMAND ...`: parse, build the request, run it; a user's mistake is one line and status 2, anything
else is a bug and keeps its traceback."""

from __future__ import annotations

import sys

from . import batch, run
from .parse import build_parser
from .request import Request, UserError, input_errors


def main(argv=None) -> int:
    parser = build_parser(batch.add_command)
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
        return run.run(Request.from_args(args))
    except Exception as e:
        if not isinstance(e, UserError) and not isinstance(e, input_errors()):
            raise  # a bug of sdflax's: the traceback is what a report needs
        print(f"sdflax: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sdflax: interrupted", file=sys.stderr)
        return 130
