"""`python -m accelerator_report`, with scripts/ on the path: the same run as `python scripts/accelerator_report.py`."""

import sys

from . import main

sys.exit(main())
