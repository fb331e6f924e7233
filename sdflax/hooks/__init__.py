"""Inside the UNet: attention maps and edits, FreeU, perturbed-attention guidance and DeepCache as hooks (on a
transformer: the first-block cache), each a short module on `core` (read it first), all in the one compiled scan:

    pipe = pipe.with_hooks(hooks.freeu(0.9, 0.2, 1.2, 1.4), hooks.cross_attention_maps())
    out = pipe(ids, params, key)
    out.trajectory.hooks["cross_attention_maps"]      # (evals, B, h, w, 77)
"""

from .attention_maps import cross_attention_maps, save_overlay, word_map
from .core import Hook, Site, checkpoint_name, current_scope
from .deep_cache import deep_cache
from .first_block_cache import first_block_cache
from .freeu import freeu
from .pag import perturbed_attention_guidance
from .prompt_to_prompt import prompt_to_prompt

__all__ = ["Hook", "Site", "checkpoint_name", "cross_attention_maps", "current_scope", "deep_cache", "first_block_cache",
           "freeu", "perturbed_attention_guidance", "prompt_to_prompt", "save_overlay", "word_map"]
