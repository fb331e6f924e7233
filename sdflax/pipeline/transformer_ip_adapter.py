"""The transformers' IP-Adapters: Flux.1's (XLabs) and SD 3.5 Large's (InstantX, `SD3IPAdapter`).

Flux.1's, as diffusers' `FluxPipeline.load_ip_adapter`: the CLIP image embedding of each
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

from ..models.mmdit_blocks import EPS, JointImagePrompt, rms_norm
from .clip_image import CLIP_MEAN, CLIP_STD, siglip_image_inputs
from .ip_adapter import (Adapter, IPAdapter, IPAdapterInputs, broadcast_rows, checked_embeds, checked_pixels,
                         per_adapter)

PAIRS = (("negative_ip_adapter_image", "negative_ip_adapter_image_embeds"),
         ("ip_adapter_image", "ip_adapter_image_embeds"))
ARGUMENTS = "ip_adapter_image ip_adapter_image_embeds negative_ip_adapter_image negative_ip_adapter_image_embeds " \
            "ip_adapter_scale"
SD3_ARGUMENTS = "ip_adapter_image ip_adapter_image_embeds ip_adapter_scale"


@dataclasses.dataclass(frozen=True)
class FluxIPAdapter(IPAdapter):
    """Flux.1's IP-Adapter piece: the module's docstring says what it computes."""

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


# ---- SD 3.5 Large's IP-Adapter (InstantX) -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SD3IPAdapter(IPAdapter):
    """SD 3.5 Large's IP-Adapter, as diffusers' `StableDiffusion3Pipeline.load_ip_adapter`: SigLIP's penultimate
    states of the image prompt (zeros for the unconditional rows) through a resampler modulated by the timestep
    (`models.ip_adapter.Resampler`, at every step); in every block the image tokens attend to their own keys and
    the prompt's (`JointAttention.joint_prompt_attention`), times the scale, before to_out. One adapter, one
    picture per row; `ip_adapter_image_embeds` in diffusers' form, (N, T, E), negatives first with guidance."""

    heads: int = 1
    head_dim: int = 1

    def prepare_image(self, images):
        return siglip_image_inputs(images, size=self.image_encoder.config.image_size)

    def call_inputs(self, args: dict, settings, batch, leading_dims) -> IPAdapterInputs:
        embeds = args.get("ip_adapter_image_embeds")
        if embeds is not None and getattr(embeds, "ndim", 0) == (leading_dims or 1) + 2:  # diffusers': no picture axis
            args = {**args, "ip_adapter_image_embeds": jnp.expand_dims(jnp.asarray(embeds), leading_dims or 1)}
        given = super().call_inputs(args, settings, batch, leading_dims)
        pictures = (given.image or given.image_embeds)[0].shape[(leading_dims or 1) + (given.image is None)]
        if pictures != 1:
            raise ValueError(f"ip_adapter_image holds {pictures} pictures per prompt; SD 3.5's IP-Adapter takes one")
        return given

    def image_embeds(self, params, pixels, adapter):
        """SigLIP's penultimate states (N, T, E), and zeros for the unconditional rows (diffusers' SD 3)."""
        states = self.image_encoder.apply(params["image_encoder"], pixels.astype(self.image_encoder.dtype),
                                          output_hidden_states=True).hidden_states[-2]
        return states, jnp.zeros_like(states)

    def wrap(self, params, inputs, settings, cond, start):
        given = inputs.condition(self.params_name)
        if given.image_embeds is not None:
            negative, positive = given.image_embeds[0][:, 0, 0], given.image_embeds[0][:, 1, 0]  # (B, T, E)
        else:
            positive, negative = self.image_embeds(params, given.image[0][:, 0], self.adapters[0])
        w, projection = params["ip_adapter"][0], self.adapters[0].projection
        split = lambda t: t.reshape(*t.shape[:3], self.heads, self.head_dim)  # noqa: E731

        def wrapper(unet_fn):
            def adapted(x, t, context, step, **extra):
                chunks = x.shape[0] // positive.shape[0]
                rows = jnp.concatenate([negative] + [positive] * (chunks - 1)) if chunks > 1 else positive
                timestep = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (rows.shape[0],))
                tokens, temb = projection.apply({"params": w["projection"]}, rows, timestep)
                # each block's norm_ip: AdaLayerNorm (shift, then scale) of the tokens by the resampler's temb
                emb = jnp.einsum("bd,lde->lbe", jax.nn.silu(temb), w["norm_ip_kernel"].astype(temb.dtype))
                shift, scale = jnp.split(emb + w["norm_ip_bias"].astype(emb.dtype)[:, None], 2, axis=-1)
                normed = plain_layer_norm(tokens)[None] * (1 + scale[:, :, None]) + shift[:, :, None]
                keys = split(jnp.einsum("lbqd,ldi->lbqi", normed, w["to_k_ip"].astype(normed.dtype)))
                values = split(jnp.einsum("lbqd,ldi->lbqi", normed, w["to_v_ip"].astype(normed.dtype)))
                keys = rms_norm(keys, w["norm_ip_k"][:, None, None, None])
                prompts = tuple(JointImagePrompt(w["norm_q"][layer], w["norm_k"][layer], keys[layer], values[layer],
                                                 given.scale[0, layer, 0]) for layer in range(len(self.layers)))
                return unet_fn(x, t, context, step, image_prompts=prompts, **extra)

            return adapted

        return wrapper


def plain_layer_norm(x):
    """LayerNorm without scale or bias, eps 1e-6 (norm_ip's), in float32."""
    y = x.astype(jnp.float32)
    y = (y - y.mean(-1, keepdims=True)) * jax.lax.rsqrt(y.var(-1, keepdims=True) + EPS)
    return y.astype(x.dtype)


def load_sd3_ip_adapter(transformer, dtype, weights, encoder, encoder_params):
    """(SD3IPAdapter piece, {"image_encoder": ..., "ip_adapter": [...]}) from an InstantX file read by
    `loading.ip_adapter.read_sd3_ip_adapter`, checked against the transformer's blocks."""
    cfg = transformer.config
    if len(weights) != 1:
        raise ValueError(f"{len(weights)} IP-Adapters: SD 3.5's pipelines take one, as diffusers'")
    name, w = weights[0]
    if cfg.dual_attention_layers:
        raise ValueError(f"{name} is SD 3.5 Large's IP-Adapter; this transformer has second attentions "
                         f"(dual_attention_layers, SD 3.5 Medium's), which it was not made for")
    layers, width, inner = w.layers["to_k_ip"].shape
    if (layers, width, inner) != (cfg.num_layers, cfg.inner_dim, cfg.inner_dim):
        raise ValueError(f"{name} adapts {layers} blocks {width} -> {inner} wide; this transformer has "
                         f"{cfg.num_layers} of {cfg.inner_dim}: an IP-Adapter is made for one SD 3.5 transformer")
    if encoder is not None and encoder.config.hidden_size != w.input_width:
        raise ValueError(f"{name} takes image encoder states {w.input_width} wide; the image encoder's are "
                         f"{encoder.config.hidden_size}: use the SigLIP encoder it was trained with "
                         "(google/siglip-so400m-patch14-384 for InstantX')")
    cast = lambda x: jax.tree.map(lambda y: jnp.asarray(y, dtype), x)  # noqa: E731
    names = tuple(f"transformer_blocks.{i}.attn" for i in range(cfg.num_layers))
    piece = SD3IPAdapter(encoder, (Adapter(w.projection, True, w.input_width),), names, 0, cfg.num_attention_heads,
                         cfg.attention_head_dim)
    params = {"ip_adapter": [{"projection": cast(w.projection_params), **cast(w.layers)}]}
    return piece, {**params, **({} if encoder is None else {"image_encoder": encoder_params})}
