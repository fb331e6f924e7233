"""The original module names of Stable Diffusion checkpoints -> diffusers' names, as tables built from a config.

LDM (CompVis, SGM) names the UNet `input_blocks` / `middle_block` / `output_blocks` and the VAE `encoder.down.N`;
OpenCLIP its text tower `transformer.resblocks.N`; lllyasviel's ControlNets copy the UNet encoder's names. A table
maps a module prefix to diffusers' prefix, plus renames of the leaves inside that module (`in_layers.0` ->
`norm1`); a fused q/k/v tensor maps to three names. Single-file checkpoints, ControlNet files and kohya LoRAs use
them.
"""

from __future__ import annotations

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
