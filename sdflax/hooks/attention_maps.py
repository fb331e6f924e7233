"""Cross-attention maps (DAAM, Tang et al. 2022): for every text token, how much each latent pixel attends to it,
averaged over heads and cross-attention layers (each upsampled to the latents' resolution) at every evaluation;
the steps' mean is the word's heat map. The hook leaves the images unchanged.

SD 3.x's transformer has no cross-attention: its joint attentions (`transformer_blocks.i.attn`) attend over one
sequence [image; text], and their probabilities' image-to-text block is the analogue, each image token's share of
attention given to each text token (not renormalised over the text). Its text tokens are CLIP's 77, then T5's
(S = 77 + max_sequence_length): `word_map(maps[..., :77], ids[:, :77], ...)` with CLIP's ids."""

from __future__ import annotations

import flax
import jax.numpy as jnp
import numpy as np

from ..models.layers import attention_probs
from .core import Hook, current_scope, layer_list

KEY = "cross_attention_maps"


@flax.struct.dataclass
class CrossAttentionMaps(Hook):
    layers: tuple | None = flax.struct.field(pytree_node=False, default=None)  # checkpoint names; None: all
    per_layer: bool = flax.struct.field(pytree_node=False, default=False)  # also emit each layer's, by its name

    def attend(self, site, attend, q, k, v):
        if (site.cross_attention or site.joint_attention) and (self.layers is None or site.name in self.layers):
            probs = site.conditional(attention_probs(q, k, site.module.upcast)).mean(1)  # (B, T, S), heads' mean
            if site.joint_attention:  # the image's tokens over the text's
                probs = probs[:, :site.image_tokens, site.image_tokens:]
            scope = current_scope()
            maps = to_latent_size(probs, scope.latent_size)
            scope.emit_mean(KEY, maps)
            if self.per_layer:
                scope.emit(site.name, maps)
        return attend(q, k, v)

    def check_layers(self, sites):
        mmdit = any(name.endswith(".attn") for name in sites)
        cross = {name for name in sites if name.endswith(".attn" if mmdit else "attn2")}
        for layer in self.layers or ():
            if layer not in cross:
                kind = "joint" if mmdit else "cross"
                raise ValueError(f"cross_attention_maps: layers {layer!r:.80} is not a {kind}-attention layer of this "
                                 f"UNet: give their full names: {layer_list(cross, 3)}")


def cross_attention_maps(layers=None, per_layer=False) -> CrossAttentionMaps:
    """The hook; its maps come back as `output.trajectory.hooks["cross_attention_maps"]`, (evals, B, h, w, 77)."""
    return CrossAttentionMaps(None if layers is None else tuple(layers), per_layer)


def to_latent_size(probs, latent_size):
    """(B, T, S) over a layer's T = h' w' pixels -> (B, h, w, S) at the latents' (h, w), nearest-neighbour."""
    h, w = latent_size
    f = next(f for f in (2 ** i for i in range(16)) if -(-h // f) * -(-w // f) == probs.shape[1])
    maps = probs.reshape(probs.shape[0], -(-h // f), -(-w // f), probs.shape[-1])
    return jnp.repeat(jnp.repeat(maps, f, axis=1), f, axis=2)[:, :h, :w]


def word_map(maps, ids, word_ids):
    """A word's heat map (B, h, w) from maps (evals, B, h, w, S) (their steps' mean) or (B, h, w, S): the sum over
    the positions in `ids` (B, S) of the word's token ids `word_ids` (`tokenizer(word).input_ids[1:-1]`)."""
    maps = np.asarray(maps)
    maps = maps.mean(0) if maps.ndim == 5 else maps
    ids = np.asarray(ids).reshape(maps.shape[0], -1)
    mask = np.isin(ids, list(word_ids)).astype(np.float32)  # (B, S)
    return np.einsum("bhws,bs->bhw", maps, mask)


def overlay(image, heat, alpha=0.5):
    """One image (H, W, 3) in [0, 1] with a heat map (h, w) laid over it in red, normalised to its maximum and
    resized to the image (bilinear): a PIL image."""
    from PIL import Image

    image = np.asarray(image, np.float32)
    heat = np.asarray(heat, np.float32)
    heat = heat / max(float(heat.max()), 1e-12)
    heat = np.asarray(Image.fromarray(heat).resize(image.shape[1::-1], Image.BILINEAR))[..., None]
    red = np.zeros_like(image)
    red[..., 0] = 1
    out = (1 - alpha * heat) * image + alpha * heat * red
    return Image.fromarray((np.clip(out, 0, 1) * 255).round().astype(np.uint8))


def save_overlay(image, heat, path, alpha=0.5):
    """`overlay` as a PNG."""
    overlay(image, heat, alpha).save(path)
    return path
