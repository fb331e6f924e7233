"""Black Forest Labs' names of a FLUX.1 transformer (flux1-dev.safetensors, flux1-schnell.safetensors, the Fill and
Depth / Canny models) -> diffusers' FluxTransformer2DModel names, following diffusers'
`convert_flux_transformer_checkpoint_to_diffusers`. The file holds the transformer alone (ComfyUI's copies under
`model.diffusion_model.`):

    img_in, txt_in                           x_embedder, context_embedder
    time_in, vector_in, guidance_in          time_text_embed's timestep, text and guidance (FLUX.1-dev) embedders
    double_blocks.N                          transformer_blocks.N: img_* the image stream, txt_* the text's
    single_blocks.N                          single_transformer_blocks.N
    final_layer                              proj_out and norm_out

Fused tensors split along their rows: an attention's qkv in thirds, a single block's linear1 into q, k, v and the
MLP's input (3 + 4 model widths). BFL stores the final modulation (shift, scale), diffusers (scale, shift). The
file carries no config: `flux_config` reads it off the tensors' shapes.
"""

from __future__ import annotations

import re

import numpy as np

from .ldm_names import fused_parts
from .weights import CheckpointMismatchError

PREFIX = "model.diffusion_model."  # ComfyUI's
MARKER = "double_blocks.0.img_attn.norm.key_norm.scale"  # what diffusers' `infer_diffusers_model_type` looks for
FLUX2_MARKER = "single_stream_modulation.lin.weight"  # FLUX.2, another architecture
MLP_RATIO = 4
# diffusers' pipeline per the image embedder's input channels: Fill's latents + masked image + mask, the control
# models' latents + control latents, the others' latents alone (2x2 patches of 16 channels)
PIPELINES = {384: "FluxFillPipeline", 128: "FluxControlPipeline"}

EMBEDDERS = {"time_in": "timestep_embedder", "vector_in": "text_embedder", "guidance_in": "guidance_embedder"}
OUTSIDE_BLOCKS = {
    "img_in": "x_embedder", "txt_in": "context_embedder", "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
    **{f"{bfl}.{layer}": f"time_text_embed.{ours}.linear_{i}" for bfl, ours in EMBEDDERS.items()
       for i, layer in ((1, "in_layer"), (2, "out_layer"))},
}
DOUBLE_BLOCK = {
    "img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2", "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
}
SINGLE_BLOCK = {
    "modulation.lin": "norm.linear", "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k", "linear2": "proj_out",
}
LEAVES = {"weight": "weight", "bias": "bias", "scale": "weight"}  # BFL's RMSNorm scale is torch's weight
SWAPPED = "final_layer.adaLN_modulation.1"


def without_prefix(state_dict: dict) -> dict:
    """The tensors under BFL's own names: ComfyUI's `model.diffusion_model.` taken off."""
    if any(k.startswith(PREFIX) for k in state_dict):
        return {k.removeprefix(PREFIX): v for k, v in state_dict.items()}
    return state_dict


def is_flux_file(keys) -> bool:
    """Whether the tensor names (with or without ComfyUI's prefix) are a FLUX.1 transformer's."""
    keys = {k.removeprefix(PREFIX) for k in keys}
    return MARKER in keys and FLUX2_MARKER not in keys


def pipeline_name(state_dict) -> str | None:
    """diffusers' pipeline class of a FLUX.1 transformer file, by its image embedder's input channels; None for a
    file of another architecture."""
    state_dict = without_prefix(state_dict)
    if not is_flux_file(state_dict):
        return None
    image_in = state_dict.get("img_in.weight")
    channels = image_in.shape[-1] if image_in is not None and len(image_in.shape) == 2 else None
    return PIPELINES.get(channels, "FluxPipeline")


def flux_config(state_dict: dict, where: str) -> dict:
    """The config.json fields of FluxTransformer2DModel that a FLUX.1 file's shapes tell (all but axes_dims_rope)."""

    def shape(name, ndim):
        value = state_dict.get(name)
        if value is None or len(value.shape) != ndim:
            found = "no such tensor" if value is None else f"shape {tuple(value.shape)}"
            raise CheckpointMismatchError(f"{where}: {name} has {found}; a FLUX.1 transformer has a {ndim}-d one")
        return tuple(int(n) for n in value.shape)

    def blocks(kind):
        return 1 + max((int(m[1]) for k in state_dict if (m := re.match(rf"{kind}\.(\d+)\.", k))), default=-1)

    inner, in_channels = shape("img_in.weight", 2)
    head_dim, = shape(MARKER, 1)
    return {"in_channels": in_channels, "out_channels": shape("final_layer.linear.weight", 2)[0],
            "num_layers": blocks("double_blocks"), "num_single_layers": blocks("single_blocks"),
            "attention_head_dim": head_dim, "num_attention_heads": inner // head_dim,
            "joint_attention_dim": shape("txt_in.weight", 2)[1],
            "pooled_projection_dim": shape("vector_in.in_layer.weight", 2)[1],
            "guidance_embeds": "guidance_in.in_layer.weight" in state_dict}


def flux_table(cfg) -> dict:
    """BFL module name -> diffusers' (or a tuple of them, for a fused tensor), for the config's blocks."""
    table = dict(OUTSIDE_BLOCKS)
    for blocks, ours, names in (("double_blocks", "transformer_blocks", DOUBLE_BLOCK),
                                ("single_blocks", "single_transformer_blocks", SINGLE_BLOCK)):
        count = cfg.num_layers if blocks == "double_blocks" else cfg.num_single_layers
        for i in range(count):
            table.update({f"{blocks}.{i}.{bfl}": tuple(f"{ours}.{i}.{n}" for n in name) if isinstance(name, tuple)
                          else f"{ours}.{i}.{name}" for bfl, name in names.items()})
    return table


def split_flux(state_dict: dict, cfg) -> tuple[dict, list[str]]:
    """({diffusers name: array}, the names no table maps) of a FLUX.1 file's tensors (without ComfyUI's prefix)."""
    table, out, unknown = flux_table(cfg), {}, []
    for key, array in state_dict.items():
        module, _, leaf = key.rpartition(".")
        names = table.get(module)
        if names is None or leaf not in LEAVES:
            unknown.append(key)
            continue
        names = names if isinstance(names, tuple) else (names,)
        names = tuple(f"{name}.{LEAVES[leaf]}" for name in names)
        if len(names) == 4:  # linear1: q, k, v, then the MLP's input
            width = cfg.inner_dim
            if np.ndim(array) == 0 or np.shape(array)[0] != (3 + MLP_RATIO) * width:
                raise CheckpointMismatchError(f"{key} has shape {tuple(np.shape(array))}: its rows are not q, k, v "
                                              f"and the MLP's input (3 x {width} + {MLP_RATIO} x {width}), so it does "
                                              "not fit the model config (a damaged file, or another architecture)")
            parts = np.split(array, [width, 2 * width, 3 * width])
        else:
            parts = fused_parts(key, array, names)
        if module == SWAPPED:  # (shift, scale) -> (scale, shift)
            parts = [np.concatenate(fused_parts(key, array, (f"{names[0]} (shift)", f"{names[0]} (scale)"))[::-1])]
        out.update(zip(names, parts))
    return out, unknown
