"""DeepCache (Ma et al. 2023): the UNet's deep features change slowly from one step to the next, so compute them
only every `interval` evaluations and reuse them in between, running only the shallow branch: the layers down to
skip connection `branch` and the up layers from the one that takes it. The cached features are carried through
the scan; the choice between the full UNet and the shallow branch is a `lax.cond` on the evaluation index.

`branch` counts skip connections from the top (0: conv_in's output, 1: the first down layer's, ...): with the
default 1 the shallow branch is conv_in, the first down layer and the last two up layers, about DeepCache's
shallowest SD setting (cache_layer_id=0, cache_block_id=0). DeepCache's evaluation runs in a
`lax.cond`, so it composes with hooks that change the UNet (FreeU, PAG), not with hooks that emit values.
"""

from __future__ import annotations

import flax
import jax

from .. import sampling
from ..models.unet import UNet2DConditionModel
from .core import Hook, current_scope, redirect, refuse_on_mmdit

KEY = "deep_cache"


@flax.struct.dataclass
class DeepCache(Hook):
    interval: int = flax.struct.field(pytree_node=False, default=3)
    branch: int = flax.struct.field(pytree_node=False, default=1)
    carries = True

    def check_model(self, denoiser):
        refuse_on_mmdit(denoiser, "deep_cache", "it reuses the deep features of a UNet's down and up blocks between "
                        "steps, rerunning only the shallow layers around one of its skip connections")

    def wrap_unet(self, unet_fn):
        def cached(x, t, context, step, **residuals):
            scope = current_scope()
            features = scope.read(KEY)  # from the last full evaluation

            def full():
                with redirect(UNet2DConditionModel, "deep", branch=self.branch):
                    return unet_fn(x, t, context, step, **residuals)

            if features is None or self.interval == 1:
                out, features = full()
            else:
                sealed = scope.sealed_copy("DeepCache runs the UNet inside a lax.cond, out of which hooks cannot "
                                           "emit or carry values: use it without hooks that emit (attention maps)")

                def sealed_full():
                    with sampling.scope(None, within=sealed):
                        return full()

                def shallow():
                    with sampling.scope(None, within=sealed), redirect(UNet2DConditionModel, "shallow",
                                                                       branch=self.branch, features=features):
                        return unet_fn(x, t, context, step, **residuals), features

                out, features = jax.lax.cond(step % self.interval == 0, sealed_full, shallow)
            scope.write(KEY, features)
            return out

        return cached


def deep_cache(interval=3, branch=1) -> DeepCache:
    """The full UNet every `interval` evaluations (the first included), else the shallow branch at `branch`."""
    if interval < 1 or branch < 0:
        raise ValueError(f"deep_cache(interval={interval}, branch={branch}): interval must be at least 1 and "
                         "branch a skip-connection index (0, 1, ...)")
    return DeepCache(int(interval), int(branch))
