"""h94's IP-Adapter files -> the image projection (`sdflax.models.ip_adapter`) with its params, and the kernels of
the decoupled cross-attention (to_k_ip, to_v_ip) for each of the UNet's cross-attention layers.

    .safetensors   flat: image_proj.<name>, ip_adapter.<1, 3, 5, ...>.to_k_ip.weight / .to_v_ip.weight
    .bin           torch.save({"image_proj": {<name>: tensor}, "ip_adapter": {"1.to_k_ip.weight": tensor, ...}})

The projection is told from its tensor names as diffusers' `_convert_ip_adapter_image_proj_to_diffusers` tells it,
and its sizes are read from their shapes:

    proj.weight                    IP-Adapter: ImageProjection of the image embedding, 4 tokens
    proj.3.weight                  IP-Adapter Full Face: IPAdapterFullImageProjection of the penultimate hidden states
    latents, proj_in, layers.N.*   IP-Adapter Plus: Resampler (the perceiver resampler) of them
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .files import read_safetensors, read_torch_object
from ..models.ip_adapter import ImageProjection, IPAdapterFullImageProjection, Resampler
from ..models.layers import Kernels, resolve_kernels, shapes_only
from .weights import convert_state_dict, non_finite, short_list

__all__ = ["IPAdapterFileError", "IPAdapterWeights", "read_ip_adapter"]

SECTIONS = ("image_proj", "ip_adapter")
BASE_TOKENS = 4  # diffusers' num_image_text_embeds for ImageProjection
FULL_FACE_TOKENS = 257  # diffusers' count for Full Face: ViT-H/14's 256 patch tokens and its class token
RESAMPLER_DIM_HEAD = 64  # fixed by the original Resampler; diffusers reads heads as to_q's width // 64
# The original resampler's names inside `layers.N.` -> diffusers' (to_kv is split in two halves: to_k, to_v).
RESAMPLER_RENAMES = {"0.norm1": "ln0", "0.norm2": "ln1", "0.to_q": "attn.to_q", "0.to_out": "attn.to_out.0",
                     "1.0": "ff.0", "1.1": "ff.1.net.0.proj", "1.3": "ff.1.net.2"}
RESAMPLER_NAME = re.compile(r"layers\.(\d+)\.(0\.norm1|0\.norm2|0\.to_q|0\.to_kv|0\.to_out|1\.0|1\.1|1\.3)\.(.+)")
IP_KERNEL_NAME = re.compile(r"(\d+)\.to_([kv])_ip\.weight")


class IPAdapterFileError(ValueError):
    """A file is not an IP-Adapter sdflax can read; the message names it and what was expected, in one line."""


class IPAdapterWeights(NamedTuple):
    projection: nn.Module  # ImageProjection, IPAdapterFullImageProjection or Resampler
    projection_params: dict  # its params tree
    to_k_ip: list  # (cross_attention_dim, hidden) kernels: the UNet's cross-attention layers in diffusers' order
    to_v_ip: list
    num_tokens: int  # image tokens the projection makes (diffusers' num_tokens)
    wants_hidden_states: bool  # the image encoder's penultimate hidden states, not its image embedding
    input_width: int  # the width of what the projection takes (the image embedding's, or the hidden states')


def read_ip_adapters(source, subfolder, weight_name, image_encoder_folder, revision, dtype, reader=None,
                     encoder_source=None, encoder_class=None):
    """The adapters of diffusers' `load_ip_adapter` arguments, found as it finds them: ([(file name,
    IPAdapterWeights)], the CLIP image encoder, its params), the encoder (None, None) without `image_encoder_folder`.
    `reader`: what reads each file (h94's `read_ip_adapter`, XLabs' `read_flux_ip_adapter`); `encoder_source`: the
    encoder's own folder or hub id, in place of `image_encoder_folder` (Flux's
    `image_encoder_pretrained_model_name_or_path`); `encoder_class`: its model (CLIP's vision tower, or SD 3.5's
    SigLIP)."""
    from ..models import CLIPVisionModelWithProjection

    encoder_class = encoder_class or CLIPVisionModelWithProjection
    from .hub import resolve_folder

    names = list(weight_name) if isinstance(weight_name, (list, tuple)) else [weight_name]
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError("load_ip_adapter needs weight_name=, the adapter's file (e.g. 'ip-adapter_sd15.safetensors'), "
                         "or a list of them")
    subfolder = subfolder or ""
    # diffusers' rule: a bare name is a folder under `subfolder`, a path (with "/") one of the repository's own
    encoder = None if image_encoder_folder is None or encoder_source is not None else str(
        image_encoder_folder) if "/" in str(
        image_encoder_folder) else f"{subfolder}/{image_encoder_folder}".strip("/")
    patterns = [f"{subfolder}/{n}".lstrip("/") for n in names]
    weights = [f"{encoder}/config.json", f"{encoder}/*.safetensors"] if encoder else []
    folder = resolve_folder(source, revision, allow_patterns=patterns + weights)  # h94 has .bin twins: not those
    encoder_folder = os.path.join(folder, encoder) if encoder else None
    if encoder and not any(n.endswith(".safetensors") for n in
                           (os.listdir(encoder_folder) if os.path.isdir(encoder_folder) else ())):
        folder = resolve_folder(source, revision, allow_patterns=patterns + weights + [f"{encoder}/*.bin"])
    adapters = [(name, (reader or read_ip_adapter)(os.path.join(folder, subfolder, name))) for name in names]
    if encoder_source is not None:
        return (adapters, *encoder_class.from_pretrained(encoder_source, dtype=dtype))
    if encoder is None:
        return adapters, None, None
    return (adapters, *encoder_class.from_pretrained(folder, subfolder=encoder, dtype=dtype))


def read_ip_adapter(path, dtype=jnp.float32, kernels: Kernels | None = None) -> IPAdapterWeights:
    """The IP-Adapter in an h94 file (.safetensors or .bin), its params and kernels in `dtype`."""
    name = os.fspath(path)
    image_proj, ip_adapter = _read_sections(name)
    projection, state_dict, num_tokens, input_shape = _projection(name, image_proj, dtype,
                                                                  kernels or resolve_kernels())
    with shapes_only():  # shapes only: what the file makes the reader allocate is its own tensors
        out, variables = jax.eval_shape(lambda: projection.init_with_output(jax.random.key(0), jnp.zeros(input_shape)))
    to_k_ip, to_v_ip = _ip_kernels(name, ip_adapter, out.shape[-1])
    params = convert_state_dict(state_dict, variables["params"], dtype, where=f"IP-Adapter file {name!r}")
    return IPAdapterWeights(projection, params, [jnp.asarray(w.T, dtype) for w in to_k_ip],
                            [jnp.asarray(w.T, dtype) for w in to_v_ip], num_tokens,
                            not isinstance(projection, ImageProjection), input_shape[-1])


def _read_sections(name):
    suffix = Path(name).suffix.lower()
    if suffix == ".safetensors":
        content = read_safetensors(name)
        sections = {section: {} for section in SECTIONS}
        for key, value in content.items():
            section, _, rest = key.partition(".")
            if section in sections:
                sections[section][rest] = value
    elif suffix == ".bin":
        content = sections = read_torch_object(name)
    else:
        raise IPAdapterFileError(f"{name!r}: unknown suffix {suffix!r}; an IP-Adapter is a .safetensors or .bin file")
    if not (isinstance(sections, dict) and all(isinstance(sections.get(s), dict) and sections[s] for s in SECTIONS)
            and all(isinstance(v, np.ndarray) for s in SECTIONS for v in sections[s].values())):
        found = sorted(map(str, content))[:6] if isinstance(content, dict) else type(content).__name__
        raise IPAdapterFileError(f"{name!r} is not an IP-Adapter: expected tensors under image_proj and ip_adapter "
                                 f"(h94's layout), found {found}")
    return ({str(k): v for k, v in sections[s].items()} for s in SECTIONS)


def _shape(name, state_dict, key, ndim):
    value = state_dict.get(key)
    if value is None or value.ndim != ndim or 0 in value.shape:
        raise IPAdapterFileError(f"{name!r}: image_proj.{key} should be a non-empty {ndim}-d tensor, "
                                 f"found {'none' if value is None else value.shape}")
    return value.shape


def _projection(name, sd, dtype, kernels):
    """(module, state dict in diffusers' names, tokens, the shape of one input) for the image_proj section `sd`."""
    if "proj.weight" in sd:
        out, embed = _shape(name, sd, "proj.weight", 2)
        module = ImageProjection(embed, out // BASE_TOKENS, BASE_TOKENS, dtype)
        return module, {k.replace("proj", "image_embeds"): v for k, v in sd.items()}, BASE_TOKENS, (1, embed)
    if "proj.3.weight" in sd:
        module = IPAdapterFullImageProjection(_shape(name, sd, "proj.0.weight", 2)[0],
                                              _shape(name, sd, "proj.3.weight", 1)[0], dtype)
        renames = (("proj.0", "ff.net.0.proj"), ("proj.2", "ff.net.2"), ("proj.3", "norm"))
        state_dict = {_replace_all(k, renames): v for k, v in sd.items()}
        return module, state_dict, FULL_FACE_TOKENS, (1, 1, module.image_embed_dim)
    if "perceiver_resampler.proj_in.weight" in sd or "norm.weight" in sd:
        raise IPAdapterFileError(f"{name!r} is an IP-Adapter FaceID, which sdflax does not read; expected IP-Adapter "
                                 "(image_proj.proj.weight), Full Face (proj.3.weight) or Plus (latents)")
    if "latents" not in sd:
        raise IPAdapterFileError(f"{name!r}: image_proj holds {sorted(sd)[:6]}; expected proj.weight (IP-Adapter), "
                                 "proj.3.weight (Full Face) or latents, proj_in, layers.N.* (Plus)")
    return _resampler(name, sd, dtype, kernels)


def _replace_all(key, renames):
    for old, new in renames:
        key = key.replace(old, new)
    return key


def _resampler(name, sd, dtype, kernels):
    state_dict = {}
    for key, value in sd.items():
        match = RESAMPLER_NAME.fullmatch(key)
        if match and match[2] == "0.to_kv":
            if value.ndim != 2:
                raise IPAdapterFileError(f"{name!r}: image_proj.{key} should be a 2-d tensor, found {value.shape}")
            half = value.shape[0] // 2  # to_k's rows, then to_v's (torch's chunk(2))
            state_dict[f"layers.{match[1]}.attn.to_k.{match[3]}"] = value[:half]
            state_dict[f"layers.{match[1]}.attn.to_v.{match[3]}"] = value[half:]
        elif match:
            state_dict[f"layers.{match[1]}.{RESAMPLER_RENAMES[match[2]]}.{match[3]}"] = value
        else:  # latents, proj_in, proj_out, norm_out; and names already diffusers'
            state_dict[key] = value
    layers = {int(key.split(".")[1]) for key in state_dict if re.match(r"layers\.\d+\.", key)}
    if not layers or layers != set(range(len(layers))):
        raise IPAdapterFileError(f"{name!r}: the resampler's layers are numbered {sorted(layers)[:8]}; "
                                 "expected layers.0, layers.1, ...")
    _, queries, hidden = _shape(name, sd, "latents", 3)
    inner = _shape(name, state_dict, "layers.0.attn.to_q.weight", 2)[0]
    module = Resampler(
        embed_dim=_shape(name, sd, "proj_in.weight", 2)[1], output_dim=_shape(name, sd, "proj_out.weight", 2)[0],
        hidden_dim=hidden, depth=len(layers), dim_head=RESAMPLER_DIM_HEAD, heads=max(1, inner // RESAMPLER_DIM_HEAD),
        num_queries=queries, ffn_ratio=_shape(name, state_dict, "layers.0.ff.1.net.0.proj.weight", 2)[0] / hidden,
        dtype=dtype, kernels=kernels)
    return module, state_dict, queries, (1, 1, module.embed_dim)


def _ip_kernels(name, ip_adapter, width):
    """The to_k_ip and to_v_ip weights (hidden, cross_attention_dim), in the order of their keys 1, 3, 5, ..."""
    found = {}
    for key, value in ip_adapter.items():
        match = IP_KERNEL_NAME.fullmatch(key)
        if not match:
            raise IPAdapterFileError(f"{name!r}: ip_adapter.{key:.100} is not a to_k_ip / to_v_ip weight; expected "
                                     "only ip_adapter.<1, 3, 5, ...>.to_k_ip.weight and .to_v_ip.weight")
        if value.ndim != 2 or value.shape[1] != width:
            raise IPAdapterFileError(f"{name!r}: ip_adapter.{key} is {value.shape}; expected (hidden, {width}), "
                                     "the image projection's width")
        found[int(match[1]), match[2]] = value
    if bad := [f"ip_adapter.{key}" for key, value in ip_adapter.items() if non_finite(np.asarray(value))]:
        raise IPAdapterFileError(f"{name!r} holds NaN or inf in {short_list(bad, 6)}: a damaged or diverged file, "
                                 "which would draw black images; use another copy")
    count = len(found) // 2
    if set(found) != {(2 * i + 1, kv) for i in range(count) for kv in "kv"}:
        keys = ", ".join(f"{i}.to_{kv}_ip" for i, kv in sorted(found)[:6])
        raise IPAdapterFileError(f"{name!r}: ip_adapter holds {keys}; expected the layers 1, 3, 5, ... "
                                 "each with to_k_ip and to_v_ip")
    return [found[2 * i + 1, "k"] for i in range(count)], [found[2 * i + 1, "v"] for i in range(count)]


# ---- XLabs' Flux.1 IP-Adapter ------------------------------------------------------------------------------------

# XLabs' names -> diffusers' sections (`FluxIPAdapterMixin.load_ip_adapter`: either prefix, the first part dropped)
FLUX_SECTIONS = {"image_proj": ("ip_adapter_proj_model.", "image_proj."),
                 "ip_adapter": ("double_blocks.", "ip_adapter.")}
XLABS_RENAMES = (("ip_adapter_double_stream_k_proj", "to_k_ip"), ("ip_adapter_double_stream_v_proj", "to_v_ip"),
                 ("processor.", ""))
FLUX_KERNEL_NAME = re.compile(r"(\d+)\.to_([kv])_ip\.(weight|bias)")
FLUX_WIDE_ROWS = 65536  # an image_proj this many rows wide makes 16 tokens (diffusers' rule), others 4


class FluxIPAdapterWeights(NamedTuple):
    projection: nn.Module  # ImageProjection of the CLIP image embedding
    projection_params: dict
    to_k_ip: np.ndarray  # (double blocks, joint_attention_dim, inner) kernels, with their (blocks, inner) biases
    to_k_ip_bias: np.ndarray
    to_v_ip: np.ndarray
    to_v_ip_bias: np.ndarray
    input_width: int  # the CLIP image embedding's width
    wants_hidden_states: bool = False


def read_flux_ip_adapter(path, dtype=jnp.float32) -> FluxIPAdapterWeights:
    """The Flux.1 IP-Adapter in an XLabs file (ip_adapter_proj_model.*, double_blocks.N.processor.*; or diffusers'
    image_proj.* and ip_adapter.N.*), its params in `dtype`."""
    name = os.fspath(path)
    if Path(name).suffix.lower() != ".safetensors":
        image_proj, ip_adapter = _read_sections(name)
    else:
        image_proj, ip_adapter = {}, {}
        for key, value in read_safetensors(name).items():
            section = next((s for s, prefixes in FLUX_SECTIONS.items() if key.startswith(prefixes)), None)
            rest = key.split(".", 1)[-1]
            if section == "image_proj":
                image_proj[rest] = value
            elif section == "ip_adapter":
                ip_adapter[_replace_all(rest, XLABS_RENAMES)] = value
        if not image_proj or not ip_adapter:
            raise IPAdapterFileError(f"{name!r} is not a Flux IP-Adapter: expected ip_adapter_proj_model.* and "
                                     "double_blocks.N.processor.* tensors (XLabs' layout)")
    rows, embed = _shape(name, image_proj, "proj.weight", 2)
    tokens = 16 if rows == FLUX_WIDE_ROWS else BASE_TOKENS
    projection = ImageProjection(embed, rows // tokens, tokens, dtype)
    with shapes_only():
        variables = jax.eval_shape(lambda: projection.init(jax.random.key(0), jnp.zeros((1, embed))))
    state_dict = {k.replace("proj", "image_embeds"): v for k, v in image_proj.items()}
    params = convert_state_dict(state_dict, variables["params"], dtype, where=f"IP-Adapter file {name!r}")
    found = {}
    for key, value in ip_adapter.items():
        match = FLUX_KERNEL_NAME.fullmatch(key)
        if not match:
            raise IPAdapterFileError(f"{name!r}: {key:.100} is not a to_k_ip / to_v_ip weight or bias; expected "
                                     "double_blocks.<N>.processor.ip_adapter_double_stream_{k,v}_proj.{weight,bias}")
        found[int(match[1]), match[2], match[3]] = np.asarray(value)
    layers = len({i for i, _, _ in found})
    if set(found) != {(i, kv, leaf) for i in range(layers) for kv in "kv" for leaf in ("weight", "bias")}:
        raise IPAdapterFileError(f"{name!r}: its double blocks' to_k_ip / to_v_ip weights and biases are not "
                                 f"numbered 0 .. {layers - 1}, each with all four")
    if bad := [f"{i}.to_{kv}_ip.{leaf}" for (i, kv, leaf), v in found.items() if non_finite(v)]:
        raise IPAdapterFileError(f"{name!r} holds NaN or inf in {short_list(bad, 6)}: a damaged or diverged file, "
                                 "which would draw black images; use another copy")
    stacked = {f"{kv}{leaf}": np.stack([found[i, kv, leaf] for i in range(layers)]) for kv in "kv"
               for leaf in ("weight", "bias")}
    width = rows // tokens
    for kv in "kv":
        weight, bias = stacked[f"{kv}weight"], stacked[f"{kv}bias"]
        if weight.shape[2] != width or bias.shape[1] != weight.shape[1]:
            raise IPAdapterFileError(f"{name!r}: to_{kv}_ip is {stacked[f'{kv}weight'].shape[1:]} (out, in); its "
                                     f"image tokens are {width} wide")
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return FluxIPAdapterWeights(projection, params, cast(stacked["kweight"].transpose(0, 2, 1)),
                                cast(stacked["kbias"]), cast(stacked["vweight"].transpose(0, 2, 1)),
                                cast(stacked["vbias"]), embed)


# ---- InstantX's SD 3.5 Large IP-Adapter --------------------------------------------------------------------------

# InstantX's resampler names inside `layers.N.` -> diffusers' (to_kv, theirs or diffusers', split in two halves)
TIME_RESAMPLER_RENAMES = {**RESAMPLER_RENAMES, "1.0": "adaln_norm", "1.1": "ff.net.0.proj", "1.3": "ff.net.2",
                          "2.1": "adaln_proj"}
TIME_RESAMPLER_NAME = re.compile(r"layers\.(\d+)\.(0\.norm1|0\.norm2|0\.to_q|0\.to_kv|attn\.to_kv|0\.to_out|1\.0|"
                                 r"1\.1|1\.3|2\.1)\.(.+)")
SD3_IP_NAME = re.compile(r"(\d+)\.(norm_ip\.linear\.weight|norm_ip\.linear\.bias|to_k_ip\.weight|to_v_ip\.weight|"
                         r"norm_q\.weight|norm_k\.weight|norm_ip_k\.weight)")


class SD3IPAdapterWeights(NamedTuple):
    projection: nn.Module  # Resampler with timestep_in_dim
    projection_params: dict
    layers: dict  # per block, stacked: norm_ip_kernel (L, temb, 2D), norm_ip_bias, to_k_ip / to_v_ip (L, D, inner),
    # norm_q / norm_k / norm_ip_k (L, head_dim)
    input_width: int  # SigLIP's width
    wants_hidden_states: bool = True


def read_sd3_ip_adapter(path, dtype=jnp.float32, kernels: Kernels | None = None) -> SD3IPAdapterWeights:
    """SD 3.5 Large's IP-Adapter in an InstantX file (image_proj.*: the time-modulated resampler; ip_adapter.N.*:
    each block's norm_ip, to_k_ip, to_v_ip, norm_q, norm_k, norm_ip_k), its params in `dtype`."""
    name = os.fspath(path)
    image_proj, ip_adapter = _read_sections(name)
    state_dict = {}
    for key, value in image_proj.items():
        match = TIME_RESAMPLER_NAME.fullmatch(key)
        if match and match[2].endswith("to_kv"):
            half = value.shape[0] // 2
            state_dict[f"layers.{match[1]}.attn.to_k.{match[3]}"] = value[:half]
            state_dict[f"layers.{match[1]}.attn.to_v.{match[3]}"] = value[half:]
        elif match:
            state_dict[f"layers.{match[1]}.{TIME_RESAMPLER_RENAMES[match[2]]}.{match[3]}"] = value
        else:
            state_dict[key] = value
    if "latents" not in state_dict or "time_embedding.linear_1.weight" not in state_dict:
        raise IPAdapterFileError(f"{name!r} is not an SD 3.5 IP-Adapter: expected image_proj.latents and "
                                 "image_proj.time_embedding.* (InstantX's time-modulated resampler)")
    depth = len({key.split(".")[1] for key in state_dict if key.startswith("layers.")})
    hidden, embed = _shape(name, state_dict, "proj_in.weight", 2)
    inner = _shape(name, state_dict, "layers.0.attn.to_q.weight", 2)[0]
    projection = Resampler(
        embed_dim=embed, output_dim=_shape(name, state_dict, "proj_out.weight", 2)[0], hidden_dim=hidden,
        depth=depth, dim_head=RESAMPLER_DIM_HEAD, heads=max(1, inner // RESAMPLER_DIM_HEAD),
        num_queries=_shape(name, state_dict, "latents", 3)[1],
        ffn_ratio=_shape(name, state_dict, "layers.0.ff.net.0.proj.weight", 2)[0] / hidden,
        timestep_in_dim=_shape(name, state_dict, "time_embedding.linear_1.weight", 2)[1], dtype=dtype,
        kernels=kernels or resolve_kernels())
    with shapes_only():
        variables = jax.eval_shape(lambda: projection.init(jax.random.key(0), jnp.zeros((1, 1, embed)),
                                                           jnp.zeros((1,))))
    params = convert_state_dict(state_dict, variables["params"], dtype, where=f"IP-Adapter file {name!r}")
    found = {}
    for key, value in ip_adapter.items():
        match = SD3_IP_NAME.fullmatch(key)
        if not match:
            raise IPAdapterFileError(f"{name!r}: ip_adapter.{key:.100} is not one of a block's norm_ip.linear, "
                                     "to_k_ip, to_v_ip, norm_q, norm_k, norm_ip_k (InstantX's SD 3.5 layout)")
        found[int(match[1]), match[2]] = np.asarray(value)
    blocks = len({i for i, _ in found})
    leaves = ("norm_ip.linear.weight", "norm_ip.linear.bias", "to_k_ip.weight", "to_v_ip.weight", "norm_q.weight",
              "norm_k.weight", "norm_ip_k.weight")
    if set(found) != {(i, leaf) for i in range(blocks) for leaf in leaves}:
        raise IPAdapterFileError(f"{name!r}: its blocks' ip_adapter tensors are not numbered 0 .. {blocks - 1}, "
                                 f"each with {', '.join(leaves)}")
    if bad := [f"{i}.{leaf}" for (i, leaf), v in found.items() if non_finite(v)]:
        raise IPAdapterFileError(f"{name!r} holds NaN or inf in {short_list(bad, 6)}: a damaged or diverged file, "
                                 "which would draw black images; use another copy")
    stack = lambda leaf, t=False: jnp.asarray(np.stack([found[i, leaf].T if t else found[i, leaf]  # noqa: E731
                                                        for i in range(blocks)]), dtype)
    layers = {"norm_ip_kernel": stack("norm_ip.linear.weight", True), "norm_ip_bias": stack("norm_ip.linear.bias"),
              "to_k_ip": stack("to_k_ip.weight", True), "to_v_ip": stack("to_v_ip.weight", True),
              "norm_q": stack("norm_q.weight"), "norm_k": stack("norm_k.weight"),
              "norm_ip_k": stack("norm_ip_k.weight")}
    return SD3IPAdapterWeights(projection, params, layers, embed)
