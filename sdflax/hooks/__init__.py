"""Inside the UNet: attention maps and edits, FreeU, perturbed-attention guidance and DeepCache as hooks, each a
short module on `core` (read it first), all in the one compiled scan."""

from .core import Hook, Scope, Site, checkpoint_name, current_scope
