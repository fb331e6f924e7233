"""The machinery under every hook: where a hook sees the UNet, and how values leave and cross the scan.

A hook is a `flax.struct.dataclass`: its numbers (scales, strengths) are pytree leaves, traced like the prompts,
and its other fields (`pytree_node=False`: layer names, intervals) are the pytree's static structure. A pipeline
carries its hooks in `Inputs.hooks` (`Pipeline.with_hooks`), so jit keys its compiled programs on the hooks'
structure (the same hook set never recompiles, a new one compiles once) while changing a scale does not.

A hook overrides what it needs of:
    attend(site, attend, q, k, v) -> out       every Attention of the UNet: q (B, T, heads, d), k and v
                                               (B, S, heads, d); `attend` is the next hook's or the plain attention.
                                               An MMDiT's joint attention (`transformer_blocks.i.attn`) sees one
                                               sequence [image; text]: `site.image_tokens` says where the text begins
    queries(site, q) -> q                      every Attention's queries as to_q gives them (B, T, heads, d), the
                                               image's tokens only in an MMDiT, before its RMSNorm
    up_inputs(site, x, skip) -> (x, skip)      every up layer of the UNet, before x and its skip are concatenated
    condition(cond, settings) -> cond          the text conditioning (generate.Cond) before the UNet sees it:
                                               its rows fix the UNet's batch (PAG adds a third chunk)
    wrap_unet(unet_fn) -> unet_fn              the whole UNet call (DeepCache)
    combine(outputs, inputs, settings) -> prediction   the UNet's output, one array per chunk -> the prediction
                                               (PAG's guidance); the first hook that has one decides

They are applied through Flax's `nn.intercept_methods` on small methods, `Attention.attend`, `Attention.queries`
and `UNet2DConditionModel.up_inputs`: the models stay unaware of hooks, and a layer is addressed by its module path,
which is the checkpoint's name (`down_blocks.1.attentions.0.transformer_blocks.0.attn2`).

Inside the scan a hook may `emit(key, value)` per-image values (B, ...), which come back stacked per evaluation
in `output.trajectory.hooks[key]` (evals, B, ...), and `read`/`write` memory carried from one evaluation to the
next (DeepCache's features). Both go through the current `sampling.Scope`, which `sampling.denoise` opens around
every model evaluation: values are tracers of the step being traced, returned from the scan's body, so hooks stay
pure functions (jit, pmap, sharding, grad).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ..models.layers import Attention
from ..models.mmdit_blocks import JointAttention
from ..sampling import Scope, current_scope

__all__ = ["Hook", "LayerError", "Scope", "Site", "checkpoint_name", "current_scope", "intercept"]


class LayerError(ValueError):
    """A hook or guider names a layer the UNet has not (found once the UNet is traced): it would do nothing."""

@dataclasses.dataclass(frozen=True)
class Site:
    """Where a hook is called: the layer's checkpoint name, the evaluation index (traced), how many chunks of
    B rows the UNet's batch holds (1: conditional only, 2: [uncond; cond], 3: PAG's [uncond; cond; perturbed]),
    the up block index (up_inputs only), the module, and in an MMDiT's attention the image's tokens, which come
    first in its sequence (attend only)."""

    name: str
    step: Any
    chunks: int
    block: int | None = None
    module: Any = None
    image_tokens: int | None = None

    @property
    def mmdit(self) -> bool:
        return isinstance(self.module, JointAttention)

    @property
    def self_attention(self) -> bool:
        """Over the image's tokens alone: a UNet's attn1, an MMDiT's attn2 (SD 3.5 Medium's second attention)."""
        return self.name.endswith("attn1") or self.mmdit and self.name.endswith("attn2")

    @property
    def joint_attention(self) -> bool:
        """An MMDiT's attn: the image's and the text's tokens in one sequence."""
        return self.mmdit and self.name.endswith(".attn")

    @property
    def cross_attention(self) -> bool:
        return self.name.endswith("attn2") and not self.mmdit

    @property
    def perturbable(self) -> bool:
        """What diffusers' PAG, SEG and layer skips call self-attention (not cross-attention): a UNet's attn1, every
        attention of an MMDiT."""
        return self.self_attention or self.joint_attention

    @property
    def conditional_chunk(self) -> int:
        return 1 if self.chunks > 1 else 0

    def conditional(self, x):
        """The conditional chunk's rows of a (chunks * B, ...) array."""
        return jnp.split(x, self.chunks)[self.conditional_chunk]


def checkpoint_name(path) -> str:
    """A Flax module path -> the diffusers checkpoint's dotted name: ('down_blocks_1_attentions_0',
    'transformer_blocks_0', 'attn2') -> 'down_blocks.1.attentions.0.transformer_blocks.0.attn2'."""
    parts = (re.sub(r"_(attentions|resnets|downsamplers|upsamplers)(?=_\d)", r".\1", part) for part in path)
    parts = (re.sub(r"_(\d+)(?=[._]|$)", r".\1", part) for part in parts)
    return ".".join(re.sub(r"(\.\d+)_", r"\1.", part) for part in parts)


class Hook:
    """The base of every hook: each method leaves what it sees unchanged."""

    def attend(self, site, attend, q, k, v):
        return attend(q, k, v)

    def queries(self, site, q):
        return q

    def up_inputs(self, site, x, skip):
        return x, skip

    def condition(self, cond, settings):
        return cond

    def wrap_unet(self, unet_fn):
        return unet_fn

    def combine(self, outputs, inputs, settings):
        """The UNet's output, one array per chunk of the guidance batch -> the prediction. A hook that does not
        override it leaves the pipeline's guidance in place."""
        return None

    def check_model(self, denoiser):
        """Raise a ValueError in one line if the hook has no meaning on `denoiser` (`pipeline.denoisers`: a UNet,
        or SD 3's transformer, an MMDiT); checked before tracing."""

    def check_layers(self, sites):
        """Raise a LayerError naming the setting if a layer the hook names is not among `sites`, the names of the
        layers the UNet called it at (known once the UNet is traced): an unknown name would do nothing."""

    carries = False  # whether it reads and writes memory across evaluations


def intercept(hooks, step, chunks, sites=None):
    """A context in which the UNet's attention and up layers call `hooks` (the first listed outermost); each
    attention layer's name is added to the set `sites`."""

    def interceptor(next_fun, args, kwargs, context):
        module, method = context.module, context.method_name
        if method == "attend" and isinstance(module, Attention):
            site = Site(checkpoint_name(module.path), step, chunks, module=module,
                        image_tokens=kwargs.get("image_tokens"))
            if sites is not None:
                sites.add(site.name)
            call = lambda q, k, v: next_fun(q, k, v, **kwargs)  # noqa: E731
            for hook in reversed(hooks):
                call = _bind(hook.attend, site, call)
            return call(*args)
        if method == "queries" and isinstance(module, Attention):
            site = Site(checkpoint_name(module.path), step, chunks, module=module)
            q, = args
            for hook in hooks:
                q = hook.queries(site, q)
            return q
        if method == "up_inputs":
            x, skip, block = args
            site = Site(f"up_blocks.{block}", step, chunks, block=block, module=module)
            for hook in reversed(hooks):
                x, skip = hook.up_inputs(site, x, skip)
            return x, skip
        return next_fun(*args, **kwargs)

    return nn.intercept_methods(interceptor)


def redirect(models, method: str, kept=None, **keywords):
    """A context in which a call of a model of the classes `models` (the denoiser's, not a ControlNet's) runs its
    `method` instead, given `keywords` too: a hook reaches the model's parts through whatever wraps its call. With
    `kept` (a list), the method gives (output, more): the call returns the output, (the module, more) is appended to
    `kept`."""
    models = models if isinstance(models, tuple) else (models,)

    def interceptor(next_fun, args, kwargs, context):
        # the class itself: a ControlNet built on the denoiser's class (Flux.1's) keeps its own call
        if context.method_name == "__call__" and type(context.module) in models:
            out = getattr(context.module, method)(*args, **kwargs, **keywords)
            if kept is None:
                return out
            kept.append((context.module, out[1]))
            return out[0]
        return next_fun(*args, **kwargs)

    return nn.intercept_methods(interceptor)


def layer_list(names, limit=None) -> str:
    """The layer names (the first `limit` of them), to say what a hook could have named."""
    names = sorted(names)
    if limit is None or len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f", ... ({len(names)} in all)"


def refuse_on_mmdit(denoiser, hook: str, why: str):
    """The one-line refusal of a hook that has a meaning on a UNet only."""
    if denoiser.component != "unet":
        raise ValueError(f"{hook} works on a UNet only: {why}, which a transformer (SD 3.x's, Flux.1's) has not; "
                         "drop the hook")


def self_attention_names(sites) -> set:
    """The layers among `sites` (names) that diffusers' PAG and SEG perturb: a UNet's attn1, an MMDiT's attn and
    attn2 (an MMDiT's joint attentions end in `.attn`)."""
    mmdit = any(name.endswith(".attn") for name in sites)
    return {name for name in sites if name.endswith(("attn1", ".attn")) or mmdit and name.endswith(".attn2")}


def _bind(method, site, inner):
    return lambda q, k, v: method(site, inner, q, k, v)
