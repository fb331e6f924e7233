"""Diffusers folders -> a pipeline's parts: which files of a checkpoint repo to fetch, the folder check (one for
the library and the CLI), tokenizers, the scheduler, and the models (`assemble.py`, the path single files take too).

Pipelines' and the models' own `from_pretrained` come through here; the models themselves never touch the hub or
the file system: their `from_pretrained` imports `load_model` from here when called.
"""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp

from .assemble import assemble
from .hub import ModelNotFoundError, resolve_folder
from ..models.config import ConfigError, read_config_file
from ..schedulers import scheduler_from_config
from .tokenizers import CLIPTokenizer
from .weights import read_weights, weight_files

COMPONENTS = ("text_encoder", "unet", "vae")  # an SD 1.x / 2.x pipeline's models
TOKENIZER_FILES = (("vocab.json", "merges.txt"), ("tokenizer.json",))  # SD 1.x hub layout, or transformers 5
T5_TOKENIZER_FILES = (("tokenizer.json",),)  # what `T5Tokenizer.from_folder` reads (SD 3's tokenizer_3)


def checkpoint_files(variant=None, components=COMPONENTS, tokenizers=("tokenizer",)):
    """Which files of a diffusers pipeline repo to download: configs, tokenizer, and one weight format."""
    v = f".{variant}" if variant else ""
    weights = [f"{c}/{stem}{v}{suffix}" for c in components for stem in ("diffusion_pytorch_model", "model")
               for suffix in (".safetensors", "-*.safetensors", ".safetensors.index*.json")]  # "-*": shards, not .fp16
    return ["model_index.json", "*/config.json", "scheduler/*", *(f"{t}/*" for t in tokenizers), *weights]


def model_files(subfolder=None, variant=None) -> list[str]:
    """Which files of a model repo to download: its config and one weight format (safetensors; PyTorch .bin or Flax
    msgpack where it has none, `OLDER_WEIGHTS`), not the TensorFlow, ONNX and other twins (openai/clip-vit-large-patch14
    holds four copies of its weights)."""
    v, p = f".{variant}" if variant else "", f"{subfolder}/" if subfolder else ""
    return [f"{p}config.json", *(f"{p}{stem}{v}{suffix}" for stem in ("diffusion_pytorch_model", "model")
                                 for suffix in (".safetensors", "-*.safetensors", ".safetensors.index*.json"))]


OLDER_WEIGHTS = ("*.bin", "*.bin.index*.json", "*.msgpack")


def read_index(folder) -> dict:
    """model_index.json of a pipeline folder, {} if it has none."""
    path = os.path.join(folder, "model_index.json")
    return read_config_file(path) if os.path.isfile(path) else {}


def is_null(index: dict, name: str) -> bool:
    """Whether model_index.json lists `name` as absent (`[null, null]`, as an SDXL refiner's text_encoder)."""
    entry = index.get(name, ())
    return entry is None or (isinstance(entry, list) and all(part is None for part in entry))


def missing_pipeline_files(folder, components=COMPONENTS, tokenizers=("tokenizer",), t5_tokenizers=()
                           ) -> list[str]:
    """The files a diffusers pipeline folder needs that `folder` lacks (weights excepted: `weights.py` names those);
    components that model_index.json lists as null need none. `t5_tokenizers`: those of `tokenizers` that are T5's
    (one tokenizer.json), not CLIP's."""
    index = read_index(folder)
    components = [c for c in components if not is_null(index, c)]
    tokenizers = [t for t in tokenizers if not is_null(index, t)]
    needed = ["model_index.json", *(f"{c}/config.json" for c in components), "scheduler/scheduler_config.json"]
    missing = [f for f in needed if not os.path.isfile(os.path.join(folder, f))]
    for name in tokenizers:
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            missing.append(f"{name}/ (no tokenizer folder at {path})")
        elif name in t5_tokenizers:
            if not any(all(os.path.isfile(os.path.join(path, f)) for f in files) for files in T5_TOKENIZER_FILES):
                missing.append(f"{name}/tokenizer.json (T5's tokenizer, as transformers saves it)")
        elif not any(all(os.path.isfile(os.path.join(path, f)) for f in files) for files in TOKENIZER_FILES):
            missing.append(f"{name}/vocab.json + merges.txt (or {name}/tokenizer.json)")
    return missing


def check_pipeline_folder(folder, name=None, components=COMPONENTS, tokenizers=("tokenizer",), t5_tokenizers=()
                          ) -> None:
    """Raise ModelNotFoundError naming the missing files if `folder` is not a diffusers pipeline checkpoint."""
    missing = missing_pipeline_files(folder, components, tokenizers, t5_tokenizers)
    if missing:
        raise ModelNotFoundError(f"{name or folder} is not a diffusers Stable Diffusion checkpoint: "
                                 f"missing {', '.join(missing)}")


def load_tokenizer(folder, **special_tokens):
    """CLIP's tokenizer (`sdflax.loading.tokenizers`) from `vocab.json` + `merges.txt` (SD 1.x hub repos) or `tokenizer.json`
    (transformers 5); `special_tokens` (e.g. `pad_token="!"`) override tokenizer_config.json's."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no tokenizer folder at {folder}")
    try:
        return CLIPTokenizer.from_folder(folder, **special_tokens)
    except Exception as e:  # the Rust tokenizers library raises bare Exceptions for damaged files
        detail = " ".join(str(e).split())[:200]
        raise ConfigError(f"{folder}: cannot build a CLIP tokenizer from its files ({type(e).__name__}: "
                          f"{detail})") from None


def load_scheduler(folder, kind=None, overrides=None):
    """The checkpoint's scheduler, another kind by name with the checkpoint's config, or a scheduler object."""
    if kind is not None and not isinstance(kind, str):
        if overrides:
            raise ValueError("scheduler_config applies to a scheduler given by name, not to a scheduler object")
        return kind
    path = os.path.join(folder, "scheduler", "scheduler_config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no scheduler/scheduler_config.json in {folder}")
    return scheduler_from_config(read_config_file(path), kind, overrides)


def load_model(cls, path_or_repo_id, subfolder=None, revision=None, dtype=jnp.float32, variant=None,
               attention="auto", kernels=None):
    """(module, params) of one model from a diffusers/transformers model folder or hub id; the models'
    `from_pretrained`."""
    files = model_files(subfolder, variant)
    root = resolve_folder(path_or_repo_id, revision, allow_patterns=files)
    folder = os.path.join(root, subfolder) if subfolder else root
    if root != os.path.expanduser(str(path_or_repo_id)) and not _has_safetensors(folder):  # an older hub repo
        older = [f"{subfolder}/{pattern}" if subfolder else pattern for pattern in OLDER_WEIGHTS]
        root = resolve_folder(path_or_repo_id, revision, allow_patterns=files + older)
        folder = os.path.join(root, subfolder) if subfolder else root
    config = read_config_file(os.path.join(folder, "config.json"))
    where = os.path.basename(os.path.normpath(folder)) or folder

    def tensors(_, __):
        state_dict = read_weights(folder, variant)
        if "vision_config" in config and "text_config" in config:  # a two-tower checkpoint: this model's tower
            other = getattr(cls, "other_tower", ())
            state_dict = {key: value for key, value in state_dict.items() if not key.startswith(other)}
        return where, state_dict

    modules, params, _ = assemble({where: cls}, {where: config}, tensors, dtype, attention, kernels)
    return modules[where], params[where]


def load_pipeline(path_or_repo_id, models: dict, tokenizers: tuple, index_options: tuple = (), revision=None,
                  dtype=jnp.float32, scheduler=None, scheduler_config=None, variant=None, attention="auto",
                  optional: tuple = (), tokenizer_loaders=None):
    """(the pipeline's constructor arguments, params) from a diffusers checkpoint folder or hub id.

    `models` maps folder names to model classes, `tokenizers` names the tokenizer folders, `index_options` the
    model_index.json entries passed on (SDXL's force_zeros_for_empty_prompt). Components named in `optional` may
    be null in model_index.json (an SDXL refiner has no first text encoder and tokenizer): they are passed as None.
    `tokenizer_loaders` maps the tokenizers that are not CLIP's to their loaders (SD 3's T5: `T5Tokenizer.from_folder`).
    """
    files = checkpoint_files(variant, tuple(models), tokenizers)
    folder = resolve_folder(path_or_repo_id, revision, allow_patterns=files)
    if not os.path.isfile(os.path.join(folder, "model_index.json")):
        raise ModelNotFoundError(f"{path_or_repo_id}: no model_index.json, so not a diffusers pipeline checkpoint")
    index = read_index(folder)
    absent = [name for name in (*models, *tokenizers) if is_null(index, name)]
    if required := [name for name in absent if name not in optional]:
        raise ModelNotFoundError(f"{path_or_repo_id}: model_index.json lists {', '.join(required)} as null, but this "
                                 "pipeline needs them")
    models = {name: cls for name, cls in models.items() if name not in absent}
    tokenizers = tuple(name for name in tokenizers if name not in absent)
    if any(not _has_safetensors(os.path.join(folder, c)) for c in models) and folder != str(path_or_repo_id):
        # Older repos ship .bin or Flax msgpack only: fetch those for the components that need them.
        patterns = [f"{c}/*.bin" for c in models] + [f"{c}/*.msgpack" for c in models]
        folder = resolve_folder(path_or_repo_id, revision, allow_patterns=files + patterns)
    check_pipeline_folder(folder, str(path_or_repo_id), tuple(models), tokenizers,  # before anything slow
                          tuple(tokenizer_loaders or ()))  # the tokenizers that are not CLIP's are T5's
    for name in models:
        weight_files(os.path.join(folder, name), variant)  # fail on a missing weights file before reading anything

    scheduler = load_scheduler(folder, scheduler, scheduler_config)
    configs = {name: read_config_file(os.path.join(folder, name, "config.json")) for name in models}
    modules, params, loaded = assemble(
        models, configs, lambda name, _: (name, read_weights(os.path.join(folder, name), variant)), dtype, attention,
        tokenizers={name: functools.partial((tokenizer_loaders or {}).get(name, load_tokenizer),
                                            os.path.join(folder, name)) for name in tokenizers})
    options = {key: index[key] for key in index_options if key in index}
    return {**dict.fromkeys(absent), **modules, **loaded, **options, "scheduler": scheduler, "dtype": dtype}, params


def _has_safetensors(folder):
    return os.path.isdir(folder) and any(name.endswith(".safetensors") for name in os.listdir(folder))
