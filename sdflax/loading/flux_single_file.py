"""Black Forest Labs' FLUX.1 single files -> the params a diffusers folder's transformer gives: the transformer
alone (`load_flux_single_file`), or a pipeline's parts through `single_file.read_single_file` with the `FluxFiles`
layout, the transformer from the file and the rest (text encoders, VAE, tokenizers, scheduler) from `config`, a
diffusers FLUX.1 folder or hub id. Names and config: `flux_names.py`."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp

from .assemble import assemble
from .flux_names import flux_config, is_flux_file, pipeline_name, split_flux, without_prefix
from .single_file import Contents, SingleFileError, configs_named, read_file
from .weights import short_list
from ..models.flux import FluxTransformer2DModel

__all__ = ["FluxFiles", "load_flux_single_file"]


class FluxFiles:
    """FLUX.1 transformer files in BFL's layout (or ComfyUI's, under `model.diffusion_model.`): the transformer's
    config from the tensors' shapes, the other parts and their configs from `config`; sdflax bundles none."""

    @staticmethod
    def pipeline_name(state_dict) -> str | None:
        """"FluxPipeline", "FluxFillPipeline" or "FluxControlPipeline" (`flux_names.PIPELINES`); None for a file of
        another layout."""
        return pipeline_name(state_dict)

    @staticmethod
    def contents(where, state_dict, family, pipeline, left_out):
        state_dict = without_prefix(state_dict)
        if not is_flux_file(state_dict):
            raise SingleFileError(f"{where} is not a FLUX.1 transformer in Black Forest Labs' layout (no "
                                  f"double_blocks.0.img_attn.norm.key_norm.scale; found {short_list(state_dict, 4)})")
        family = family or SimpleNamespace(models={"transformer": FluxTransformer2DModel}, index_options=())
        models = {c: cls for c, cls in family.models.items() if c not in left_out}
        return Contents(state_dict, pipeline_name(state_dict), models, {"transformer"}, family)

    @staticmethod
    def with_config(folder, config, found, models):
        return models

    @staticmethod
    def bundled(where, found, models):
        raise SingleFileError(f"{where} holds a FLUX.1 transformer alone: pass config=<a diffusers FLUX.1 folder or "
                              "hub id, e.g. black-forest-labs/FLUX.1-dev> for its text encoders, VAE, tokenizers and "
                              "scheduler")

    @staticmethod
    def config_changes(found, model_configs, bundled, prediction_type):
        # the file's own shapes (Fill's 384 input channels, schnell's missing guidance embedder) over the folder's
        model_configs["transformer"].update(flux_config(found.state_dict, "the file"))

    @staticmethod
    def split(found, configs):
        split, unknown = split_flux(found.state_dict, configs["transformer"])
        if unknown:
            raise SingleFileError(f"{len(unknown)} tensors that no table maps (is this a FLUX.1 transformer?): "
                                  f"{short_list(unknown)}")
        return {"transformer": split}


def load_flux_single_file(path, config: dict | None = None, dtype=None, attention="auto"):
    """(FluxTransformer2DModel, params) from a FLUX.1 transformer file in BFL's layout (flux1-dev.safetensors,
    flux1-schnell.safetensors, or ComfyUI's copies under `model.diffusion_model.`): the params
    `FluxTransformer2DModel.from_pretrained` gives for the same weights. Its config comes from the tensors' shapes;
    `config` (config.json fields) gives what they do not tell, axes_dims_rope ((16, 56, 56) without it)."""
    dtype = jnp.float32 if dtype is None else dtype
    where, state_dict = read_file(path, "FLUX.1 transformer")
    found = FluxFiles.contents(where, state_dict, None, None, ())
    with configs_named("; the transformer's config came from the file's shapes"):
        model_config = {**(config or {}), **flux_config(found.state_dict, where)}
        modules, params, _ = assemble({"transformer": FluxTransformer2DModel}, {"transformer": model_config},
                                      lambda _, models: (where, FluxFiles.split(found, {
                                          "transformer": models["transformer"].config})["transformer"]),
                                      dtype, attention)
    return modules["transformer"], params["transformer"]
