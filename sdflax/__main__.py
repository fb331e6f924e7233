"""`python -m sdflax ...`, the same as the `sdflax` command."""

from .cli import main

raise SystemExit(main())
