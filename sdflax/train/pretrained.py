"""A trained model back in diffusers' layout: our params -> PyTorch names and layouts, written as the folder
`from_pretrained` (diffusers' and sdflax's) reads.

The names come from `sdflax.loading.torch_names`, the inverse of the loader's.
"""

from __future__ import annotations

import os
import shutil

from .files import write_safetensors
from ..loading.torch_names import torch_state_dict
from ..loading.hub import resolve_folder

WEIGHTS_FILE = {"unet": "diffusion_pytorch_model.safetensors", "vae": "diffusion_pytorch_model.safetensors",
                "text_encoder": "model.safetensors", "text_encoder_2": "model.safetensors"}
TEXT_PREFIX = ("text_model.", ("text_projection",))  # as the hub's CLIP checkpoints name them
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".msgpack", ".index.json", ".ckpt", ".pt", ".pth")


def save_pretrained(folder, base, params, revision=None):
    """A diffusers pipeline folder: `base`'s (the folder or hub id the training started from) configs, tokenizers
    and scheduler, and the models' weights from `params`. `folder` must not exist yet."""
    folder = os.fspath(folder)
    if os.path.lexists(folder):
        raise FileExistsError(f"{folder} exists: save_pretrained writes a new folder")
    source = resolve_folder(base, revision)
    staging = f"{folder}.partial-{os.getpid()}"

    def ignore(path, names):
        component = os.path.basename(path)
        return [n for n in names if component in params and n.endswith(WEIGHT_SUFFIXES)]

    try:
        shutil.copytree(source, staging, ignore=ignore)
        for component, weights in params.items():
            if component in WEIGHTS_FILE:
                write_safetensors(os.path.join(staging, component, WEIGHTS_FILE[component]),
                                  torch_state_dict(weights, *TEXT_PREFIX if component.startswith("text_encoder") else ()), {"format": "pt"})
        os.rename(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
