"""First Block Cache (ParaAttention's dynamic caching; diffusers' `FirstBlockCacheConfig` and
`apply_first_block_cache`): the transformer's first block runs at every evaluation, and where the residual it adds
to the image's tokens changed little since the last evaluation that ran every block,

    mean |r - r_prev| / mean |r_prev| <= threshold     (r_prev: the first block's residual at that evaluation),

the other blocks are skipped: the residual they added then is added to the first block's output again. The first
evaluation runs them all. SD 3.x's and Flux.1's transformers (the transformer form of DeepCache).

As diffusers decides, the means run over the whole batch of a transformer call, one decision for all its rows:
SD 3's [uncond; cond] batch as one; Flux.1's true CFG passes each alone, as diffusers' Flux pipelines run them as
two calls with a cache each. A batch split over devices (pmap, `generate_sharded`) sums over the devices first, so
the decision is the one-device one. The choice is a `lax.cond`: inside it hooks cannot emit (as DeepCache).

`trajectory.hooks["first_block_cache"]` (evals, B, passes) says which evaluations ran every block (1) or reused
them (0); `threshold` is traced: a new one does not recompile.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp

from .. import sampling
from ..models.flux import FluxTransformer2DModel
from ..models.mmdit import SD3Transformer2DModel
from ..utils import is_float32
from .core import Hook, current_scope, redirect

KEY = "first_block_cache"
TRANSFORMERS = (SD3Transformer2DModel, FluxTransformer2DModel)
# transformers whose diffusers pipelines run each guidance pass as a call of its own, with its own cache (Flux's
# true CFG: cache_context("cond") and ("uncond")); SD 3's runs [uncond; cond] in one call
PASSES_APART = (FluxTransformer2DModel,)


@flax.struct.dataclass
class FirstBlockCache(Hook):
    threshold: Any = 0.05
    carries = True

    def check_model(self, denoiser):
        if denoiser.component != "transformer":
            raise ValueError("first_block_cache works on a transformer's blocks (SD 3.x, Flux.1); a UNet's steps "
                             "are cached by deep_cache")

    def wrap_unet(self, unet_fn):
        def cached(x, t, context, step, **extra):
            scope = current_scope()

            def run(blocks, start=None):
                """The transformer's prediction running `blocks` only, and (module, the tokens entering them, (image,
                text) tokens after them)."""
                kept = []
                with redirect(TRANSFORMERS, "run_blocks", kept, blocks=blocks, start=start):
                    out = unet_fn(x, t, context, step, **extra)
                module, (entering, tokens) = kept[-1]
                return out, module, entering, tokens

            _, module, entering, (first, first_context) = run((0, 1))
            residual = first - entering
            passes = x.shape[0] // scope.batch if isinstance(module, PASSES_APART) else 1
            memory = scope.read(KEY)
            if memory is None:  # the memory's shapes are being found
                memory = {"residual": jnp.zeros_like(residual), "tail": jnp.zeros_like(residual)}
            compute = (step == 0) | self.changed(residual, memory["residual"], passes)
            rows = jnp.repeat(compute, x.shape[0] // passes)[:, None, None]  # (N, 1, 1): each row's pass's
            sealed = scope.sealed_copy("first_block_cache runs the blocks after the first inside a lax.cond, out of "
                                       "which hooks cannot emit or carry values: use it without hooks that emit")

            def reuse():
                with sampling.scope(None, within=sealed):
                    return run((0, 0), (first + memory["tail"], first_context))[0], memory["tail"]

            def full():
                with sampling.scope(None, within=sealed):
                    out, _, _, (last, _) = run((1, None), (first, first_context))
                tail = last - first
                if passes == 1:
                    return out, tail
                reused, _ = reuse()  # the passes that did not change keep their cached blocks
                return jnp.where(rows.reshape(-1, *[1] * (out.ndim - 1)), out, reused), \
                    jnp.where(rows, tail, memory["tail"])

            out, tail = jax.lax.cond(compute.any(), full, reuse)
            scope.write(KEY, {"residual": jnp.where(rows, residual, memory["residual"]), "tail": tail})
            scope.emit(KEY, jnp.broadcast_to(compute.astype(jnp.float32), (scope.batch, passes)))
            return out

        return cached

    def changed(self, residual, previous, passes):
        """(passes,) bool: whether each pass's first-block residual moved by more than `threshold` of its mean size,
        its means over its rows on every device (diffusers' `_should_compute_remaining_blocks`)."""
        residual, previous = (a.astype(jnp.float32).reshape(passes, -1) for a in (residual, previous))
        change = sampling.batch_sum(jnp.abs(residual - previous).sum(1))
        size = sampling.batch_sum(jnp.abs(previous).sum(1))
        return change / jnp.where(size > 0, size, 1) > self.threshold


def first_block_cache(threshold=0.05) -> FirstBlockCache:
    """Skip a transformer's blocks after the first while its residual changes by at most `threshold` (relative)."""
    if isinstance(threshold, (int, float)) and not (is_float32(threshold) and threshold >= 0):
        raise ValueError(f"first_block_cache(threshold={threshold}): the threshold is a relative change, a finite "
                         "number >= 0 (diffusers' default 0.05; 0 runs every block at every step)")
    return FirstBlockCache(jnp.float32(threshold) if isinstance(threshold, (int, float)) else threshold)
