"""Perturbed-attention guidance (PAG, Ahn et al. 2024), as diffusers' PAG pipelines: the UNet also runs on a
perturbed copy of the conditional rows whose self-attention in the chosen layers is the identity (each token
attends only to itself, so the layer outputs its values), and the prediction moves away from that copy:

    ε̂ = ε(∅) + s (ε(c) − ε(∅)) + s_pag (ε(c) − ε_perturbed(c))      (without CFG: ε(c) + s_pag (ε(c) − ε_ptb(c)))

`layers` are diffusers' `pag_applied_layers`: regular expressions searched in the self-attentions' checkpoint
names ("mid", "down_blocks.1", "up_blocks.0.attentions.1"; on SD 3's transformer "blocks.1", "blocks.(1|2)"); one
that matches none ("down.block_2") is refused once the UNet is traced.

On an MMDiT's joint attention the perturbation is diffusers' StableDiffusion3PAGPipeline's
(PAGJointAttnProcessor2_0): among the image's tokens each attends only to itself, but it still attends to the
text's tokens, and those attend to every token. (diffusers' processor also leaves out SD 3.5's query and key
RMSNorms, in every chunk; sdflax keeps them.)
"""

from __future__ import annotations

import re

import flax
import jax
import jax.numpy as jnp
import numpy as np

from .. import sampling
from ..models.layers import apply_probs
from .core import Hook, LayerError, layer_list, self_attention_names


@flax.struct.dataclass
class PerturbedAttentionGuidance(Hook):
    scale: float  # pag_scale, traced
    layers: tuple = flax.struct.field(pytree_node=False, default=("mid",))

    def applies(self, name) -> bool:
        return any(matches(layer, name) for layer in self.layers)

    def check_layers(self, sites):
        own = self_attention_names(sites)
        for layer in self.layers:
            if not any(matches(layer, name) for name in own):
                blocks = {name.split(".transformer_blocks")[0] if ".transformer_blocks" in name
                          else name.rsplit(".", 1)[0] for name in own}
                mid = "'mid' or " if any(name.startswith("mid_block") for name in own) else ""
                raise LayerError(f"pag_applied_layers: {layer!r:.60} matches no self-attention layer of this UNet: "
                                 f"give a part of their names, e.g. {mid}one of {layer_list(blocks)}")

    def condition(self, cond, settings):
        return with_perturbed_copy(cond, settings)

    def attend(self, site, attend, q, k, v):
        if not (site.perturbable and self.applies(site.name)):
            return attend(q, k, v)
        n = q.shape[0] // site.chunks * (site.chunks - 1)  # the rows before the perturbed chunk
        if site.joint_attention:
            perturbed = image_identity_attention(q[n:], k[n:], v[n:], site.image_tokens, site.module.upcast)
        else:
            perturbed = v[n:]  # identity attention: out = v
        return jnp.concatenate([attend(q[:n], k[:n], v[:n]), perturbed])

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


def image_identity_attention(q, k, v, image_tokens, upcast=True):
    """Joint attention over [image; text] tokens (B, T, heads, d) with the image-to-image scores the identity, as
    diffusers' PAGJointAttnProcessor2_0 masks them: an image token attends to itself and the text's tokens."""
    total = q.shape[1]
    hidden = np.zeros((total, total), bool)
    hidden[:image_tokens, :image_tokens] = ~np.eye(image_tokens, dtype=bool)
    if upcast:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(q.shape[-1]).astype(np.float32)
    probs = jax.nn.softmax(jnp.where(hidden, -jnp.inf, logits), axis=-1)
    return apply_probs(probs, v)


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
