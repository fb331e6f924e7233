"""A pipeline's checkpoint -> (its constructor's components, params, the scheduler config a scheduler name is built
from): `load(family, source)`, one way in for a diffusers folder, a hub id or a single file, whatever the family;
the family's text piece says which models and tokenizers it has, its single-file layout how a file's tensors are
named. `PipelineLoaders` gives every pipeline its loading calls, as diffusers' loader mixins do."""

from __future__ import annotations

import copy
import os

import jax.numpy as jnp

from ..models.config import read_config_file


class PipelineLoaders:
    """The loading calls of `sdflax.pipeline.core.Pipeline`: checkpoints -> (pipeline, params), and LoRAs and
    embeddings into params. Pure: a pipeline and its params are never changed in place."""

    @classmethod
    def from_pretrained(cls, path_or_repo_id, revision=None, dtype=jnp.float32, scheduler=None,
                        scheduler_config=None, variant=None, attention="auto", **components):
        """(pipeline, params) from a diffusers checkpoint folder or hub id; `scheduler="ddim"` swaps the kind,
        `scheduler_config={...}` single values; other components are passed on (`controlnet=`)."""
        parts, params, base = load(cls.family, path_or_repo_id, single_file=False, revision=revision, dtype=dtype,
                                   scheduler=scheduler, scheduler_config=scheduler_config, variant=variant,
                                   attention=attention, given=components, pipeline=cls.__name__)
        return cls.made_from(parts, components, base), params

    @classmethod
    def from_single_file(cls, path, config=None, dtype=jnp.float32, prediction_type=None, scheduler=None,
                         scheduler_config=None, attention="auto", revision=None, **components):
        """(pipeline, params) from one .safetensors / .ckpt file in the CompVis / A1111 or SGM layout (SD 3.x:
        Stability's); configs from `config` or bundled defaults (docs/checkpoints.md); other components are passed
        on (`text_encoder_3=None`: SD 3 without T5)."""
        parts, params, base = load(cls.family, path, single_file=True, config=config, dtype=dtype,
                                   prediction_type=prediction_type, scheduler=scheduler,
                                   scheduler_config=scheduler_config, attention=attention, revision=revision,
                                   given=components, pipeline=cls.__name__)
        return cls.made_from(parts, components, base), params

    @classmethod
    def made_from(cls, parts, components, scheduler_base_config):
        pipeline = cls(**{**parts, **components})
        pipeline.scheduler_base_config = scheduler_base_config
        return pipeline

    def load_lora(self, params, path, scale=1.0):
        """params with a LoRA file (kohya/A1111 or diffusers/PEFT) merged into the UNet and text encoder(s); Flux.1's
        transformer, CLIP and T5 also from XLabs' and Black Forest Labs' names (`sdflax.loading.flux_lora`), SD 3.x's
        MMDiT, CLIP-L, CLIP-G and T5 also from Stability's names (`sdflax.loading.sd3_lora`). Pure: LoRAs stack by
        calling it again (`sdflax.loading.lora.merge_lora` merges under jit with a traced `scale`)."""
        if self.family.name == "flux":
            from .flux_lora import load_flux_lora

            return load_flux_lora(params, path, scale)
        if self.family.name == "sd3":
            from .sd3_lora import load_sd3_lora

            return load_sd3_lora(params, path, scale)
        from .lora import load_lora

        self.unet_only("LoRAs", ", Flux.1 and SD 3.x")
        return load_lora(params, path, scale, self.unet.config)

    def load_textual_inversion(self, params, path, token=None):
        """(pipeline, params) with a textual-inversion embedding added (A1111 .pt/.safetensors, diffusers
        learned_embeds; SDXL's clip_l + clip_g): a new pipeline whose tokenizer(s) know the token. Pure."""
        from .embeddings import load_textual_inversion

        self.unet_only("textual-inversion embeddings")
        parts, params = load_textual_inversion(self.components(), params, path, token)
        return self.replace(**parts), params

    def load_ip_adapter(self, params, pretrained_model_name_or_path, subfolder=None, weight_name=None,
                        image_encoder_folder="image_encoder", revision=None,
                        image_encoder_pretrained_model_name_or_path=None):
        """(pipeline, params) with IP-Adapters (h94's files for UNets, XLabs' for Flux.1, InstantX's for SD 3.5
        Large, as diffusers' `load_ip_adapter`: a hub id or folder, its `subfolder` (None: h94's "models", the repository's top for
        Flux) and `weight_name`, a list of names for several adapters) and their CLIP image encoder
        (`image_encoder_folder`: a name under `subfolder`, or with a "/" a folder of the repository's own, as
        diffusers; `image_encoder_pretrained_model_name_or_path`: a folder or hub id of its own, as diffusers'
        Flux takes it; None for both: only `ip_adapter_image_embeds` are given). Pure: this pipeline and params are
        unchanged."""
        from .ip_adapter import read_ip_adapters

        make = getattr(self.text, "ip_adapter_piece", None)  # a transformer family's own
        if make is None:
            self.unet_only("IP-Adapters", ", Flux.1 and SD 3.5 Large")
            make = self.ip_adapter_piece
        default_subfolder = "models" if self.denoiser.component == "unet" else ""
        files = read_ip_adapters(pretrained_model_name_or_path, default_subfolder if subfolder is None else subfolder,
                                 weight_name, image_encoder_folder, revision, self.dtype,
                                 getattr(self.text, "ip_adapter_reader", None),
                                 image_encoder_pretrained_model_name_or_path,
                                 getattr(self.text, "ip_adapter_encoder", None))
        piece, added = make(getattr(self, self.denoiser.component), self.dtype, *files)
        view = copy.copy(self)
        view.ip_adapter, view._spec = piece, None
        return view, {**params, **added}

    def unet_only(self, what, also=""):
        if self.denoiser.component != "unet":
            raise ValueError(f"{type(self).__name__}: {what} are for UNet checkpoints (SD 1.x, 2.x, SDXL){also}; "
                             f"{self.family.title}'s are not supported yet")


SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")


def load(family, source, *, single_file=None, revision=None, dtype=jnp.float32, scheduler=None, scheduler_config=None,
         variant=None, config=None, prediction_type=None, attention="auto", given=None, pipeline=None):
    """(components, params, scheduler config) of a checkpoint of `family` (a `sdflax.families.Family`): a diffusers
    folder or hub id, or one .safetensors / .ckpt file in its family's layout (`single_file`: None tells them apart
    by the path), its configs from `config` or bundled ones. `scheduler` names a kind, `scheduler_config` overrides
    single values; `given`: the components the caller passes (an optional encoder given as None is not loaded, nor
    its tokenizer: SD 3 without T5); `pipeline`: the class named in messages."""
    given, pipeline = given or {}, pipeline or family.title
    if single_file is None:
        path = os.path.expanduser(str(source))
        single_file = os.path.isfile(path) and path.lower().endswith(SINGLE_FILE_SUFFIXES)
    if single_file:
        if variant is not None:
            raise ValueError(f"variant={variant!r} names a diffusers folder's weight files; {source} is one file")
        return load_file(family, pipeline, source, config, dtype, prediction_type, scheduler, scheduler_config,
                         attention, revision, given)
    for name, value in (("config", config), ("prediction_type", prediction_type)):
        if value is not None:
            raise ValueError(f"{name}={value!r} applies to single files; {source} is a diffusers folder or hub id, "
                             "whose own configs say it: drop it")
    return load_folder(family.text, source, revision, dtype, scheduler, scheduler_config, variant, attention, given)


def load_folder(text, path_or_repo_id, revision, dtype, scheduler, scheduler_config, variant, attention, given):
    """`Pipeline.from_pretrained`'s work; `given`: the components the caller passes (an optional encoder given as
    None is not loaded, nor its tokenizer: SD 3 without T5)."""
    from .folders import load_pipeline

    left_out = {name for name in text.optional if name in given and given[name] is None}
    left_out |= {name.replace("text_encoder", "tokenizer") for name in left_out}
    parts, params = load_pipeline(path_or_repo_id, {k: v for k, v in text.models.items() if k not in left_out},
                                  tuple(t for t in text.tokenizers if t not in left_out), text.index_options, revision,
                                  dtype, scheduler, scheduler_config, variant, attention, text.optional,
                                  text.tokenizer_loaders)
    return parts, params, with_overrides(read_scheduler_config(path_or_repo_id, revision), scheduler_config)


def load_file(family, pipeline, path, config, dtype, prediction_type, scheduler, scheduler_config, attention,
              revision, given):
    """`Pipeline.from_single_file`'s work, by the layout its family names (`Family.single_file`, "module:name":
    `sdflax.loading.single_file`'s UNetFiles for CompVis / A1111 / SGM files, MMDiTFiles for Stability's SD 3.x)."""
    from .single_file import layout_of, read_single_file

    if family.single_file is None:
        raise ValueError(f"{pipeline}: {family.title} checkpoints load from diffusers folders (from_pretrained), "
                         "not single files")
    if prediction_type is not None and family.flow:
        raise ValueError(f"prediction_type={prediction_type!r}: {pipeline}'s transformer predicts a flow's "
                         "velocity; prediction_type is for UNet checkpoints")
    layout = layout_of(family.single_file)
    left_out = tuple(name for name in family.text.optional if name.startswith("text_encoder") and
                     name in given and given[name] is None)
    parts, params, folder = read_single_file(layout, path, config, dtype, prediction_type, scheduler,
                                             scheduler_config, attention, revision, family.text, pipeline, left_out)
    overrides = {**(scheduler_config or {}), **({"prediction_type": prediction_type} if prediction_type else {})}
    return parts, params, with_overrides(read_scheduler_config(folder, revision), overrides)


def read_scheduler_config(folder_or_repo, revision=None) -> dict | None:
    """A checkpoint's scheduler/scheduler_config.json from a local folder or, for a hub id, the Hugging Face cache
    (the loader has just fetched it: nothing is downloaded); None where it is not there."""
    path = os.path.join(os.path.expanduser(str(folder_or_repo)), "scheduler", "scheduler_config.json")
    if not os.path.isfile(path):
        from huggingface_hub import try_to_load_from_cache

        try:
            path = try_to_load_from_cache(str(folder_or_repo), "scheduler/scheduler_config.json", revision=revision)
        except ValueError:  # not a hub id
            return None
    return read_config_file(path) if isinstance(path, str) and os.path.isfile(path) else None


def with_overrides(config: dict | None, overrides) -> dict | None:
    return None if config is None else {**config, **(overrides or {})}
