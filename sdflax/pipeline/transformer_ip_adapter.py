"""Flux.1's IP-Adapter (XLabs), as diffusers' `FluxPipeline.load_ip_adapter`: the CLIP image embedding of each
image prompt, projected to a few tokens (`ImageProjection`), is attended to by the image tokens of every
double-stream block (`JointAttention.image_prompt_attention`: their normed queries before the rotary positions,
each block's own biased to_k_ip / to_v_ip), times the adapter's scale for that block, and added after the block's
feed-forward. Under true CFG the negative rows see the negative image's tokens (`negative_ip_adapter_image`; by
default a black image's, as diffusers).

The call's inputs are the UNet piece's (`ip_adapter.IPAdapterInputs`): per adapter (negative, image) pixels or
embeddings, and the scales (adapters, double blocks, 1), traced."""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp

from .clip_image import CLIP_MEAN, CLIP_STD
from .ip_adapter import (Adapter, IPAdapter, IPAdapterInputs, broadcast_rows, checked_embeds, checked_pixels,
                         per_adapter)

PAIRS = (("negative_ip_adapter_image", "negative_ip_adapter_image_embeds"),
         ("ip_adapter_image", "ip_adapter_image_embeds"))
ARGUMENTS = "ip_adapter_image ip_adapter_image_embeds negative_ip_adapter_image negative_ip_adapter_image_embeds " \
            "ip_adapter_scale"


@dataclasses.dataclass(frozen=True)
class FluxIPAdapter(IPAdapter):
    heads: int = 1  # the transformer's attention heads and their width
    head_dim: int = 1

    def call_inputs(self, args: dict, settings, batch, leading_dims) -> IPAdapterInputs:
        lead, count = leading_dims or 1, len(self.adapters)
        for image_name, embeds_name in PAIRS:
            if args.get(image_name) is not None and args.get(embeds_name) is not None:
                raise ValueError(f"give {image_name} or {embeds_name}, not both")
        if all(args.get(name) is None for pair in PAIRS for name in pair):
            raise ValueError("this pipeline has an IP-Adapter: give ip_adapter_image (pipeline.prepare_ip_adapter_"
                             "image(pictures)) or ip_adapter_image_embeds")
        images, embeds = [], []
        for image_name, embeds_name in PAIRS:
            image, given = args.get(image_name), args.get(embeds_name)
            if image is None and given is None:  # diffusers' default for the one left out: a black image
                if self.image_encoder is None:
                    raise ValueError(f"{image_name} defaults to a black image, which needs the IP-Adapter's image "
                                     f"encoder: give {embeds_name}, or load the encoder")
                image = [self.black_pixels()] * count
            if image is not None and self.image_encoder is None:
                raise ValueError(f"{image_name} needs the IP-Adapter's image encoder, which load_ip_adapter left "
                                 f"out: give {embeds_name}")
            images.append(None if image is None else tuple(
                checked_pixels(x, batch, lead, image_name) for x in per_adapter(image, count, image_name)))
            embeds.append(None if given is None else tuple(
                broadcast_rows(checked_embeds(x, lead, a, embeds_name, "one row, or one per prompt"), batch, lead,
                               embeds_name) for x, a in zip(per_adapter(given, count, embeds_name), self.adapters)))
        scale = layer_scales(args.get("ip_adapter_scale", 1.0), count, len(self.layers))
        return IPAdapterInputs(tuple(images), tuple(embeds), scale)

    def black_pixels(self):
        """A black picture as CLIP's image processor leaves it: (1, 3, S, S), each channel -mean / std."""
        side = self.image_encoder.config.image_size
        value = -jnp.asarray(CLIP_MEAN, jnp.float32) / jnp.asarray(CLIP_STD, jnp.float32)
        return jnp.broadcast_to(value[None, :, None, None], (1, 3, side, side))

    def tokens(self, params, given: IPAdapterInputs):
        """Per adapter (negative's, image's) tokens, each (B, n · tokens, joint_attention_dim)."""
        out = []
        for a, adapter in enumerate(self.adapters):
            pair = []
            for images, embeds in zip(given.image, given.image_embeds):
                if embeds is None:
                    pixels = images[a]  # (B, n, 3, h, w)
                    flat = self.image_encoder.apply(params["image_encoder"], pixels.reshape(
                        -1, *pixels.shape[2:]).astype(self.image_encoder.dtype)).image_embeds
                    x = flat.reshape(*pixels.shape[:2], -1)
                else:
                    x = embeds[a]  # (B, n, E)
                tokens = adapter.projection.apply({"params": params["ip_adapter"][a]["projection"]},
                                                  x.reshape(-1, x.shape[-1]))  # (B n, tokens, D)
                pair.append(tokens.reshape(x.shape[0], -1, tokens.shape[-1]))
            out.append(pair)
        return out

    def wrap(self, params, inputs, settings, cond, start):
        given = inputs.condition(self.params_name)
        split = lambda t: t.reshape(*t.shape[:3], self.heads, self.head_dim)  # noqa: E731
        keys_values = []  # per adapter (negative's, image's), each (keys, values) of (blocks, B, T, heads, d)
        for w, pair in zip(params["ip_adapter"], self.tokens(params, given)):
            project = lambda t, name: split(jnp.einsum("btd,ldi->lbti", t, w[name].astype(t.dtype))  # noqa: E731
                                            + w[f"{name}_bias"].astype(t.dtype)[:, None, None])
            keys_values.append([(project(t, "to_k_ip"), project(t, "to_v_ip")) for t in pair])
        rows = keys_values[0][1][0].shape[1]

        def wrapper(unet_fn):
            def adapted(x, t, context, step, **extra):
                chunks = x.shape[0] // rows  # true CFG: [negative; prompt]
                prompts = tuple(tuple(
                    (tuple(kv[0][layer] for kv in by_chunk(pair, chunks)),
                     tuple(kv[1][layer] for kv in by_chunk(pair, chunks)), given.scale[a, layer, 0])
                    for a, pair in enumerate(keys_values)) for layer in range(len(self.layers)))
                return unet_fn(x, t, context, step, image_prompts=prompts, **extra)

            return adapted

        return wrapper


def by_chunk(pair, chunks: int):
    """The negative's entry for the first chunk of a guided batch, the image's for the others."""
    negative, positive = pair
    return [negative] + [positive] * (chunks - 1) if chunks > 1 else [positive]


def layer_scales(scale, adapters: int, layers: int):
    """diffusers' Flux `set_ip_adapter_scale` forms -> (adapters, layers, 1) float32: a number for all; for one
    adapter a list of one per double block; or one entry per adapter, each a number or such a list."""
    def number(x):
        return isinstance(x, numbers.Real) and not isinstance(x, bool) or getattr(x, "ndim", None) == 0

    if number(scale):
        entries = [scale] * adapters
    elif isinstance(scale, (list, tuple)) and adapters == 1 and all(map(number, scale)) and len(scale) == layers:
        entries = [list(scale)]
    elif isinstance(scale, (list, tuple)) and len(scale) == adapters:
        entries = list(scale)
    else:
        raise ValueError(f"ip_adapter_scale={scale!r:.60}: give a number, one per adapter ({adapters}), or a list "
                         f"of one per double-stream block ({layers}) for an adapter")
    out = []
    for entry in entries:
        if number(entry):
            entry = [entry] * layers
        if not (isinstance(entry, (list, tuple)) and len(entry) == layers and all(map(number, entry))):
            raise ValueError(f"ip_adapter_scale: {entry!r:.60} is not a number or a list of {layers} numbers, one per "
                             "double-stream block")
        out.append(jnp.stack([jnp.asarray(x, jnp.float32) for x in entry]))
    return jnp.stack(out)[..., None]


def load_flux_ip_adapter(transformer, dtype, weights, encoder, encoder_params):
    """(FluxIPAdapter piece, {"image_encoder": ..., "ip_adapter": [...]}) from XLabs files read by
    `loading.ip_adapter.read_flux_ip_adapter`, each checked against the transformer's double-stream blocks."""
    cfg = transformer.config
    adapters, params_of = [], []
    for name, w in weights:
        layers, width, inner = w.to_k_ip.shape
        if (layers, width, inner) != (cfg.num_layers, cfg.joint_attention_dim, cfg.inner_dim):
            raise ValueError(f"{name} adapts {layers} double-stream blocks, {width} -> {inner} wide; this "
                             f"transformer has {cfg.num_layers}, {cfg.joint_attention_dim} -> {cfg.inner_dim}: an "
                             "IP-Adapter is made for one Flux.1 transformer")
        if encoder is not None and encoder.config.projection_dim != w.input_width:
            raise ValueError(f"{name} projects image embeddings {w.input_width} wide; the image encoder makes "
                             f"{encoder.config.projection_dim}: use the CLIP encoder it was trained with "
                             "(openai/clip-vit-large-patch14 for XLabs')")
        adapters.append(Adapter(w.projection, False, w.input_width))
        cast = lambda x: jax.tree.map(lambda y: jnp.asarray(y, dtype), x)  # noqa: E731
        params_of.append({"projection": cast(w.projection_params), "to_k_ip": cast(w.to_k_ip),
                          "to_k_ip_bias": cast(w.to_k_ip_bias), "to_v_ip": cast(w.to_v_ip),
                          "to_v_ip_bias": cast(w.to_v_ip_bias)})
    layers = tuple(f"transformer_blocks.{i}.attn" for i in range(cfg.num_layers))
    piece = FluxIPAdapter(encoder, tuple(adapters), layers, 0, cfg.num_attention_heads, cfg.attention_head_dim)
    return piece, {"ip_adapter": params_of, **({} if encoder is None else {"image_encoder": encoder_params})}
