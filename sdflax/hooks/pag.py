"""Perturbed-attention guidance (PAG, Ahn et al. 2024), as diffusers' PAG pipelines: the UNet also runs on a
perturbed copy of the conditional rows whose self-attention in the chosen layers is the identity (each token
attends only to itself, so the layer outputs its values), and the prediction moves away from that copy:

    ε̂ = ε(∅) + s (ε(c) − ε(∅)) + s_pag (ε(c) − ε_perturbed(c))      (without CFG: ε(c) + s_pag (ε(c) − ε_ptb(c)))

`layers` are diffusers' `pag_applied_layers`: regular expressions searched in the self-attentions' checkpoint
names ("mid", "down_blocks.1", "up_blocks.0.attentions.1"); one that matches none ("down.block_2") is refused
once the UNet is traced.
"""

from __future__ import annotations

import re

import flax
import jax.numpy as jnp

from .. import sampling
from .core import Hook, LayerError, layer_list


@flax.struct.dataclass
class PerturbedAttentionGuidance(Hook):
    scale: float  # pag_scale, traced
    layers: tuple = flax.struct.field(pytree_node=False, default=("mid",))

    def applies(self, name) -> bool:
        return any(matches(layer, name) for layer in self.layers)

    def check_layers(self, sites):
        own = {name for name in sites if name.endswith("attn1")}
        for layer in self.layers:
            if not any(matches(layer, name) for name in own):
                blocks = {name.split(".transformer_blocks")[0] for name in own}
                raise LayerError(f"pag_applied_layers: {layer!r:.60} matches no self-attention layer of this UNet: "
                                 f"give a part of their names, e.g. 'mid' or one of {layer_list(blocks)}")

    def condition(self, cond, settings):
        return with_perturbed_copy(cond, settings)

    def attend(self, site, attend, q, k, v):
        if not (site.self_attention and self.applies(site.name)):
            return attend(q, k, v)
        n = q.shape[0] // site.chunks * (site.chunks - 1)  # the rows before the perturbed chunk
        return jnp.concatenate([attend(q[:n], k[:n], v[:n]), v[n:]])  # identity attention: out = v

    def combine(self, outputs, inputs, settings):
        *rest, perturbed = outputs
        cond = rest[-1]
        scale = jnp.asarray(inputs.guidance_scale, jnp.float32)
        if len(rest) == 1:
            return cond + self.scale * (cond - perturbed)
        guided = (settings.guidance or sampling.classifier_free_guidance)(rest[0], cond, scale)
        guided = guided + self.scale * (cond - perturbed)
        return sampling.rescale(guided, cond, jnp.asarray(inputs.guidance_rescale, jnp.float32))


def with_perturbed_copy(cond, settings):
    """The conditioning with the conditional rows once more, for the perturbed chunk: [uncond; cond] ->
    [uncond; cond; cond], or [cond] -> [cond; cond]."""
    def extend(x):
        return jnp.concatenate([x, jnp.split(x, 2)[1] if settings.classifier_free_guidance else x])
    return cond._replace(context=extend(cond.context),
                         unet_kwargs={name: extend(v) for name, v in cond.unet_kwargs.items()})


def matches(layer, name) -> bool:
    """diffusers' match: the pattern found in the name, but "blocks.1" is not "blocks.10"."""
    a, b = layer.split(".")[-1], name.split(".")[-1]
    fake_integral = a.isnumeric() and b.isnumeric() and a == b
    return bool(re.search(layer, name)) and not fake_integral


def perturbed_attention_guidance(pag_scale=3.0, pag_applied_layers=("mid",)) -> PerturbedAttentionGuidance:
    """The PAG hook: `pag_scale` traced, `pag_applied_layers` (a pattern or a list of them) static."""
    layers = (pag_applied_layers,) if isinstance(pag_applied_layers, str) else tuple(pag_applied_layers)
    for layer in layers:
        try:
            re.compile(layer)
        except (re.error, TypeError) as e:
            raise ValueError(f"pag_applied_layers: {layer!r:.60} is not a regular expression ({e}); give layer "
                             "names such as 'mid' or 'down_blocks.1'") from None
    return PerturbedAttentionGuidance(jnp.asarray(pag_scale, jnp.float32), layers)
