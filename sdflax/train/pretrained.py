"""A trained model back in diffusers' layout: our params -> PyTorch names and layouts, written as the folder
`from_pretrained` (diffusers' and sdflax's) reads.

Our module names are PyTorch's with "." -> "_" (weights.py), which loses where one name ends and the next begins.
The PyTorch names are attribute names from a small vocabulary (`WORDS`), so the joined name is cut back into them
by longest match; a number after a container (`down_blocks_0`) is an index. A name that does not cut is an error,
never a guess.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
from flax import traverse_util

from .files import write_safetensors
from ..loading.hub import resolve_folder

# The attribute names of diffusers' UNet2DConditionModel and AutoencoderKL and transformers' CLIP text models
WORDS = frozenset("""
    conv_in conv_out conv_norm_out time_embedding linear_1 linear_2 add_embedding down_blocks up_blocks mid_block
    resnets attentions downsamplers upsamplers conv conv1 conv2 conv_shortcut norm1 norm2 norm3 time_emb_proj
    norm proj_in proj_out transformer_blocks attn1 attn2 to_q to_k to_v to_out ff net proj
    encoder decoder quant_conv post_quant_conv group_norm
    embeddings token_embedding position_embedding layers self_attn q_proj k_proj v_proj out_proj layer_norm1
    layer_norm2 mlp fc1 fc2 final_layer_norm text_projection
""".split())
LONGEST = max(word.count("_") + 1 for word in WORDS)
LEAVES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}
WEIGHTS_FILE = {"unet": "diffusion_pytorch_model.safetensors", "vae": "diffusion_pytorch_model.safetensors",
                "text_encoder": "model.safetensors", "text_encoder_2": "model.safetensors"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".msgpack", ".index.json", ".ckpt", ".pt", ".pth")


def torch_module_name(joined: str) -> str:
    """"down_blocks_0_attentions_0" -> "down_blocks.0.attentions.0"; "time_embedding_linear_1" ->
    "time_embedding.linear_1"."""
    pieces, out, i = joined.split("_"), [], 0
    while i < len(pieces):
        for j in range(min(len(pieces), i + LONGEST), i, -1):
            if "_".join(pieces[i:j]) in WORDS:
                out.append("_".join(pieces[i:j]))
                i = j
                break
        else:
            if not pieces[i].isdigit():
                raise ValueError(f"cannot name {joined!r} in PyTorch's layout ({pieces[i]!r} is not a module sdflax "
                                 "knows): save_pretrained writes SD 1.x / 2.x / SDXL models")
            out.append(pieces[i])
            i += 1
    return ".".join(out)


def torch_state_dict(component: str, params) -> dict[str, np.ndarray]:
    """One model's params as a PyTorch state dict: linear kernels (in, out) -> (out, in), conv HWIO -> OIHW; CLIP's
    encoder under "text_model." as the hub's checkpoints have it."""
    state = {}
    for path, value in traverse_util.flatten_dict(params).items():
        value = np.asarray(value)
        name = torch_module_name("_".join(path[:-1]))
        if component.startswith("text_encoder") and name != "text_projection":
            name = "text_model." + name
        if path[-1] == "kernel":
            value = value.T if value.ndim == 2 else value.transpose(3, 2, 0, 1)
        state[f"{name}.{LEAVES.get(path[-1], path[-1])}"] = np.ascontiguousarray(value)
    return state


def save_pretrained(folder, base, params, revision=None):
    """A diffusers pipeline folder: `base`'s (the folder or hub id the training started from) configs, tokenizers
    and scheduler, and the models' weights from `params`. `folder` must not exist yet."""
    folder = os.fspath(folder)
    if os.path.lexists(folder):
        raise FileExistsError(f"{folder} exists: save_pretrained writes a new folder")
    source = resolve_folder(base, revision)
    staging = f"{folder}.partial-{os.getpid()}"

    def ignore(path, names):
        component = os.path.basename(path)
        return [n for n in names if component in params and n.endswith(WEIGHT_SUFFIXES)]

    try:
        shutil.copytree(source, staging, ignore=ignore)
        for component, weights in params.items():
            if component in WEIGHTS_FILE:
                write_safetensors(os.path.join(staging, component, WEIGHTS_FILE[component]),
                                  torch_state_dict(component, weights), {"format": "pt"})
        os.rename(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
