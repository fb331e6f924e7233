"""`python -m sdflax ...` and the `sdflax` command: generate, img2img and inpaint (cli.py), and batch (batch.py,
built on cli.py's pieces; cli.py does not import it, so that the two make no import cycle)."""

from .batch import add_command
from .cli import main as _main


def main(argv=None) -> int:
    return _main(argv, commands=(add_command,))


if __name__ == "__main__":
    raise SystemExit(main())
