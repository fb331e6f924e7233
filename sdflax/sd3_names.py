"""SD 3 / 3.5 single files in Stability's layout -> diffusers' names, as tables built from a config.

One file holds the models under these prefixes (the text encoders only in some files, T5 in fewer):

    model.diffusion_model.*              the MMDiT (joint_blocks.N.x_block / context_block, fused attn.qkv)
    first_stage_model.*                  the VAE, in LDM names (`ldm_names.vae_table`)
    text_encoders.clip_l.transformer.*   CLIP-L, in transformers' names (its pooled output used unprojected)
    text_encoders.clip_g.transformer.*   CLIP-G with its projection, in transformers' names
    text_encoders.t5xxl.transformer.*    T5 XXL's encoder, in transformers' names

The MMDiT table follows diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`: a block's image and
context halves become one `transformer_blocks.N`, and a fused q/k/v tensor is split in equal thirds.
"""

from __future__ import annotations

import re

import numpy as np

from .ldm_names import map_key, vae_table

LAYOUT = {"model.diffusion_model.": "transformer", "first_stage_model.": "vae",
          "text_encoders.clip_l.transformer.": "text_encoder", "text_encoders.clip_g.transformer.": "text_encoder_2",
          "text_encoders.t5xxl.transformer.": "text_encoder_3"}
TRANSFORMER_PREFIX = "model.diffusion_model."
PARTS = {"text_encoder": "CLIP-L (text_encoders.clip_l.*)", "text_encoder_2": "CLIP-G (text_encoders.clip_g.*)",
         "text_encoder_3": "T5 (text_encoders.t5xxl.*)", "vae": "VAE (first_stage_model.*)"}

# Tensors such files carry that no pipeline uses: CLIP's contrastive temperature (ComfyUI saves one per encoder)
# and CLIP-L's projection, which SD 3 leaves out of its pooled conditioning (diffusers loads an identity instead).
UNUSED = re.compile(r"^text_encoders\.\w+\.logit_scale$|^text_encoders\.clip_l\.transformer\.text_projection\.weight$")

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
BUNDLED = {"sd3": "sd35_medium", "sd35_medium": "sd35_medium", "sd35_large": "sd35_large"}
TRANSFORMER_CHANGES = {"sd3": {"pos_embed_max_size": 192, "qk_norm": None, "dual_attention_layers": []}}
NAMES = {"sd3": "stable-diffusion-3-medium", "sd35_medium": "stable-diffusion-3.5-medium",
         "sd35_large": "stable-diffusion-3.5-large"}


def with_prefixes(state_dict: dict) -> dict:
    """The tensors with Stability's prefixes: an MMDiT saved alone (`joint_blocks.*`) gets `model.diffusion_model.`."""
    if any(k.startswith("joint_blocks.") for k in state_dict):
        return {TRANSFORMER_PREFIX + k: v for k, v in state_dict.items()}
    return state_dict


def components_in(state_dict) -> set[str]:
    """The pipeline components whose tensors the file holds."""
    prefixes = {m[0] for k in state_dict if (m := re.match(r"model\.diffusion_model\.|first_stage_model\.|"
                                                          r"text_encoders\.\w+\.transformer\.", k))}
    return {LAYOUT[prefix] for prefix in prefixes if prefix in LAYOUT}


def is_sd3_file(keys) -> bool:
    """Whether the tensor names hold an MMDiT under `model.diffusion_model.`."""
    return any(k.startswith(TRANSFORMER_PREFIX + "joint_blocks.") for k in keys)


def model_type(state_dict) -> str | None:
    """'sd3', 'sd35_medium' or 'sd35_large' from the tensors' names and shapes; None for an MMDiT of another size."""
    if MEDIUM_MODULATION in state_dict and state_dict[MEDIUM_MODULATION].shape[-1] == 6 * 1536:
        positions = state_dict.get(TRANSFORMER_PREFIX + "pos_embed")
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
        prefix = next((p for p in LAYOUT if key.startswith(p)), None)
        if UNUSED.search(key) or (prefix is not None and LAYOUT[prefix] not in components):
            continue
        names = None if prefix is None else map_key(key[len(prefix):], tables[LAYOUT[prefix]])
        if names is None:
            unknown.append(key)
            continue
        parts = np.split(array, len(names)) if len(names) > 1 else [array]
        for name, part in zip(names, parts):
            out[LAYOUT[prefix]][name] = np.concatenate(np.split(part, 2)[::-1]) if name in swapped else part
    if "text_encoder" in out:  # SD 3 pools CLIP-L unprojected
        width = configs["text_encoder"].hidden_size
        out["text_encoder"]["text_projection.weight"] = np.eye(width, dtype=np.float32)
    return out, unknown
