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

SD 3 / 3.5 files (Stability's layout: the MMDiT under `model.diffusion_model.joint_blocks.*`, the text encoders
under `text_encoders.*`) have their tables in `ldm_names.py` too. Both kinds are read by one function,
`read_single_file(layout, ...)`; a layout (`UNetFiles`, `MMDiTFiles`: a family names its own) says what a file
holds, which bundled configs fit it and how its tensors split by model.

ControlNets come as files of their own in lllyasviel's layout (`load_controlnet`): the UNet encoder's names,
`zero_convs.*`, `middle_block_out.*` and `input_hint_block.*`, under `control_model.` in ControlNet 1.0 files.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import warnings
from importlib import resources
from types import SimpleNamespace
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from .assemble import assemble
from .files import read_checkpoint
from .hub import resolve_folder
from .ldm_names import (SD3_BUNDLED, SD3_NAMES, SD3_PARTS, SD3_TRANSFORMER_CHANGES, clip_table, controlnet_table,
                        fused_parts, is_sd3_file, map_key, openclip_table, sd3_components_in, sd3_model_type,
                        sd3_with_prefixes, split_sd3, unet_table, vae_table)
from .flux_names import is_flux_file
from .folders import check_pipeline_folder, checkpoint_files, is_null, load_scheduler, load_tokenizer, read_index
from ..models.clip import CLIPTextModel, CLIPTextModelWithProjection
from ..models.config import read_config_file
from ..models.mmdit import SD3Transformer2DModel
from ..models.t5 import T5EncoderModel
from ..models.unet import UNet2DConditionModel
from ..models.vae import AutoencoderKL
from .tokenizers import T5Tokenizer
from .weights import CheckpointMismatchError, read_weights, short_list, weight_files

__all__ = ["SingleFileError", "detect_version", "split_components", "bundled_config_folder", "load_sd3_single_file"]

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

# OpenCLIP projects with `x @ text_projection` (width, proj); transformers' Linear holds the transpose.
OPENCLIP_PROJECTION = re.compile(r"\.model\.text_projection$")


class SingleFileError(ValueError):
    """The file is not a single-file SD 1.x / 2.x / SDXL checkpoint, or holds tensors no table maps."""


def layout_of(name: str):
    """The single-file layout a family names ("module:name", `Family.single_file`): UNetFiles, MMDiTFiles, or a
    user's own with the same methods."""
    module, attribute = name.split(":")
    return getattr(importlib.import_module(module), attribute)


def not_a_single_file(keys) -> SingleFileError:
    """The error for a file that no family's layout claims."""
    return SingleFileError(f"not a single-file Stable Diffusion checkpoint: no model.diffusion_model.* tensors "
                           f"(found {short_list(keys, 5)}); a diffusers folder loads with "
                           "StableDiffusion.from_pretrained")


def detect_version(keys) -> str:
    """'sd1' (CLIP ViT-L text encoder), 'sd2' (OpenCLIP ViT-H), 'sdxl' (CLIP ViT-L and OpenCLIP ViT-bigG) or
    'sdxl_refiner' (OpenCLIP ViT-bigG alone) from the tensor names."""
    keys = list(keys)
    if is_sd3_file(keys):
        raise SingleFileError("an SD 3 / 3.5 checkpoint (an MMDiT under model.diffusion_model.joint_blocks.*): load "
                              "it with StableDiffusion3.from_single_file")
    if is_flux_file(keys):
        raise SingleFileError("a FLUX.1 transformer (double_blocks.*, single_blocks.*): load it with "
                              "sdflax.loading.flux_single_file.load_flux_single_file")
    if not any(k.startswith("model.diffusion_model.") for k in keys):
        raise not_a_single_file(keys)
    encoders = {m[0] for k in keys if (m := re.match(r"(cond_stage_model|conditioner\.embedders\.\d+)\.\w+\.", k))}
    for version, layout in LAYOUTS.items():
        if encoders == {prefix for prefix in layout if prefix not in MODELS}:
            return version
    found = short_list(prefix + "*" for prefix in encoders)
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
        for name, part in zip(names, fused_parts(key, array, names)):
            out[component][name] = part
    if unknown:
        raise SingleFileError(f"{len(unknown)} tensors that no table maps (is the config right for this file?): "
                              f"{short_list(unknown)}")
    if extras:
        warnings.warn(f"ignoring {len(extras)} tensors the pipeline does not use: {short_list(extras, 6)}",
                      stacklevel=6)  # from_single_file's caller, past load_single_file, assemble and its `tensors`
    return out


def bundled_config_folder(version: str) -> str:
    """The package's default configs for 'sd1' (stable-diffusion-v1-5), 'sd2' (stable-diffusion-2-1), 'sdxl'
    (stable-diffusion-xl-base-1.0) or 'sdxl_refiner' (stable-diffusion-xl-refiner-1.0)."""
    return os.fspath(resources.files("sdflax") / "configs" / version)


def bundled_tokenizer(version: str, name: str = "tokenizer"):
    folder = os.fspath(resources.files("sdflax") / "configs" / "tokenizer")
    # The same BPE vocabulary; OpenCLIP encoders (SD 2.x's, SDXL's second) pad with "!" (id 0) where CLIP ViT-L
    # pads with <|endoftext|>.
    openclip = version == "sd2" or name == "tokenizer_2"
    return load_tokenizer(folder, **({"pad_token": "!"} if openclip else {}))


def file_contents(version: str):
    """What a file of `version` holds, in a pipeline family's terms: models {folder: class}, tokenizer folders
    and the model_index.json options its parts come with."""
    classes = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection,
               "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    models = {c: classes[c] for c in sorted(LAYOUTS[version].values())}
    tokenizers = tuple(name.replace("text_encoder", "tokenizer") for name in models if name.startswith("text_"))
    return SimpleNamespace(models=models, tokenizers=tokenizers, index_options=INDEX_OPTIONS)


class UNetFiles:
    """CompVis / A1111 / SGM files: SD 1.x, 2.x and SDXL, every part in the file, their configs bundled per
    version (`LAYOUTS`)."""

    @staticmethod
    def pipeline_name(state_dict) -> str | None:
        """The diffusers pipeline class the file is, as a folder's model_index.json names it; None for a file of
        another layout."""
        keys = list(state_dict)
        if is_sd3_file(keys) or is_flux_file(keys) or not any(
                k.startswith("model.diffusion_model.") for k in keys):
            return None
        return f"{PIPELINES[detect_version(keys)]}Pipeline"

    @staticmethod
    def contents(where, state_dict, family, pipeline, left_out):
        version = detect_version(state_dict)
        contents = file_contents(version)
        family = family or contents
        absent = set(family.models) - set(contents.models)  # a refiner's first text encoder, if the family allows
        if absent - set(getattr(family, "optional", ())) or set(contents.models) - set(family.models):
            raise SingleFileError(f"{where} is {NAMES[version]} checkpoint ({', '.join(contents.models)}), not one "
                                  f"{pipeline or 'this pipeline'} runs: use {PIPELINES[version]}.from_single_file")
        models = {c: family.models[c] for c in contents.models}
        return Contents(state_dict, version, models, set(models), family)

    @staticmethod
    def with_config(folder, config, found, models):
        return models

    @staticmethod
    def bundled(where, found, models):
        """(models, config folder, {tokenizer: builder}, what the configs are) of sdflax's bundled configs."""
        tokenizers = {t: functools.partial(bundled_tokenizer, found.version, t) for t in tokenizers_of(models)}
        return models, bundled_config_folder(found.version), tokenizers, f"sdflax's bundled {DEFAULTS[found.version]}"

    @staticmethod
    def config_changes(found, model_configs, bundled, prediction_type):
        if bundled and found.version == "sd2" and prediction_type == "epsilon":
            model_configs["unet"]["sample_size"] = 64  # SD 2.x base: 512 px

    @staticmethod
    def split(found, configs):
        return split_components(found.state_dict, configs, found.version)


class MMDiTFiles:
    """Stability's SD 3 / 3.5 files: the MMDiT under `model.diffusion_model.joint_blocks.*`, the text encoders and
    VAE there too or (with `config`) from a diffusers folder; configs bundled per MMDiT size."""

    @staticmethod
    def pipeline_name(state_dict) -> str | None:
        return "StableDiffusion3Pipeline" if is_sd3_file(sd3_with_prefixes(state_dict)) else None

    @staticmethod
    def contents(where, state_dict, family, pipeline, left_out):
        state_dict = sd3_with_prefixes(state_dict)
        if not is_sd3_file(state_dict):
            other = "an SD 1.x / 2.x / SDXL file loads with StableDiffusion(XL).from_single_file" if any(
                k.startswith("model.diffusion_model.") for k in state_dict) else "a diffusers folder loads with " \
                "StableDiffusion3.from_pretrained"
            raise SingleFileError(f"{where} is not an SD 3 / 3.5 checkpoint in Stability's layout (no "
                                  f"model.diffusion_model.joint_blocks.* tensors; found {short_list(state_dict, 4)}): "
                                  f"{other}")
        if set(left_out) - {"text_encoder_3"}:
            raise ValueError(f"only text_encoder_3 (T5) may be left out of an SD 3 pipeline, not {short_list(left_out)}")
        family = family or SimpleNamespace(models=SD3_MODELS, index_options=())
        models = {c: cls for c, cls in family.models.items() if c not in left_out}
        return Contents(state_dict, sd3_model_type(state_dict), models, sd3_components_in(state_dict) - set(left_out),
                        family)

    @staticmethod
    def with_config(folder, config, found, models):
        index = read_index(folder)
        if "text_encoder_3" not in found.in_file and (is_null(index, "text_encoder_3") or
                                                      "text_encoder_3" not in index):
            models = {c: cls for c, cls in models.items() if c != "text_encoder_3"}  # neither file nor folder has T5
        if "text_encoder_3" in models and not os.path.isfile(os.path.join(folder, "tokenizer_3", "tokenizer.json")):
            raise SingleFileError(f"config={config} has no tokenizer_3/tokenizer.json for T5: {T5_ADVICE}")
        return models

    @staticmethod
    def bundled(where, found, models):
        if missing := [SD3_PARTS[c] for c in ("text_encoder", "text_encoder_2", "vae") if c not in found.in_file]:
            raise SingleFileError(f"{where} holds no {', '.join(missing)}: pass config=<a diffusers SD 3 folder or "
                                  "hub id, e.g. stabilityai/stable-diffusion-3.5-medium> to load it from there")
        if found.version is None:
            raise SingleFileError(f"{where}: an MMDiT of a size sdflax bundles no configs for (SD 3 Medium, 3.5 "
                                  "Medium and Large): pass config=<a diffusers folder or hub id of the same model>")
        if "text_encoder_3" in found.in_file:
            raise SingleFileError(f"{where} holds T5 (text_encoders.t5xxl.*), but {T5_ADVICE}")
        models = {c: cls for c, cls in models.items() if c in found.in_file}
        tokenizers = {t: functools.partial(bundled_tokenizer, "sd3", t) for t in ("tokenizer", "tokenizer_2")}
        return models, bundled_config_folder(SD3_BUNDLED[found.version]), tokenizers, \
            f"sdflax's bundled {SD3_NAMES[found.version]}"

    @staticmethod
    def config_changes(found, model_configs, bundled, prediction_type):
        if bundled:
            model_configs["transformer"].update(SD3_TRANSFORMER_CHANGES.get(found.version, {}))

    @staticmethod
    def split(found, configs):
        split, unknown = split_sd3(found.state_dict, configs, found.in_file)
        if unknown:
            raise SingleFileError(f"{len(unknown)} tensors that no table maps (is the config right for this "
                                  f"file?): {short_list(unknown)}")
        return split


class Contents(NamedTuple):
    """What a single file holds, as its layout reads it."""

    state_dict: dict  # its tensors, under the layout's names
    version: str | None  # which bundled configs fit it
    models: dict  # {component: class} the pipeline gets
    in_file: set  # the components whose tensors the file holds (the others come from `config`)
    family: Any  # the pipeline's text piece (`models`, `tokenizers`, `index_options`), or the file's own parts


def tokenizers_of(models) -> tuple:
    return tuple(c.replace("text_encoder", "tokenizer") for c in models if c.startswith("text_encoder"))


def read_single_file(layout, path, config=None, dtype=None, prediction_type=None, scheduler=None,
                     scheduler_config=None, attention="auto", revision=None, family=None, pipeline=None, left_out=()):
    """(a pipeline's constructor arguments, params, the folder its configs came from) from one file in `layout`
    (`UNetFiles`, `MMDiTFiles`): configs and tokenizers from `config` (a diffusers folder or hub id, which also
    gives the parts the file lacks) or the bundled ones. `family` (a pipeline's text piece: `models`, `tokenizers`,
    `index_options`) must hold the models the file does, else the error names `pipeline`'s right sibling; without
    it the parts are what the file holds; `left_out`: components not to load."""
    dtype = jnp.float32 if dtype is None else dtype
    where, state_dict = read_file(path, "checkpoint")
    found = layout.contents(where, state_dict, family, pipeline, left_out)
    models = found.models
    if config is not None:
        folder = resolve_folder(config, revision, allow_patterns=checkpoint_files(
            None, tuple(models.keys() - found.in_file), tokenizers_of(models)))
        models = layout.with_config(folder, config, found, models)
        check_pipeline_folder(folder, f"config={config}", tuple(models), tokenizers_of(models),
                              tuple(TOKENIZER_LOADERS))
        for c in models.keys() - found.in_file:
            weight_files(os.path.join(folder, c))  # fail on a missing weights file before reading anything
        loaders = {**getattr(found.family, "tokenizer_loaders", {}), **TOKENIZER_LOADERS}
        tokenizers = {t: functools.partial(loaders.get(t, load_tokenizer), os.path.join(folder, t))
                      for t in tokenizers_of(models)}
        source = f"the configs in {config}"
    else:
        models, folder, tokenizers, source = layout.bundled(where, found, models)
        source += " configs"
    model_configs = {c: read_config_file(os.path.join(folder, c, "config.json")) for c in models}
    layout.config_changes(found, model_configs, config is None, prediction_type)
    overrides = {**(scheduler_config or {}), **({"prediction_type": prediction_type} if prediction_type else {})}
    scheduler = load_scheduler(folder, scheduler, overrides or None)
    index = read_index(folder)
    components = {}

    def tensors(component, modules):  # the file split by component once the models' configs are known
        if component not in found.in_file:
            return f"{config} ({component})", read_weights(os.path.join(folder, component))
        if not components:
            components.update(layout.split(found, {c: m.config for c, m in modules.items()}))
        return f"{where} ({component})", components[component]

    with configs_named(f"; the model configs came from {source}: for another architecture pass config=<a "
                       "diffusers folder or hub id of the same model>"):
        modules, params, tokenizers = assemble(models, model_configs, tensors, dtype, attention, tokenizers=tokenizers)
    options = {key: index[key] for key in found.family.index_options if key in index}
    absent = set(found.family.models) - set(models)
    nothing = {c: None for c in absent} | {t: None for t in tokenizers_of(sorted(absent))}
    return {**nothing, **tokenizers, **options, "scheduler": scheduler, "dtype": dtype, **modules}, params, folder


def load_single_file(path, config=None, dtype=None, prediction_type=None, scheduler=None, scheduler_config=None,
                     attention="auto", revision=None, family=None, pipeline=None):
    """(a pipeline's constructor arguments, params) from a CompVis / A1111 / SGM file: `read_single_file`."""
    return read_single_file(UNetFiles, path, config, dtype, prediction_type, scheduler, scheduler_config, attention,
                            revision, family, pipeline)[:2]


SD3_MODELS = {"text_encoder": CLIPTextModelWithProjection, "text_encoder_2": CLIPTextModelWithProjection,
              "text_encoder_3": T5EncoderModel, "transformer": SD3Transformer2DModel, "vae": AutoencoderKL}
TOKENIZER_LOADERS = {"tokenizer_3": T5Tokenizer.from_folder}  # SD 3's T5 (a file's own parts have no family)
T5_ADVICE = ("sdflax does not bundle T5's tokenizer: pass config=<a diffusers SD 3.5 folder or hub id with "
             "tokenizer_3/tokenizer.json, e.g. stabilityai/stable-diffusion-3.5-medium>, or text_encoder_3=None to "
             "load without T5")


def load_sd3_single_file(path, config=None, dtype=None, scheduler=None, scheduler_config=None, attention="auto",
                         revision=None, left_out=()):
    """(StableDiffusion3's constructor arguments, params) from an SD 3 / 3.5 file in Stability's layout (or its
    MMDiT alone). The models the file lacks come from `config` (a diffusers SD 3 folder or hub id), as do the
    configs and tokenizers; without it, sdflax's bundled SD 3.5 configs and CLIP tokenizer. T5 is None where
    neither the file nor `config` has it, or `left_out` names "text_encoder_3"."""
    return read_single_file(MMDiTFiles, path, config, dtype, None, scheduler, scheduler_config, attention, revision,
                            left_out=left_out)[:2]


def read_file(path, what) -> tuple[str, dict]:
    """(the file's name, its tensors) of a single-file checkpoint or ControlNet (`what`)."""
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"no {what} file at {name}")
    return os.path.basename(name), read_checkpoint(name)


@contextlib.contextmanager
def configs_named(advice: str):
    """Tensors that do not fit the models raise SingleFileError with `advice`: where the configs came from."""
    try:
        yield
    except (SingleFileError, CheckpointMismatchError) as e:
        raise SingleFileError(f"{e}{advice}") from None


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
    .safetensors, or a ControlNet 1.0 file under `control_model.`); `ControlNetModel.from_single_file`."""
    dtype = jnp.float32 if dtype is None else dtype
    where, state_dict = read_file(path, "ControlNet")
    if any(k.startswith(CONTROLNET_PREFIX) for k in state_dict):
        state_dict = {k[len(CONTROLNET_PREFIX):]: v for k, v in state_dict.items() if k.startswith(CONTROLNET_PREFIX)}
    if "input_hint_block.0.weight" not in state_dict or "time_embed.0.weight" not in state_dict:
        found = "diffusers names: use ControlNetModel.from_pretrained" if "conv_in.weight" in state_dict else (
            "a Stable Diffusion checkpoint: use StableDiffusion.from_single_file"
            if any(k.startswith("model.diffusion_model.") for k in state_dict) else "other tensors")
        raise SingleFileError(f"{where} is not a ControlNet in the original layout (no input_hint_block / "
                              f"time_embed tensors; found {found})")
    if config is not None:
        folder = resolve_folder(config, revision, allow_patterns=["config.json"])
        model_config = read_config_file(os.path.join(folder, "config.json"))
    else:
        model_config = controlnet_config(state_dict, where)

    def tensors(_, modules):
        table = controlnet_table(modules["controlnet"].config)
        named = {key: map_key(key, table) for key in state_dict}
        if unknown := [key for key, names in named.items() if names is None]:
            raise SingleFileError(f"{len(unknown)} tensors that no table maps: {short_list(unknown)}")
        return where, {names[0]: state_dict[key] for key, names in named.items()}

    source = f"the config in {config}" if config is not None else "the tensors and sdflax's bundled UNet configs"
    with configs_named(f"\nThe ControlNet config came from {source}: for another architecture pass config=<the "
                       "diffusers folder or hub id of a ControlNet of the same architecture>"):
        modules, params, _ = assemble({"controlnet": cls}, {"controlnet": model_config}, tensors, dtype, attention)
    return modules["controlnet"], params["controlnet"]
