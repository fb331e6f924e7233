"""A pipeline's checkpoint -> (its constructor's components, params, the scheduler config a scheduler name is built
from): one way in for a diffusers folder or hub id (`load_folder`) and for a single file (`load_file`), whatever
the family; the family's text piece says which models and tokenizers it has."""

from __future__ import annotations

import os

from ..models.config import read_config_file


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
    """`Pipeline.from_single_file`'s work, by the reader the family names (`Family.single_file`): "unet" for
    CompVis / A1111 / SGM files, "mmdit" for Stability's SD 3.x files."""
    from .single_file import mmdit_file, unet_file

    if family.single_file == "mmdit":
        if prediction_type is not None:
            raise ValueError(f"prediction_type={prediction_type!r}: {pipeline}'s transformer predicts a flow's "
                             "velocity; prediction_type is for UNet checkpoints")
        left_out = tuple(name for name in family.text.optional if name.startswith("text_encoder") and
                         name in given and given[name] is None)
        parts, params, folder = mmdit_file(path, config, dtype, scheduler, scheduler_config, attention, revision,
                                           left_out)
    elif family.single_file == "unet":
        parts, params, folder = unet_file(path, config, dtype, prediction_type, scheduler, scheduler_config,
                                          attention, revision, family=family.text, pipeline=pipeline)
    else:
        raise ValueError(f"{pipeline}: {family.title} checkpoints load from diffusers folders (from_pretrained), "
                         "not single files")
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
