"""The original module names of Stable Diffusion checkpoints -> diffusers' names, as tables built from a config.

LDM (CompVis, SGM) names the UNet `input_blocks` / `middle_block` / `output_blocks` and the VAE `encoder.down.N`;
OpenCLIP its text tower `transformer.resblocks.N`; lllyasviel's ControlNets copy the UNet encoder's names; Stability's
SD 3 files the MMDiT's `joint_blocks.N`. A table maps a module prefix to diffusers' prefix, plus renames of the leaves
inside that module (`in_layers.0` -> `norm1`); a fused q/k/v tensor maps to three names. Single-file checkpoints,
ControlNet files and kohya LoRAs use them.
"""

from __future__ import annotations

import re

import numpy as np

RESNET = {"in_layers.0": "norm1", "in_layers.2": "conv1", "emb_layers.1": "time_emb_proj", "out_layers.0": "norm2",
          "out_layers.3": "conv2", "skip_connection": "conv_shortcut"}
VAE_RESNET = {"nin_shortcut": "conv_shortcut"}
VAE_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
OPENCLIP_LAYER = {
    "ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2",
    "attn.in_proj_weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.in_proj_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
}


def encoder_table(cfg) -> dict:
    """LDM names of the UNet's encoder half -> diffusers prefixes (or (prefix, leaf renames)), laid out as the
    config builds it; the ControlNet copies this half under the same names."""
    levels, per_block = len(cfg.block_out_channels), cfg.layers_per_block
    table = {"time_embed.0": "time_embedding.linear_1", "time_embed.2": "time_embedding.linear_2",
             "label_emb.0.0": "add_embedding.linear_1", "label_emb.0.2": "add_embedding.linear_2",  # SDXL
             "input_blocks.0.0": "conv_in",
             "middle_block.0": ("mid_block.resnets.0", RESNET), "middle_block.1": "mid_block.attentions.0",
             "middle_block.2": ("mid_block.resnets.1", RESNET)}
    i = 1  # input_blocks: one entry per resnet (+ attention), then one per downsampler
    for b, kind in enumerate(cfg.down_block_types):
        for j in range(per_block):
            table[f"input_blocks.{i}.0"] = (f"down_blocks.{b}.resnets.{j}", RESNET)
            if kind == "CrossAttnDownBlock2D":
                table[f"input_blocks.{i}.1"] = f"down_blocks.{b}.attentions.{j}"
            i += 1
        if b < levels - 1:
            table[f"input_blocks.{i}.0.op"] = f"down_blocks.{b}.downsamplers.0.conv"
            i += 1
    return table


def unet_table(cfg) -> dict:
    """LDM UNet module prefix -> diffusers prefix (or (prefix, leaf renames)), laid out as the config builds it."""
    levels, per_block = len(cfg.block_out_channels), cfg.layers_per_block
    table = {**encoder_table(cfg), "out.0": "conv_norm_out", "out.2": "conv_out"}
    i = 0  # output_blocks: resnet, attention, and the upsampler inside the block's last entry
    for b, kind in enumerate(cfg.up_block_types):
        cross = kind == "CrossAttnUpBlock2D"
        for j in range(per_block + 1):
            table[f"output_blocks.{i}.0"] = (f"up_blocks.{b}.resnets.{j}", RESNET)
            if cross:
                table[f"output_blocks.{i}.1"] = f"up_blocks.{b}.attentions.{j}"
            if j == per_block and b < levels - 1:
                table[f"output_blocks.{i}.{2 if cross else 1}.conv"] = f"up_blocks.{b}.upsamplers.0.conv"
            i += 1
    return table


def controlnet_table(cfg) -> dict:
    """The original ControlNet layout (lllyasviel's cldm.py) -> diffusers: the UNet encoder's names, one zero
    convolution per skip (`zero_convs.k.0`) and the mid block's (`middle_block_out.0`), and the condition encoder
    `input_hint_block`, a Sequential of convs with a SiLU after each but the last (so the convs sit at even
    indices): conv_in, then the blocks, then conv_out."""
    levels, per_block = len(cfg.block_out_channels), cfg.layers_per_block
    skips = 1 + levels * per_block + levels - 1  # conv_in, every resnet (+ attention), every downsampler
    table = {**encoder_table(cfg), "middle_block_out.0": "controlnet_mid_block",
             "input_hint_block.0": "controlnet_cond_embedding.conv_in"}
    table.update({f"zero_convs.{k}.0": f"controlnet_down_blocks.{k}" for k in range(skips)})
    blocks = 2 * (len(cfg.conditioning_embedding_out_channels) - 1)
    table.update({f"input_hint_block.{2 * (j + 1)}": f"controlnet_cond_embedding.blocks.{j}" for j in range(blocks)})
    table[f"input_hint_block.{2 * (blocks + 1)}"] = "controlnet_cond_embedding.conv_out"
    return table


def vae_table(cfg) -> dict:
    """LDM VAE prefixes -> diffusers; the decoder's `up.N` count from the bottom, diffusers' `up_blocks` from the top."""
    levels, per_block = len(cfg.block_out_channels), cfg.layers_per_block
    table = {name: name for name in ("encoder.conv_in", "encoder.conv_out", "decoder.conv_in", "decoder.conv_out",
                                     "quant_conv", "post_quant_conv")}
    for part in ("encoder", "decoder"):
        table[f"{part}.norm_out"] = f"{part}.conv_norm_out"
        table[f"{part}.mid.block_1"] = (f"{part}.mid_block.resnets.0", VAE_RESNET)
        table[f"{part}.mid.block_2"] = (f"{part}.mid_block.resnets.1", VAE_RESNET)
        table[f"{part}.mid.attn_1"] = (f"{part}.mid_block.attentions.0", VAE_ATTENTION)
    for i in range(levels):
        for j in range(per_block):
            table[f"encoder.down.{i}.block.{j}"] = (f"encoder.down_blocks.{i}.resnets.{j}", VAE_RESNET)
        if i < levels - 1:
            table[f"encoder.down.{i}.downsample.conv"] = f"encoder.down_blocks.{i}.downsamplers.0.conv"
        source = levels - 1 - i
        for j in range(per_block + 1):
            table[f"decoder.up.{source}.block.{j}"] = (f"decoder.up_blocks.{i}.resnets.{j}", VAE_RESNET)
        if i < levels - 1:
            table[f"decoder.up.{source}.upsample.conv"] = f"decoder.up_blocks.{i}.upsamplers.0.conv"
    return table


def openclip_table(cfg, projection=False) -> dict:
    """OpenCLIP text tower -> transformers' CLIPTextModel names (CLIPTextModelWithProjection's with `projection`),
    for the config's number of layers."""
    table = {"token_embedding": "embeddings.token_embedding",
             "positional_embedding": "embeddings.position_embedding.weight", "ln_final": "final_layer_norm"}
    if projection:  # stored transposed: see OPENCLIP_PROJECTION
        table["text_projection"] = "text_projection.weight"
    for i in range(cfg.num_hidden_layers):
        table[f"transformer.resblocks.{i}"] = (f"encoder.layers.{i}", OPENCLIP_LAYER)
    return table


def clip_table(cfg) -> None:
    return None  # SD 1.x stores transformers' own names: nothing to rename


def longest_prefix(mapping: dict, parts: list[str]):
    """The longest prefix of `parts` in `mapping`: (value, the parts after it), or (None, parts)."""
    for n in range(len(parts), 0, -1):
        value = mapping.get(".".join(parts[:n]))
        if value is not None:
            return value, parts[n:]
    return None, parts


def map_key(key: str, table) -> tuple[str, ...] | None:
    """An LDM name (without its component prefix) -> diffusers name(s); None if the table has no entry."""
    if table is None:
        return (key,)
    entry, rest = longest_prefix(table, key.split("."))
    if entry is None:
        return None
    target, leaves = entry if isinstance(entry, tuple) else (entry, {})
    leaf, rest = longest_prefix(leaves, rest)
    if isinstance(leaf, tuple):  # a fused tensor: one name per part
        return tuple(".".join([target, name, *rest]) for name in leaf)
    return (".".join([target, *([leaf] if leaf else []), *rest]),)


# ---- SD 3 / 3.5 single files in Stability's layout ----------------------------------------------------------------
# One file holds the models under these prefixes (the text encoders only in some files, T5 in fewer):
#     model.diffusion_model.*              the MMDiT (joint_blocks.N.x_block / context_block, fused attn.qkv)
#     first_stage_model.*                  the VAE, in LDM names (`vae_table`)
#     text_encoders.clip_l.transformer.*   CLIP-L, in transformers' names (its pooled output used unprojected)
#     text_encoders.clip_g.transformer.*   CLIP-G with its projection, in transformers' names
#     text_encoders.t5xxl.transformer.*    T5 XXL's encoder, in transformers' names
# The MMDiT table follows diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`: a block's image and context
# halves become one `transformer_blocks.N`, and a fused q/k/v tensor is split in equal thirds.

SD3_LAYOUT = {"model.diffusion_model.": "transformer", "first_stage_model.": "vae",
          "text_encoders.clip_l.transformer.": "text_encoder", "text_encoders.clip_g.transformer.": "text_encoder_2",
          "text_encoders.t5xxl.transformer.": "text_encoder_3"}
MMDIT_PREFIX = "model.diffusion_model."
SD3_PARTS = {"text_encoder": "CLIP-L (text_encoders.clip_l.*)", "text_encoder_2": "CLIP-G (text_encoders.clip_g.*)",
             "text_encoder_3": "T5 (text_encoders.t5xxl.*)", "vae": "VAE (first_stage_model.*)"}

# Tensors such files carry that no pipeline uses: CLIP's contrastive temperature (ComfyUI saves one per encoder)
# and CLIP-L's projection, which SD 3 leaves out of its pooled conditioning (diffusers loads an identity instead).
SD3_UNUSED = re.compile(r"^text_encoders\.\w+\.logit_scale$"
                        r"|^text_encoders\.clip_l\.transformer\.text_projection\.weight$")

X_BLOCK = {  # the image stream of a joint block
    "attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"), "attn.ln_q": "attn.norm_q", "attn.ln_k": "attn.norm_k",
    "attn.proj": "attn.to_out.0",
    "attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v"), "attn2.ln_q": "attn2.norm_q",  # SD 3.5 Medium's MMDiT-X
    "attn2.ln_k": "attn2.norm_k", "attn2.proj": "attn2.to_out.0",
    "adaLN_modulation.1": "norm1.linear", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2",
}
CONTEXT_BLOCK = {  # the text stream of a joint block (the last block's has attention and modulation only)
    "attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "attn.ln_q": "attn.norm_added_q",
    "attn.ln_k": "attn.norm_added_k", "attn.proj": "attn.to_add_out", "adaLN_modulation.1": "norm1_context.linear",
    "mlp.fc1": "ff_context.net.0.proj", "mlp.fc2": "ff_context.net.2",
}

# diffusers' model types, told apart as its `infer_diffusers_model_type` does: the Medium width (block 0's context
# modulation, 6 x 1536) with the position table's size (192² or 384² patches), else Large's 38th block.
MEDIUM_MODULATION = "model.diffusion_model.joint_blocks.0.context_block.adaLN_modulation.1.bias"
MEDIUM_POSITIONS = {192 * 192: "sd3", 384 * 384: "sd35_medium"}
LARGE_BLOCK = "model.diffusion_model.joint_blocks.37.x_block.mlp.fc1.weight"
# The bundled configs per model type: SD 3 Medium is SD 3.5 Medium's shape without qk norms, dual attention and
# the larger position table.
SD3_BUNDLED = {"sd3": "sd35_medium", "sd35_medium": "sd35_medium", "sd35_large": "sd35_large"}
SD3_TRANSFORMER_CHANGES = {"sd3": {"pos_embed_max_size": 192, "qk_norm": None, "dual_attention_layers": []}}
SD3_NAMES = {"sd3": "stable-diffusion-3-medium", "sd35_medium": "stable-diffusion-3.5-medium",
             "sd35_large": "stable-diffusion-3.5-large"}


def sd3_with_prefixes(state_dict: dict) -> dict:
    """The tensors with Stability's prefixes: an MMDiT saved alone (`joint_blocks.*`) gets `model.diffusion_model.`."""
    if any(k.startswith("joint_blocks.") for k in state_dict):
        return {MMDIT_PREFIX + k: v for k, v in state_dict.items()}
    return state_dict


def sd3_components_in(state_dict) -> set[str]:
    """The pipeline components whose tensors the file holds."""
    prefixes = {m[0] for k in state_dict if (m := re.match(r"model\.diffusion_model\.|first_stage_model\.|"
                                                          r"text_encoders\.\w+\.transformer\.", k))}
    return {SD3_LAYOUT[prefix] for prefix in prefixes if prefix in SD3_LAYOUT}


def is_sd3_file(keys) -> bool:
    """Whether the tensor names hold an MMDiT under `model.diffusion_model.`."""
    return any(k.startswith(MMDIT_PREFIX + "joint_blocks.") for k in keys)


def sd3_model_type(state_dict) -> str | None:
    """'sd3', 'sd35_medium' or 'sd35_large' from the tensors' names and shapes; None for an MMDiT of another size."""
    if MEDIUM_MODULATION in state_dict and state_dict[MEDIUM_MODULATION].shape[-1] == 6 * 1536:
        positions = state_dict.get(MMDIT_PREFIX + "pos_embed")
        return None if positions is None or len(positions.shape) < 2 else MEDIUM_POSITIONS.get(positions.shape[1])
    return "sd35_large" if LARGE_BLOCK in state_dict else None


def mmdit_table(cfg) -> dict:
    """Stability's MMDiT prefixes -> diffusers' (or (prefix, leaf renames)), for the config's number of blocks."""
    table = {"pos_embed": "pos_embed.pos_embed", "x_embedder.proj": "pos_embed.proj",
             "t_embedder.mlp.0": "time_text_embed.timestep_embedder.linear_1",
             "t_embedder.mlp.2": "time_text_embed.timestep_embedder.linear_2",
             "y_embedder.mlp.0": "time_text_embed.text_embedder.linear_1",
             "y_embedder.mlp.2": "time_text_embed.text_embedder.linear_2",
             "context_embedder": "context_embedder", "final_layer.linear": "proj_out",
             "final_layer.adaLN_modulation.1": "norm_out.linear"}
    for i in range(cfg.num_layers):
        table[f"joint_blocks.{i}.x_block"] = (f"transformer_blocks.{i}", X_BLOCK)
        table[f"joint_blocks.{i}.context_block"] = (f"transformer_blocks.{i}", CONTEXT_BLOCK)
    return table


def swapped_halves(cfg) -> frozenset:
    """The diffusers names whose rows Stability stores as (shift, scale) and diffusers' AdaLayerNormContinuous
    reads as (scale, shift): the final layer's modulation and the last block's context modulation."""
    modules = ("norm_out.linear", f"transformer_blocks.{cfg.num_layers - 1}.norm1_context.linear")
    return frozenset(f"{module}.{leaf}" for module in modules for leaf in ("weight", "bias"))


def fused_parts(key, array, names) -> list:
    """A fused tensor (an attention's qkv) cut into the models' tensors `names`, along its rows."""
    if len(names) == 1:
        return [array]
    if np.ndim(array) == 0 or np.shape(array)[0] % len(names):
        from .weights import CheckpointMismatchError

        raise CheckpointMismatchError(f"{key} has shape {tuple(np.shape(array))}: its rows do not split into the "
                                      f"{len(names)} tensors it holds ({', '.join(names)}), so it does not fit the "
                                      "model config (a damaged file, or another architecture)")
    return np.split(array, len(names))


def split_sd3(state_dict: dict, configs: dict, components) -> tuple[dict, list[str]]:
    """({component: {diffusers name: array}} for `components`, the keys no table maps) of an SD 3 file.

    `configs` holds the transformer's and the VAE's configs (SD3TransformerConfig, VAEConfig) and, where the file's
    CLIP-L is read, its CLIPTextConfig: CLIP-L gets an identity projection, as diffusers gives it. Tensors of the
    components not asked for (T5 left out) are passed over.
    """
    tables = {"transformer": mmdit_table(configs["transformer"]), "vae": vae_table(configs["vae"]),
              "text_encoder": None, "text_encoder_2": None, "text_encoder_3": None}  # transformers' names already
    swapped = swapped_halves(configs["transformer"])
    out = {component: {} for component in components}
    unknown = []
    for key, array in state_dict.items():
        prefix = next((p for p in SD3_LAYOUT if key.startswith(p)), None)
        if SD3_UNUSED.search(key) or (prefix is not None and SD3_LAYOUT[prefix] not in components):
            continue
        names = None if prefix is None else map_key(key[len(prefix):], tables[SD3_LAYOUT[prefix]])
        if names is None:
            unknown.append(key)
            continue
        for name, part in zip(names, fused_parts(key, array, names)):
            out[SD3_LAYOUT[prefix]][name] = np.concatenate(np.split(part, 2)[::-1]) if name in swapped else part
    if "text_encoder" in out:  # SD 3 pools CLIP-L unprojected
        width = configs["text_encoder"].hidden_size
        out["text_encoder"]["text_projection.weight"] = np.eye(width, dtype=np.float32)
    return out, unknown
