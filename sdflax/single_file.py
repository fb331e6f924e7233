"""Single-file checkpoints in the original CompVis / A1111 layout -> the params `from_pretrained` gives.

One file holds the three models under their LDM names:

    model.diffusion_model.*         the UNet (input_blocks / middle_block / output_blocks)
    first_stage_model.*             the VAE (encoder.down.N.block.M, mid.attn_1.q, ...)
    cond_stage_model.transformer.*  SD 1.x: the CLIP text model, already in transformers' names
    cond_stage_model.model.*        SD 2.x: OpenCLIP (transformer.resblocks.N, fused attn.in_proj_weight)

Each model's names go through a table built from its config: LDM module prefix -> diffusers module prefix,
plus renames of the leaves inside that module (`in_layers.0` -> `norm1`). A fused q/k/v tensor maps to three
names and is split in equal thirds. The diffusers-named tensors then take the ordinary path of `weights.py`.

ControlNets come as files of their own in lllyasviel's layout (`load_controlnet`): the UNet encoder's names,
`zero_convs.*`, `middle_block_out.*` and `input_hint_block.*`, under `control_model.` in ControlNet 1.0 files.
"""

from __future__ import annotations

import os
import re
import warnings
from importlib import resources

import numpy as np

__all__ = ["SingleFileError", "detect_version", "split_components", "bundled_config_folder"]

COMPONENT_PREFIXES = {
    "model.diffusion_model.": "unet",
    "first_stage_model.": "vae",
    "cond_stage_model.transformer.": "text_encoder",  # SD 1.x: transformers' CLIPTextModel names
    "cond_stage_model.model.": "text_encoder",  # SD 2.x: OpenCLIP names
}

# Tensors every such file carries and no pipeline uses: skipped without a word.
UNUSED = re.compile(
    r"^(betas|alphas_cumprod|alphas_cumprod_prev|sqrt_alphas_cumprod|sqrt_one_minus_alphas_cumprod"
    r"|log_one_minus_alphas_cumprod|sqrt_recip_alphas_cumprod|sqrt_recipm1_alphas_cumprod|posterior_variance"
    r"|posterior_log_variance_clipped|posterior_mean_coef1|posterior_mean_coef2|logvar|lvlb_weights)$"  # DDPM buffers
    r"|^cond_stage_model\.model\.(text_projection|logit_scale)$"  # OpenCLIP's contrastive head
)
# Tensors some files carry that the pipeline does not use: a warning lists them (the EMA weights may be wanted).
KNOWN_EXTRAS = re.compile(r"^model_ema\.|^first_stage_model\.loss\.")

DEFAULTS = {"sd1": "stable-diffusion-v1-5", "sd2": "stable-diffusion-2-1 (768 px, v-prediction)"}

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


class SingleFileError(ValueError):
    """The file is not a single-file SD 1.x / 2.x checkpoint, or holds tensors no table maps."""


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


def openclip_table(cfg) -> dict:
    """OpenCLIP text tower -> transformers' CLIPTextModel names, for the config's number of layers."""
    table = {"token_embedding": "embeddings.token_embedding",
             "positional_embedding": "embeddings.position_embedding.weight", "ln_final": "final_layer_norm"}
    for i in range(cfg.num_hidden_layers):
        table[f"transformer.resblocks.{i}"] = (f"encoder.layers.{i}", OPENCLIP_LAYER)
    return table


def clip_table(cfg) -> None:
    return None  # SD 1.x stores transformers' own names: nothing to rename


def _lookup(mapping: dict, parts: list[str]):
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
    entry, rest = _lookup(table, key.split("."))
    if entry is None:
        return None
    target, leaves = entry if isinstance(entry, tuple) else (entry, {})
    leaf, rest = _lookup(leaves, rest)
    if isinstance(leaf, tuple):  # a fused tensor: one name per part
        return tuple(".".join([target, name, *rest]) for name in leaf)
    return (".".join([target, *([leaf] if leaf else []), *rest]),)


def detect_version(keys) -> str:
    """'sd1' (CLIP ViT-L text encoder) or 'sd2' (OpenCLIP ViT-H) from the tensor names."""
    keys = list(keys)
    if any(k.startswith("conditioner.embedders.") for k in keys):
        raise SingleFileError("this is an SDXL checkpoint (conditioner.embedders.*); sdflax runs SD 1.x and 2.x")
    if not any(k.startswith("model.diffusion_model.") for k in keys):
        sample = ", ".join(sorted(keys)[:5])
        raise SingleFileError(f"not a single-file Stable Diffusion checkpoint: no model.diffusion_model.* tensors "
                              f"(found {sample}{' ...' if len(keys) > 5 else ''}); a diffusers folder loads with "
                              "StableDiffusion.from_pretrained")
    if any(k.startswith("cond_stage_model.model.") for k in keys):
        return "sd2"
    if any(k.startswith("cond_stage_model.transformer.") for k in keys):
        return "sd1"
    raise SingleFileError("the checkpoint has a UNet but no text encoder (cond_stage_model.transformer.* for "
                          "SD 1.x or cond_stage_model.model.* for SD 2.x)")


def split_components(state_dict: dict, configs: dict, version: str) -> dict[str, dict[str, np.ndarray]]:
    """{component: {diffusers name: array}} for "unet", "vae", "text_encoder".

    `configs` holds the three models' configs (UNetConfig, VAEConfig, CLIPTextConfig). Keys no table maps are
    an error that lists them, known extras (EMA weights, the VAE's loss) a warning; the parts of the format that
    no pipeline uses (DDPM buffers, OpenCLIP's contrastive head and the layer after the penultimate) are skipped.
    """
    tables = {"unet": unet_table(configs["unet"]), "vae": vae_table(configs["vae"]),
              "text_encoder": (openclip_table if version == "sd2" else clip_table)(configs["text_encoder"])}
    layers = configs["text_encoder"].num_hidden_layers
    # SD 2.x conditions on OpenCLIP's penultimate layer: the layers after it are in the file but unused.
    unused_layers = re.compile(rf"^cond_stage_model\.model\.transformer\.resblocks\.(\d+)\.")
    out = {name: {} for name in tables}
    extras, unknown = [], []
    for key, array in state_dict.items():
        prefix = next((p for p in COMPONENT_PREFIXES if key.startswith(p)), None)
        names = None
        if prefix is not None:
            component = COMPONENT_PREFIXES[prefix]
            names = map_key(key[len(prefix):], tables[component])
        if names is None:
            layer = unused_layers.match(key)
            if KNOWN_EXTRAS.search(key):
                extras.append(key)
            elif not (UNUSED.search(key) or (version == "sd2" and layer and int(layer.group(1)) >= layers)):
                unknown.append(key)
            continue
        parts = np.split(array, len(names)) if len(names) > 1 else [array]
        for name, part in zip(names, parts):
            out[component][name] = part
    if unknown:
        raise SingleFileError(f"{len(unknown)} tensors that no table maps (is the config right for this file?): "
                              f"{_listing(unknown)}")
    if extras:
        warnings.warn(f"ignoring {len(extras)} tensors the pipeline does not use: {_listing(extras, 6)}",
                      stacklevel=4)  # the caller of StableDiffusion.from_single_file
    return out


def _listing(keys, limit=12):
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" ... and {len(keys) - limit} more" if len(keys) > limit else "")


def bundled_config_folder(version: str) -> str:
    """The package's default configs for 'sd1' (stable-diffusion-v1-5) or 'sd2' (stable-diffusion-2-1)."""
    return os.fspath(resources.files("sdflax") / "configs" / version)


def bundled_tokenizer(version: str):
    from transformers import CLIPTokenizer

    folder = os.fspath(resources.files("sdflax") / "configs" / "tokenizer")
    # The same BPE vocabulary; SD 2.x pads with "!" (id 0) where SD 1.x pads with <|endoftext|>.
    return CLIPTokenizer.from_pretrained(folder, **({"pad_token": "!"} if version == "sd2" else {}))


def load_single_file(path, config=None, dtype=None, prediction_type=None, scheduler=None, scheduler_config=None,
                     attention="auto", revision=None):
    """(a pipeline's constructor arguments, params) from a .safetensors / .ckpt file; see
    `StableDiffusion.from_single_file`."""
    import jax.numpy as jnp

    from .checkpoint_files import read_checkpoint
    from .loading import build_models, load_scheduler, load_tokenizer
    from .models.clip import CLIPTextModel
    from .models.config import read_config_file
    from .models.unet import UNet2DConditionModel
    from .models.vae import AutoencoderKL
    from .weights import CheckpointMismatchError, convert_state_dict

    dtype = jnp.float32 if dtype is None else dtype
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"no checkpoint file at {name}")
    state_dict = read_checkpoint(name)
    version = detect_version(state_dict)

    if config is not None:
        from .hub import resolve_folder

        folder = resolve_folder(config, revision, allow_patterns=["model_index.json", "*/config.json", "scheduler/*",
                                                                  "tokenizer/*"])
        tokenizer = load_tokenizer(os.path.join(folder, "tokenizer"))
    else:
        folder = bundled_config_folder(version)
        tokenizer = bundled_tokenizer(version)
    model_configs = {c: read_config_file(os.path.join(folder, c, "config.json")) for c in ("unet", "vae", "text_encoder")}
    overrides = dict(scheduler_config or {})
    if prediction_type is not None:
        overrides["prediction_type"] = prediction_type
        if config is None and version == "sd2" and prediction_type == "epsilon":
            model_configs["unet"]["sample_size"] = 64  # SD 2.x base: 512 px
    scheduler = load_scheduler(folder, scheduler, overrides or None)

    classes = {"text_encoder": CLIPTextModel, "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    modules = build_models(classes, model_configs, dtype, attention)
    where = os.path.basename(name)
    try:
        components = split_components(state_dict, {c: m.config for c, m in modules.items()}, version)
        params = {c: convert_state_dict(components[c], m.param_shapes(), dtype, where=f"{where} ({c})")
                  for c, m in modules.items()}
    except (SingleFileError, CheckpointMismatchError) as e:
        source = f"the configs in {config}" if config is not None else (
            f"sdflax's bundled {DEFAULTS[version]} configs")
        raise SingleFileError(f"{e}\nThe model configs came from {source}: for another architecture pass "
                              "config=<a diffusers folder or hub id of the same model>") from None
    return {"tokenizer": tokenizer, "scheduler": scheduler, "dtype": dtype, **modules}, params


CONTROLNET_PREFIX = "control_model."  # ControlNet 1.0 files hold a whole SD model besides the net
CROSS_ATTENTION_VERSIONS = {768: "sd1", 1024: "sd2"}


def controlnet_config(state_dict: dict, name: str) -> dict:
    """A diffusers ControlNet config.json dict for an SD 1.x / 2.x net in the original layout: the bundled UNet
    config of the family its cross-attention width names, and the condition encoder's channels read off the
    `input_hint_block` convs (conv_in's width, then every stride-2 conv's)."""
    widths = {state_dict[k].shape[1] for k in state_dict if re.search(r"attn2\.to_k\.weight$", k)}
    if len(widths) != 1 or (version := CROSS_ATTENTION_VERSIONS.get(widths.pop())) is None:
        raise SingleFileError(f"{name}: cannot tell the base model of this ControlNet from its tensors (an SDXL "
                              "net?): pass config=<the diffusers folder or hub id of a ControlNet of the same "
                              "architecture>")
    from .models.config import read_config_file

    config = read_config_file(os.path.join(bundled_config_folder(version), "unet", "config.json"))
    hint = sorted(int(m[1]) for k in state_dict if (m := re.fullmatch(r"input_hint_block\.(\d+)\.weight", k)))
    if not hint or hint != list(range(0, 2 * len(hint), 2)):
        raise SingleFileError(f"{name}: the condition encoder (input_hint_block.N.weight) has convs at {hint}; "
                              "expected 0, 2, 4, ...")
    levels = len(hint) // 2  # conv_in, two convs per further level, conv_out
    channels = [state_dict["input_hint_block.0.weight"].shape[0]]
    channels += [state_dict[f"input_hint_block.{4 * i + 4}.weight"].shape[0] for i in range(levels - 1)]
    # upcast_attention off, as diffusers' converter configures such nets (SD 2.1's UNet config turns it on)
    return {**config, "upcast_attention": False,
            "conditioning_channels": int(state_dict["input_hint_block.0.weight"].shape[1]),
            "conditioning_embedding_out_channels": channels}


def load_controlnet(cls, path, config=None, dtype=None, attention="auto", revision=None):
    """(cls (ControlNetModel), params) from a ControlNet file in the original layout (control_v11p_sd15_canny.pth /
    .safetensors, or a ControlNet 1.0 file under `control_model.`); see `ControlNetModel.from_single_file`."""
    import jax.numpy as jnp

    from .checkpoint_files import read_checkpoint
    from .models.config import read_config_file
    from .weights import CheckpointMismatchError, convert_state_dict

    dtype = jnp.float32 if dtype is None else dtype
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"no ControlNet file at {name}")
    where = os.path.basename(name)
    state_dict = read_checkpoint(name)
    if any(k.startswith(CONTROLNET_PREFIX) for k in state_dict):
        state_dict = {k[len(CONTROLNET_PREFIX):]: v for k, v in state_dict.items() if k.startswith(CONTROLNET_PREFIX)}
    if "input_hint_block.0.weight" not in state_dict or "time_embed.0.weight" not in state_dict:
        found = "diffusers names: use ControlNetModel.from_pretrained" if "conv_in.weight" in state_dict else (
            "a Stable Diffusion checkpoint: use StableDiffusion.from_single_file"
            if any(k.startswith("model.diffusion_model.") for k in state_dict) else "other tensors")
        raise SingleFileError(f"{where} is not a ControlNet in the original layout (no input_hint_block / "
                              f"time_embed tensors; found {found})")
    if config is not None:
        from .hub import resolve_folder

        folder = resolve_folder(config, revision, allow_patterns=["config.json"])
        model_config = read_config_file(os.path.join(folder, "config.json"))
    else:
        model_config = controlnet_config(state_dict, where)
    model = cls.from_config(model_config, dtype, attention)
    table = controlnet_table(model.config)
    named, unknown = {}, []
    for key, array in state_dict.items():
        names = map_key(key, table)
        if names is None:
            unknown.append(key)
        else:
            named[names[0]] = array
    try:
        if unknown:
            raise SingleFileError(f"{len(unknown)} tensors that no table maps: {_listing(unknown)}")
        params = convert_state_dict(named, model.param_shapes(), dtype, where=where)
    except (SingleFileError, CheckpointMismatchError) as e:
        source = f"the config in {config}" if config is not None else "the tensors and sdflax's bundled UNet configs"
        raise SingleFileError(f"{e}\nThe ControlNet config came from {source}: for another architecture pass config="
                              "<the diffusers folder or hub id of a ControlNet of the same architecture>") from None
    return model, params
