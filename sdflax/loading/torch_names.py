"""Our params -> PyTorch's names and layouts: the inverse of `weights.py`, for writing checkpoints that diffusers and
transformers read (a trained model, `sdflax demo`'s stand-ins).

Our module names are PyTorch's with "." -> "_" (weights.py), which loses where one name ends and the next begins.
The PyTorch names are attribute names from a small vocabulary (`WORDS`), so the joined name is cut back into them
by longest match; a number after a container (`down_blocks_0`) is an index. A name that does not cut is an error,
never a guess.
"""

from __future__ import annotations

import numpy as np
from flax import traverse_util

# The attribute names of diffusers' UNet2DConditionModel, AutoencoderKL, ControlNetModel, T2IAdapter and
# SD3Transformer2DModel, and of transformers' CLIP text and vision models and T5 encoder
WORDS = frozenset("""
    conv_in conv_out conv_norm_out time_embedding linear_1 linear_2 add_embedding down_blocks up_blocks mid_block
    resnets attentions downsamplers upsamplers conv conv1 conv2 conv_shortcut norm1 norm2 norm3 time_emb_proj
    norm proj_in proj_out transformer_blocks attn1 attn2 to_q to_k to_v to_out ff net proj
    encoder decoder quant_conv post_quant_conv group_norm
    embeddings token_embedding position_embedding layers self_attn q_proj k_proj v_proj out_proj layer_norm1
    layer_norm2 mlp fc1 fc2 final_layer_norm text_projection
    controlnet_cond_embedding blocks controlnet_down_blocks controlnet_mid_block
    adapter body in_conv block1 block2
    pos_embed context_embedder time_text_embed timestep_embedder text_embedder norm_out linear norm1_context
    ff_context attn add_q_proj add_k_proj add_v_proj to_add_out norm_q norm_k norm_added_q norm_added_k
    patch_embedding pre_layrnorm post_layernorm visual_projection
    shared block layer SelfAttention q k v o relative_attention_bias layer_norm DenseReluDense wi wi_0 wi_1 wo
""".split())
LONGEST = max(word.count("_") + 1 for word in WORDS)
LEAVES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


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
                                 "knows): sdflax writes SD 1.x / 2.x / SDXL / SD 3.x models and their adapters")
            out.append(pieces[i])
            i += 1
    return ".".join(out)


def torch_state_dict(params, prefix: str = "", unprefixed=()) -> dict[str, np.ndarray]:
    """One model's params as a PyTorch state dict: linear kernels (in, out) -> (out, in), conv HWIO -> OIHW; every
    name but those in `unprefixed` under `prefix` (CLIP's "text_model.", as the hub's checkpoints have it)."""
    state = {}
    for path, value in traverse_util.flatten_dict(params).items():
        value = np.asarray(value)
        name = torch_module_name("_".join(path[:-1]))
        if name not in unprefixed:
            name = prefix + name
        if path[-1] == "kernel":
            value = value.T if value.ndim == 2 else value.transpose(3, 2, 0, 1)
        state[f"{name}.{LEAVES.get(path[-1], path[-1])}"] = np.ascontiguousarray(value)
    return state
