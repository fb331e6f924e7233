"""IP-Adapter (Ye et al. 2023): image prompts through decoupled cross-attention, as diffusers' `load_ip_adapter`.

A CLIP vision tower encodes the image prompt once per call; each adapter's projection turns that into a few
tokens, and every cross-attention layer of the UNet attends to them beside the text with its own `to_k_ip` /
`to_v_ip`: out = attention(q, text) + scale · attention(q, image tokens). `IPAdapter` is a UNet wrapper (a
`Spec`'s `wrappers`, innermost, so a ControlNet's layers are left alone); its params are `params["image_encoder"]`
and `params["ip_adapter"]`, one entry per adapter.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from ..hooks.core import Hook, intercept
from ..loading.lora import kernel_index
from ..models.layers import dot_product_attention
from .clip_image import clip_image_inputs
from .types import batched


@flax.struct.dataclass
class IPAdapterInputs:
    """A call's IP-Adapter inputs (`Inputs.conditions["ip_adapter"]`), one array per adapter (`call_inputs`)."""

    image: Any = batched()  # CLIP pixels (B, n, 3, h, w); a transformer's: (negative's or None, image's or None)
    image_embeds: Any = batched()  # or the image encoder's output for the negative and positive images (B, 2, n, ...)
    scale: Any = None  # (adapters, cross-attention layers, 1 or one per masked picture)
    masks: Any = None  # per adapter None or (n, H, W): where each of its n pictures acts


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter's static part: its projection module and what it projects (the image encoder's embedding, or
    its penultimate hidden states: Plus and full-face)."""

    projection: Any
    wants_hidden_states: bool
    input_width: int  # what the projection takes: ip_adapter_image_embeds' last axis


@dataclasses.dataclass(frozen=True)
class IPAdapter:
    image_encoder: Any  # CLIPVisionModelWithProjection, or None where only image embeddings are given
    adapters: tuple  # Adapter per loaded adapter, in load order
    layers: tuple  # the UNet's cross-attention layers (checkpoint names) in diffusers' attn_processors order
    layers_per_block: int  # the UNet's, which a per-block ip_adapter_scale counts by

    params_name = "ip_adapter"
    picture = None

    def prepare_image(self, images):
        """Pictures -> the image encoder's pixels (CLIP's)."""
        side = self.image_encoder.config.image_size
        return clip_image_inputs(images, size=side, crop_size=side)

    def call_inputs(self, args: dict, settings, batch, leading_dims) -> IPAdapterInputs:
        given = call_inputs(self, args, batch, leading_dims, settings.classifier_free_guidance,
                            (settings.height, settings.width))
        return IPAdapterInputs(**{name.replace("ip_adapter_", ""): value for name, value in given.items()})

    def image_embeds(self, params, pixels, adapter: Adapter):
        """(N, 3, h, w) CLIP pixels -> (image's, unconditional) encoder output, as diffusers' `encode_image`: the
        embedding (the unconditional one zeros) or the penultimate hidden states (of a black image)."""
        encoder, p = self.image_encoder, params["image_encoder"]
        pixels = pixels.astype(encoder.dtype)
        if not adapter.wants_hidden_states:
            embeds = encoder.apply(p, pixels).image_embeds
            return embeds, jnp.zeros_like(embeds)
        states = lambda x: encoder.apply(p, x, output_hidden_states=True).hidden_states[-2]  # noqa: E731
        black = states(jnp.zeros_like(pixels[:1]))  # the same for every row
        return states(pixels), jnp.broadcast_to(black, (pixels.shape[0], *black.shape[1:]))

    def tokens(self, params, given: IPAdapterInputs):
        """Per adapter (unconditional, conditional) tokens, each (B, n, tokens, D): n images per row."""
        out = []
        for a, adapter in enumerate(self.adapters):
            if given.image_embeds is not None:
                embeds = given.image_embeds[a]  # (B, 2, n, ...): [negative, positive]
                negative, positive = embeds[:, 0], embeds[:, 1]
            else:
                pixels = given.image[a]  # (B, n, 3, h, w)
                flat = pixels.reshape(-1, *pixels.shape[2:])
                positive, negative = self.image_embeds(params, flat, adapter)
                positive, negative = (x.reshape(*pixels.shape[:2], *x.shape[1:]) for x in (positive, negative))

            def project(x, p=params["ip_adapter"][a]["projection"], projection=adapter.projection):
                tokens = projection.apply({"params": p}, x.reshape(-1, *x.shape[2:]))  # (B n, tokens, D)
                return tokens.reshape(*x.shape[:2], *tokens.shape[1:])

            out.append((project(negative), project(positive)))
        return out

    def wrap(self, params, inputs, settings, cond, start):
        given = inputs.condition(self.params_name)
        tokens = self.tokens(params, given)
        scales = tuple(jnp.asarray(s, jnp.float32) for s in given.scale)  # (layers, images) each
        masks = given.masks or (None,) * len(tokens)
        hook = DecoupledAttention(tokens, scales, masks, tuple(params["ip_adapter"]),
                                  {n: i for i, n in enumerate(self.layers)})

        def wrapper(unet_fn):
            def adapted(x, t, context, step, **residuals):
                with intercept((hook,), step, x.shape[0] // tokens[0][1].shape[0]):
                    return unet_fn(x, t, context, step, **residuals)

            return adapted

        return wrapper


class DecoupledAttention(Hook):
    """Each cross-attention layer's attention to the text plus, per adapter, its scale times the attention to the
    adapter's image tokens (the unconditional chunk's tokens for the unconditional rows). An adapter's n pictures
    per row are one attention over all their tokens; with masks, one attention per picture, each times its mask
    (diffusers' IPAdapterMaskProcessor.downsample, at the layer's resolution) and its own scale."""

    def __init__(self, tokens, scales, masks, weights, index):
        self.tokens, self.scales, self.masks, self.weights, self.index = tokens, scales, masks, weights, index

    def attend(self, site, attend, q, k, v):
        out = attend(q, k, v)
        layer = self.index.get(site.name)
        if layer is None:
            return out
        heads, head_dim = q.shape[2], q.shape[3]
        module, dtype = site.module, q.dtype

        def attend_to(image, w):  # image (rows, tokens, D)
            split = lambda x: x.reshape(*x.shape[:2], heads, head_dim)  # noqa: E731
            k_ip = split(image.astype(dtype) @ w["to_k_ip"][layer].astype(dtype))
            v_ip = split(image.astype(dtype) @ w["to_v_ip"][layer].astype(dtype))
            return dot_product_attention(q, k_ip, v_ip, upcast=module.upcast, kernels=module.kernels).astype(out.dtype)

        for (negative, positive), scale, mask, w in zip(self.tokens, self.scales, self.masks, self.weights):
            rows = jnp.concatenate([negative] + [positive] * (site.chunks - 1) if site.chunks > 1 else [positive])
            scale = scale[layer].astype(out.dtype)  # (images,): one, or one per masked picture
            if mask is None:
                out = out + scale[0] * attend_to(rows.reshape(rows.shape[0], -1, rows.shape[-1]), w)
                continue
            for i in range(rows.shape[1]):
                weight = downsampled_mask(mask[i], q.shape[1]).astype(out.dtype)[None, :, None, None]
                out = out + scale[i if scale.shape[0] > 1 else 0] * attend_to(rows[:, i], w) * weight
        return out


def downsampled_mask(mask, num_queries: int):
    """One picture's (H, W) mask at an attention layer of `num_queries` tokens, as diffusers'
    IPAdapterMaskProcessor.downsample: bicubic (PyTorch's) to the layer's grid at the mask's aspect ratio, read
    row by row, zero-padded or cut to the layer's length."""
    h, w = mask.shape
    rows = int(math.sqrt(num_queries / (w / h)))
    rows += int(num_queries % rows != 0)
    cols = num_queries // rows
    small = (bicubic_matrix(h, rows) @ mask.astype(jnp.float32) @ bicubic_matrix(w, cols).T).reshape(-1)
    return jnp.pad(small, (0, max(0, num_queries - small.size)))[:num_queries]


def bicubic_matrix(size: int, out: int) -> np.ndarray:
    """(out, size) weights of PyTorch's bicubic resampling along one axis (align_corners=False, A = -0.75, edge
    samples repeated), as `F.interpolate(mode="bicubic")` computes them."""
    a = -0.75
    near = lambda x: ((a + 2) * x - (a + 3)) * x * x + 1  # noqa: E731  |x| <= 1
    far = lambda x: ((a * x - 5 * a) * x + 8 * a) * x - 4 * a  # noqa: E731  1 < |x| < 2
    m = np.zeros((out, size), np.float64)
    for o in range(out):
        source = (o + 0.5) * size / out - 0.5
        first = math.floor(source)
        t = source - first
        for k, weight in zip(range(-1, 3), (far(t + 1), near(t), near(1 - t), far(2 - t))):
            m[o, min(max(first + k, 0), size - 1)] += weight
    return m.astype(np.float32)


def piece(spec):
    """The spec's IPAdapter wrapper, or None."""
    return next((wrapper for wrapper in spec.wrappers if isinstance(wrapper, IPAdapter)), None)


# ---- the layers, and the scales per layer ----------------------------------------------------------------------

def diffusers_order(name: str) -> tuple:
    """diffusers registers the UNet's down blocks, then the up blocks, then the middle block: the order of its
    attn_processors, which numbers the adapters' `ip_adapter.{1,3,5,...}` weights."""
    section = {"down_blocks": 0, "up_blocks": 1, "mid_block": 2}[name.split(".")[0]]
    return (section, *(int(n) for n in re.findall(r"\.(\d+)(?=\.|$)", name)))


def cross_attention_layers(unet, params_shapes) -> tuple:
    """The checkpoint names of the UNet's cross-attention layers, in diffusers' order (traced once, no compute)."""
    sites = set()

    def run(params):
        with intercept((), 0, 1, sites):
            return unet.apply(params, *unet.dummy_inputs())

    jax.eval_shape(run, params_shapes)
    return tuple(sorted((name for name in sites if name.endswith("attn2")), key=diffusers_order))


def check_layer_shapes(name, weights, layers, unet_shapes, width):
    """Every layer's to_k_ip and to_v_ip (cross_attention_dim, the layer's attention width), as the UNet's own
    to_k of that layer: one of another width failed deep inside a reshape."""
    kernels, flat = kernel_index(unet_shapes)  # by joined name: "down_blocks_0_attentions_0_..._attn2_to_k"
    for i, layer in enumerate(layers):
        inner = flat[kernels[layer.replace(".", "_") + "_to_k"]].shape[1]
        for kind, kernel in (("to_k_ip", weights.to_k_ip[i]), ("to_v_ip", weights.to_v_ip[i])):
            if tuple(kernel.shape) != (width, inner):
                raise ValueError(f"{name}: ip_adapter.{2 * i + 1}.{kind} is ({kernel.shape[1]}, {kernel.shape[0]}) "
                                 f"(out, in); this UNet's {layer} takes ({inner}, {width}): an IP-Adapter is made for "
                                 "one UNet (SD 1.x / SD 2.x / SDXL)")


def layer_scales(scale, layers, layers_per_block):
    """One adapter's scale -> a scale per cross-attention layer: a number for all, or diffusers' per-block dict
    (InstantStyle: {"down": {"block_2": [0.0, 1.0]}, "up": {"block_0": [0.0, 1.0, 0.0]}}; what it leaves out is
    0), as `set_ip_adapter_scale` expands it."""
    if not isinstance(scale, dict):  # traced: a new number never recompiles
        if isinstance(scale, bool) or not (isinstance(scale, (int, float)) or hasattr(scale, "shape")):
            raise TypeError(f"ip_adapter_scale must be a number or a per-block dict (one per adapter as a list), "
                            f"got {scale!r:.60}")
        return jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (len(layers),))
    unknown = set(scale) - {"down", "mid", "up"}
    if unknown:
        raise ValueError(f"ip_adapter_scale: {sorted(unknown)} are not UNet parts; a per-block scale is a dict with "
                         "'down', 'mid' and 'up' keys, e.g. {'up': {'block_0': [0.0, 1.0, 0.0]}}")
    per_block = {"down": layers_per_block, "up": layers_per_block + 1}
    for part, blocks in scale.items():
        present = sorted({f"block_{name.split('.')[1]}" for name in layers if name.startswith(f"{part}_blocks.")})
        if isinstance(blocks, dict) and (absent := sorted(set(blocks) - set(present))):  # they would scale nothing
            raise ValueError(f"ip_adapter_scale: {part} {', '.join(map(str, absent))} is not one of this UNet's "
                             f"{part} blocks with cross-attention ({', '.join(present) or 'none'})")
    out = []
    for name in layers:
        part, *rest = name.split(".")
        part = {"down_blocks": "down", "up_blocks": "up", "mid_block": "mid"}[part]
        value = scale.get(part, 0.0)
        if part == "mid":
            value = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
        elif isinstance(value, dict):
            value = value.get(f"block_{rest[0]}", 0.0)
            if isinstance(value, (list, tuple)):
                if len(value) not in (1, per_block[part]):
                    raise ValueError(f"ip_adapter_scale: {part}.block_{rest[0]} has {len(value)} scales; its blocks "
                                     f"have {per_block[part]} attention layers (give that many, or one)")
                value = value[0] if len(value) == 1 else value[int(rest[2])]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"ip_adapter_scale: {value!r:.40} for {name} is not a number")
        out.append(float(value))
    return jnp.asarray(out, jnp.float32)


# ---- a call's IP-Adapter arguments -> Inputs fields --------------------------------------------------------------

ARGUMENTS = ("ip_adapter_image", "ip_adapter_image_embeds", "ip_adapter_scale", "ip_adapter_masks")


def check_absent(args: dict):
    """Image prompts given to a pipeline without an IP-Adapter."""
    for name in ("ip_adapter_image", "ip_adapter_image_embeds", "negative_ip_adapter_image",
                 "negative_ip_adapter_image_embeds"):
        if args.get(name) is not None:
            raise ValueError(f"{name} needs an IP-Adapter: pipeline, params = pipeline.load_ip_adapter(params, "
                             "'h94/IP-Adapter', subfolder='models', weight_name='ip-adapter_sd15.safetensors')")


def per_adapter(value, count: int, name: str) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * (1 if hasattr(value, "shape") else count)
    if len(values) != count:
        raise ValueError(f"{name} holds {len(values)} entries for {count} IP-Adapters: give one per adapter (a list)")
    return values


def call_inputs(piece, args: dict, batch: tuple, leading_dims, classifier_free_guidance: bool, size: tuple
                ) -> dict:
    """The Inputs fields of a call's `ip_adapter_image` (CLIP pixels from `prepare_ip_adapter_image`, one array
    per adapter: (N, 3, h, w), or (N, n, 3, h, w) for n images each; N = 1 is every prompt's),
    `ip_adapter_image_embeds` (diffusers' form: per adapter the encoder's output, [negative; positive] along the
    batch with classifier-free guidance) and `ip_adapter_scale` (a number or a per-block dict, or one per
    adapter)."""
    image, embeds = args.get("ip_adapter_image"), args.get("ip_adapter_image_embeds")
    if (image is None) == (embeds is None):
        raise ValueError("this pipeline has an IP-Adapter: give ip_adapter_image (pipeline.prepare_ip_adapter_image("
                         "pictures)) or ip_adapter_image_embeds, one of them")
    if image is not None and piece.image_encoder is None:
        raise ValueError("ip_adapter_image needs the IP-Adapter's image encoder, which load_ip_adapter(..., "
                         "image_encoder_folder=None) left out: give ip_adapter_image_embeds, or load it with "
                         "image_encoder_folder='image_encoder'")
    count = len(piece.adapters)
    lead = leading_dims or 1
    out = {}
    if image is not None:
        out["ip_adapter_image"] = tuple(checked_pixels(x, batch, lead, "ip_adapter_image")
                                        for x in per_adapter(image, count, "ip_adapter_image"))
    else:
        arrays = []
        for x, adapter in zip(per_adapter(embeds, count, "ip_adapter_image_embeds"), piece.adapters):
            x = checked_embeds(x, lead, adapter, "ip_adapter_image_embeds", "negatives first with guidance")
            if classifier_free_guidance:
                if x.shape[lead - 1] % 2:
                    raise ValueError(f"ip_adapter_image_embeds of shape {x.shape} with classifier-free guidance: "
                                     "the negative embeddings, then the positive ones (an even count)")
                negative, positive = jnp.split(x, 2, axis=lead - 1)
            else:
                negative, positive = jnp.zeros_like(x), x
            pair = jnp.stack([negative, positive], axis=lead)  # (N, 2, n, ...)
            arrays.append(broadcast_rows(pair, batch, lead, "ip_adapter_image_embeds"))
        out["ip_adapter_image_embeds"] = tuple(arrays)
    scale = args.get("ip_adapter_scale", 1.0)
    scales = per_adapter(scale, count, "ip_adapter_scale") if isinstance(scale, (list, tuple)) else [scale] * count
    # (adapters, layers, images): a list for one adapter is a scale per masked picture, as diffusers takes it
    per = [jnp.stack([layer_scales(x, piece.layers, piece.layers_per_block) for x in s], -1)
           if isinstance(s, (list, tuple)) else layer_scales(s, piece.layers, piece.layers_per_block)[:, None]
           for s in scales]
    images = max(p.shape[1] for p in per)
    out["ip_adapter_scale"] = jnp.stack([jnp.broadcast_to(p, (p.shape[0], images)) for p in per])
    masks = args.get("ip_adapter_masks")
    if masks is not None:
        # each adapter's pictures per row: (N, n, 3, h, w) pixels, or (N, 2, n, ...) embeddings
        pictures = ([x.shape[lead] for x in out["ip_adapter_image"]] if "ip_adapter_image" in out
                    else [x.shape[lead + 1] for x in out["ip_adapter_image_embeds"]])
        checked = []
        for a, (mask, n, p) in enumerate(zip(per_adapter(masks, count, "ip_adapter_masks"), pictures, per)):
            if mask is None:
                checked.append(None)
                continue
            mask = jnp.asarray(mask, jnp.float32)
            if mask.ndim != 4 or mask.shape[:2] != (1, n):
                raise ValueError(f"ip_adapter_masks[{a}] has shape {mask.shape}; expected (1, {n}, H, W), one mask per "
                                 "picture of its adapter: pipeline.prepare_ip_adapter_masks(masks)")
            if mask.shape[-1] * size[0] != mask.shape[-2] * size[1]:  # the layers' grids would not fit it
                raise ValueError(f"ip_adapter_masks[{a}] is {mask.shape[-1]}x{mask.shape[-2]}, not of the image's "
                                 f"aspect ({size[1]}x{size[0]}): make the masks with pipeline.prepare_ip_adapter_masks"
                                 "(masks, height, width)")
            if p.shape[1] not in (1, n):
                raise ValueError(f"ip_adapter_scale gives {p.shape[1]} scales to adapter {a}'s {n} masked pictures: "
                                 "one, or one per picture")
            checked.append(mask[0])
        out["ip_adapter_masks"] = tuple(checked)
    return out


def checked_pixels(x, batch: tuple, lead: int, name: str):
    """One adapter's CLIP pixels (N, 3, h, w) or (N, n, 3, h, w) -> (*batch, n, 3, h, w) float32."""
    if not jnp.issubdtype(getattr(x, "dtype", np.dtype(object)), jnp.floating):  # uint8 pixels, a path, ...
        raise TypeError(f"{name} holds {type(x).__name__} of {getattr(x, 'dtype', 'no dtype')}; expected CLIP "
                        "pixels, floats normalised by CLIP's mean and std: make them with "
                        "pipeline.prepare_ip_adapter_image(pictures)")
    x = jnp.asarray(x, jnp.float32)
    if x.ndim == lead + 3:
        x = jnp.expand_dims(x, lead)
    if x.ndim != lead + 4 or x.shape[-3] != 3:
        raise ValueError(f"{name} has shape {x.shape}; expected (N, 3, h, w) or (N, n, 3, h, w) CLIP pixels: make "
                         "them with pipeline.prepare_ip_adapter_image(pictures)")
    return broadcast_rows(x, batch, lead, name)


def checked_embeds(x, lead: int, adapter: Adapter, name: str, form: str):
    """One adapter's image encoder output (N, n, E) or (N, n, tokens, E), float32, of the width it takes."""
    x = jnp.asarray(x, jnp.float32)
    if x.ndim not in (lead + 2, lead + 3):
        raise ValueError(f"{name} has an array of shape {x.shape}; diffusers' form is (N, n, E) or (N, n, tokens, "
                         f"E) per adapter, {form}")
    if x.shape[-1] != adapter.input_width:
        raise ValueError(f"{name} has an array of shape {x.shape}; its adapter takes {adapter.input_width} wide "
                         "ones (E), its image encoder's output")
    return x


def broadcast_rows(x, batch: tuple, lead: int, name: str):
    """One row for every prompt, or one per prompt."""
    rows = x.shape[:lead]
    if rows == tuple(batch):
        return x
    if lead == 1 and rows == (1,):
        return jnp.broadcast_to(x, (*batch, *x.shape[1:]))
    raise ValueError(f"{name} holds {rows} rows for prompts of {tuple(batch)}: give one for all, or one per prompt")


# ---- loading -----------------------------------------------------------------------------------------------------

def load_ip_adapter(unet, dtype, weights, encoder, encoder_params):
    """(IPAdapter piece, {"image_encoder": ..., "ip_adapter": [...]}) from h94-layout files read by
    `loading.ip_adapter.read_ip_adapters`, each checked against the UNet's cross-attention layers."""
    layers = cross_attention_layers(unet, unet.param_shapes())
    adapters, params_of = [], []
    for name, w in weights:
        if len(w.to_k_ip) != len(layers):
            raise ValueError(f"{name} adapts {len(w.to_k_ip)} cross-attention layers; this UNet has {len(layers)}: "
                             "an IP-Adapter is made for one UNet family (SD 1.x / SD 2.x / SDXL)")
        width = unet.config.cross_attention_dim
        if w.to_k_ip[0].shape[0] != width:
            raise ValueError(f"{name} projects image tokens {w.to_k_ip[0].shape[0]} wide; this UNet's cross-attention "
                             f"takes {width}: an IP-Adapter is made for one UNet family (SD 1.x / SD 2.x / SDXL)")
        check_layer_shapes(name, w, layers, unet.param_shapes(), width)
        adapters.append(Adapter(w.projection, w.wants_hidden_states, w.input_width))
        cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
        params_of.append({"projection": jax.tree.map(cast, w.projection_params),
                          "to_k_ip": [cast(k) for k in w.to_k_ip], "to_v_ip": [cast(v) for v in w.to_v_ip]})
    added = {"ip_adapter": params_of, **({} if encoder is None else {"image_encoder": encoder_params})}
    return IPAdapter(encoder, tuple(adapters), layers, unet.config.layers_per_block), added
