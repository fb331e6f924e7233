"""Single-file checkpoints in the original CompVis / A1111 layout -> the params `from_pretrained` gives.

One file holds the models under their LDM / SGM names:

    model.diffusion_model.*                SD and SDXL: the UNet (input_blocks / middle_block / output_blocks)
    first_stage_model.*                    SD and SDXL: the VAE (encoder.down.N.block.M, mid.attn_1.q, ...)
    cond_stage_model.transformer.*         SD 1.x: the CLIP text model, already in transformers' names
    cond_stage_model.model.*               SD 2.x: OpenCLIP (transformer.resblocks.N, fused attn.in_proj_weight)
    conditioner.embedders.0.transformer.*  SDXL base: CLIP ViT-L (text_encoder), in transformers' names
    conditioner.embedders.1.model.*        SDXL base: OpenCLIP ViT-bigG with its projection (text_encoder_2)
    conditioner.embedders.0.model.*        SDXL refiner: OpenCLIP ViT-bigG alone (text_encoder_2)

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
from types import SimpleNamespace

import numpy as np

__all__ = ["SingleFileError", "detect_version", "split_components", "bundled_config_folder"]

# Per version: file prefix -> component. Text encoders under `.transformer.` carry transformers' names, those
# under `.model.` OpenCLIP's.
MODELS = {"model.diffusion_model.": "unet", "first_stage_model.": "vae"}
LAYOUTS = {
    "sd1": {**MODELS, "cond_stage_model.transformer.": "text_encoder"},
    "sd2": {**MODELS, "cond_stage_model.model.": "text_encoder"},
    "sdxl": {**MODELS, "conditioner.embedders.0.transformer.": "text_encoder",
             "conditioner.embedders.1.model.": "text_encoder_2"},
    "sdxl_refiner": {**MODELS, "conditioner.embedders.0.model.": "text_encoder_2"},
}
NAMES = {"sd1": "an SD 1.x", "sd2": "an SD 2.x", "sdxl": "an SDXL base", "sdxl_refiner": "an SDXL refiner"}
PIPELINES = {"sd1": "StableDiffusion", "sd2": "StableDiffusion", "sdxl": "StableDiffusionXL",
             "sdxl_refiner": "StableDiffusionXLImg2Img"}
# model_index.json entries a file's parts come with when no pipeline class names its own
INDEX_OPTIONS = ("force_zeros_for_empty_prompt", "requires_aesthetics_score")

# Tensors every such file carries and no pipeline uses: skipped without a word.
UNUSED = re.compile(
    r"^(betas|alphas_cumprod|alphas_cumprod_prev|sqrt_alphas_cumprod|sqrt_one_minus_alphas_cumprod"
    r"|log_one_minus_alphas_cumprod|sqrt_recip_alphas_cumprod|sqrt_recipm1_alphas_cumprod|posterior_variance"
    r"|posterior_log_variance_clipped|posterior_mean_coef1|posterior_mean_coef2|logvar|lvlb_weights)$"  # DDPM buffers
    r"|^denoiser\.(sigmas|log_sigmas)$"  # SGM's noise schedule
    # OpenCLIP's contrastive head (SDXL's second text encoder keeps the projection, SD 2.x's has none)
    r"|^cond_stage_model\.model\.text_projection$|^(cond_stage_model|conditioner\.embedders\.\d)\.model\.logit_scale$"
)
# Tensors some files carry that the pipeline does not use: a warning lists them (the EMA weights may be wanted).
KNOWN_EXTRAS = re.compile(r"^model_ema\.|^first_stage_model\.loss\.")

DEFAULTS = {"sd1": "stable-diffusion-v1-5", "sd2": "stable-diffusion-2-1 (768 px, v-prediction)",
            "sdxl": "stable-diffusion-xl-base-1.0", "sdxl_refiner": "stable-diffusion-xl-refiner-1.0"}

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
# OpenCLIP projects with `x @ text_projection` (width, proj); transformers' Linear holds the transpose.
OPENCLIP_PROJECTION = re.compile(r"\.model\.text_projection$")


class SingleFileError(ValueError):
    """The file is not a single-file SD 1.x / 2.x / SDXL checkpoint, or holds tensors no table maps."""


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
    """'sd1' (CLIP ViT-L text encoder), 'sd2' (OpenCLIP ViT-H), 'sdxl' (CLIP ViT-L and OpenCLIP ViT-bigG) or
    'sdxl_refiner' (OpenCLIP ViT-bigG alone) from the tensor names."""
    keys = list(keys)
    if not any(k.startswith("model.diffusion_model.") for k in keys):
        sample = ", ".join(sorted(keys)[:5])
        raise SingleFileError(f"not a single-file Stable Diffusion checkpoint: no model.diffusion_model.* tensors "
                              f"(found {sample}{' ...' if len(keys) > 5 else ''}); a diffusers folder loads with "
                              "StableDiffusion.from_pretrained")
    encoders = {m[0] for k in keys if (m := re.match(r"(cond_stage_model|conditioner\.embedders\.\d+)\.\w+\.", k))}
    for version, layout in LAYOUTS.items():
        if encoders == {prefix for prefix in layout if prefix not in MODELS}:
            return version
    found = _listing(prefix + "*" for prefix in encoders)
    if any(k.startswith("conditioner.") for k in encoders):
        raise SingleFileError("an SDXL checkpoint needs CLIP ViT-L (conditioner.embedders.0.transformer.*) and "
                              "OpenCLIP ViT-bigG (conditioner.embedders.1.model.*), or for a refiner OpenCLIP ViT-bigG "
                              f"alone (conditioner.embedders.0.model.*); this file has {found}")
    if encoders:
        raise SingleFileError(f"the checkpoint's text encoders ({found}) are not one SD 1.x "
                              "(cond_stage_model.transformer.*) or SD 2.x (cond_stage_model.model.*) encoder")
    raise SingleFileError("the checkpoint has a UNet but no text encoder (cond_stage_model.transformer.* for "
                          "SD 1.x, cond_stage_model.model.* for SD 2.x, conditioner.embedders.* for SDXL)")


def split_components(state_dict: dict, configs: dict, version: str) -> dict[str, dict[str, np.ndarray]]:
    """{component: {diffusers name: array}} for the components of `version`'s layout (`LAYOUTS`).

    `configs` holds the models' configs (UNetConfig, VAEConfig, CLIPTextConfig). Keys no table maps are an error
    that lists them, known extras (EMA weights, the VAE's loss) a warning; the parts of the format that no
    pipeline uses (DDPM buffers, OpenCLIP's contrastive head and SD 2.x's layer after the penultimate) are skipped.
    """
    layout = LAYOUTS[version]
    tables = {"unet": unet_table(configs["unet"]), "vae": vae_table(configs["vae"])}
    for prefix, component in layout.items():
        if prefix.endswith(".transformer."):
            tables[component] = clip_table(configs[component])
        elif prefix.endswith(".model."):  # SDXL's second encoder is a CLIPTextModelWithProjection
            tables[component] = openclip_table(configs[component], projection=component == "text_encoder_2")
    # SD 2.x conditions on OpenCLIP's penultimate layer: the layers after it are in the file but unused.
    unused_layers = re.compile(r"^cond_stage_model\.model\.transformer\.resblocks\.(\d+)\.")
    out = {name: {} for name in tables}
    extras, unknown = [], []
    for key, array in state_dict.items():
        prefix = next((p for p in layout if key.startswith(p)), None)
        names = None
        if prefix is not None:
            component = layout[prefix]
            names = map_key(key[len(prefix):], tables[component])
        if names is None:
            layer = unused_layers.match(key)
            if KNOWN_EXTRAS.search(key):
                extras.append(key)
            elif not (UNUSED.search(key) or (version == "sd2" and layer and
                                             int(layer.group(1)) >= configs["text_encoder"].num_hidden_layers)):
                unknown.append(key)
            continue
        if OPENCLIP_PROJECTION.search(key):
            array = np.asarray(array).T
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
    """The package's default configs for 'sd1' (stable-diffusion-v1-5), 'sd2' (stable-diffusion-2-1), 'sdxl'
    (stable-diffusion-xl-base-1.0) or 'sdxl_refiner' (stable-diffusion-xl-refiner-1.0)."""
    return os.fspath(resources.files("sdflax") / "configs" / version)


def bundled_tokenizer(version: str, name: str = "tokenizer"):
    from .loading import load_tokenizer

    folder = os.fspath(resources.files("sdflax") / "configs" / "tokenizer")
    # The same BPE vocabulary; OpenCLIP encoders (SD 2.x's, SDXL's second) pad with "!" (id 0) where CLIP ViT-L
    # pads with <|endoftext|>.
    openclip = version == "sd2" or name == "tokenizer_2"
    return load_tokenizer(folder, **({"pad_token": "!"} if openclip else {}))


def file_contents(version: str):
    """What a file of `version` holds, in a pipeline family's terms: models {folder: class}, tokenizer folders
    and the model_index.json options its parts come with."""
    from .models.clip import CLIPTextModel, CLIPTextModelWithProjection
    from .models.unet import UNet2DConditionModel
    from .models.vae import AutoencoderKL

    classes = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection,
               "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    models = {c: classes[c] for c in sorted(LAYOUTS[version].values())}
    tokenizers = tuple(name.replace("text_encoder", "tokenizer") for name in models if name.startswith("text_"))
    return SimpleNamespace(models=models, tokenizers=tokenizers, index_options=INDEX_OPTIONS)


def load_single_file(path, config=None, dtype=None, prediction_type=None, scheduler=None, scheduler_config=None,
                     attention="auto", revision=None, family=None, pipeline=None):
    """(a pipeline's constructor arguments, params) from a .safetensors / .ckpt file; see
    `StableDiffusion.from_single_file`. `family` (a pipeline's conditioning: `models`, `tokenizers`,
    `index_options`) must hold the models the file does, else the error names `pipeline`'s right sibling;
    without it the parts are what the file holds (an SDXL refiner's: no first text encoder)."""
    import jax.numpy as jnp

    from .checkpoint_files import read_checkpoint
    from .loading import build_models, check_pipeline_folder, load_scheduler, load_tokenizer, read_index
    from .models.config import read_config_file
    from .weights import CheckpointMismatchError, convert_state_dict

    dtype = jnp.float32 if dtype is None else dtype
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"no checkpoint file at {name}")
    where = os.path.basename(name)
    state_dict = read_checkpoint(name)
    version = detect_version(state_dict)
    contents = file_contents(version)
    family = family or contents
    absent = set(family.models) - set(contents.models)  # a refiner's first text encoder, if the family allows
    if absent - set(getattr(family, "optional", ())) or set(contents.models) - set(family.models):
        raise SingleFileError(f"{where} is {NAMES[version]} checkpoint ({', '.join(contents.models)}), not one "
                              f"{pipeline or 'this pipeline'} runs: use {PIPELINES[version]}.from_single_file")
    family = SimpleNamespace(models={c: family.models[c] for c in contents.models},
                             tokenizers=tuple(t for t in family.tokenizers if t in contents.tokenizers),
                             index_options=family.index_options)

    if config is not None:
        from .hub import resolve_folder

        folder = resolve_folder(config, revision, allow_patterns=["model_index.json", "*/config.json", "scheduler/*",
                                                                  *(f"{t}/*" for t in family.tokenizers)])
        check_pipeline_folder(folder, f"config={config}", tuple(family.models), family.tokenizers)
        tokenizers = {t: load_tokenizer(os.path.join(folder, t)) for t in family.tokenizers}
    else:
        folder = bundled_config_folder(version)
        tokenizers = {t: bundled_tokenizer(version, t) for t in family.tokenizers}
    model_configs = {c: read_config_file(os.path.join(folder, c, "config.json")) for c in family.models}
    overrides = dict(scheduler_config or {})
    if prediction_type is not None:
        overrides["prediction_type"] = prediction_type
        if config is None and version == "sd2" and prediction_type == "epsilon":
            model_configs["unet"]["sample_size"] = 64  # SD 2.x base: 512 px
    scheduler = load_scheduler(folder, scheduler, overrides or None)
    index = read_index(folder)

    modules = build_models(family.models, model_configs, dtype, attention)
    try:
        components = split_components(state_dict, {c: m.config for c, m in modules.items()}, version)
        params = {c: convert_state_dict(components[c], m.param_shapes(), dtype, where=f"{where} ({c})")
                  for c, m in modules.items()}
    except (SingleFileError, CheckpointMismatchError) as e:
        source = f"the configs in {config}" if config is not None else (
            f"sdflax's bundled {DEFAULTS[version]} configs")
        raise SingleFileError(f"{e}; the model configs came from {source}: for another architecture pass "
                              "config=<a diffusers folder or hub id of the same model>") from None
    options = {key: index[key] for key in family.index_options if key in index}
    nothing = {c: None for c in absent} | {c.replace("text_encoder", "tokenizer"): None for c in absent}
    return {**nothing, **tokenizers, **options, "scheduler": scheduler, "dtype": dtype, **modules}, params


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
