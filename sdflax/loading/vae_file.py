"""A VAE as one file in the original LDM names (A1111's "SD VAE" files: vae-ft-mse-840000-ema-pruned.safetensors,
`encoder.down.0.block.0.conv1.weight`, ...; or a whole checkpoint's `first_stage_model.*`), read into the params of
a VAE module of the same architecture (the checkpoint's own VAE config)."""

from __future__ import annotations

import re

from .files import read_checkpoint
from .ldm_names import fused_parts, map_key, vae_table
from .weights import convert_state_dict, short_list

PREFIX = "first_stage_model."
IGNORED = re.compile(r"^(loss\.|model_ema\.)")  # the training loss's discriminator, EMA copies


def vae_file_params(vae, path, dtype):
    """Params of `vae` (an AutoencoderKL module) from an LDM-named VAE file; names no table maps are an error that
    lists them."""
    table = vae_table(vae.config)
    tensors, unknown = {}, []
    for key, array in read_checkpoint(path).items():
        key = key.removeprefix(PREFIX)
        names = None if IGNORED.match(key) else map_key(key, table)
        if names is None:
            if not IGNORED.match(key):
                unknown.append(key)
            continue
        tensors.update(zip(names, fused_parts(key, array, names)))
    if unknown:
        raise ValueError(f"{path}: {len(unknown)} tensors that are not a VAE's in LDM names ({short_list(unknown)}): "
                         "give an A1111 VAE file (encoder.down.0.block.0.conv1.weight, ...) or a diffusers VAE folder")
    return convert_state_dict(tensors, vae.param_shapes(), dtype, path)
