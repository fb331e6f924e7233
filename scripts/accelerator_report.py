"""The accelerator report's command line: sdflax against diffusers (PyTorch) on the device it finds, as one JSON.

    python scripts/accelerator_report.py --out report.json

Its code is the package beside this file, scripts/accelerator_report/ (which `import accelerator_report` finds
before this file): the package's docstring, also this command's --help, says how to run it on a GPU, a TPU or the
CPU, what it measures and what its JSON holds. The report's jobs run this file again, one job each.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the package's folder, also under runpy.run_path
    from accelerator_report import main

    sys.exit(main())
