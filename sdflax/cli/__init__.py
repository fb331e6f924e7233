"""The `sdflax` command: `generate "PROMPT"`, `img2img "PROMPT" --image IN.png`, `inpaint "PROMPT" --image IN.png
--mask MASK.png` and `batch PROMPTS --out DIR`: PNG files made on all devices, each carrying the settings that made
it. A run is a `Request` (request.py), built from the flags (parse.py) or a line of a prompt file (batch.py),
checked against the checkpoint's configs before anything loads (preflight.py, pictures.py), made by one call over
a device mesh (run.py) and written with its settings (output.py). Each addition a request may use (ControlNets,
adapters, LoRAs, a guider, ...) is one module of features/, with its flags, checks, loading, call arguments and PNG
text; a family's own side is unet.py or sd3.py (`Family.cli`).

User errors (bad flags, a folder that is not a checkpoint, an unknown or uncached model, an unwritable output
path) print one line on stderr and exit with status 2; anything else is a bug and keeps its traceback.
"""

from .commands import main
from .output import grid_shape, png_info, scheduler_name, slug
from .features.lora import lora_argument
from .options import build_parser
from .pictures import read_picture
from .request import CONFIG_FILES, DEFAULT_MODEL, Request, UserError
from .run import CompileClock, StepBar

__all__ = ["CONFIG_FILES", "CompileClock", "DEFAULT_MODEL", "Request", "StepBar", "UserError", "build_parser",
           "grid_shape", "lora_argument", "main", "png_info", "read_picture", "scheduler_name", "slug"]
