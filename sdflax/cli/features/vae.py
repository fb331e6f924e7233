"""--vae: another VAE than the checkpoint's (a diffusers AutoencoderKL folder or hub id, as
stabilityai/sd-vae-ft-mse, or one file in the original LDM names, as A1111's vae-ft-mse-840000-ema-pruned.safetensors),
as A1111's "SD VAE" setting; it must take the checkpoint's latents (a file: it has the checkpoint's VAE
architecture)."""

from __future__ import annotations

import os

from ..manifest import quoted
from ..request import UserError
from .model_config import model_config

FLAG = "--vae"
DENOISERS = ("unet",)  # SD 3.x's single files are read by their own layout, which takes no VAE given


def add_flags(add, command):
    add("--vae", metavar="ID_DIR_OR_FILE", help="a VAE in place of the checkpoint's: a diffusers AutoencoderKL folder "
        "or hub id (stabilityai/sd-vae-ft-mse), or an A1111 VAE file (.safetensors / .ckpt / .pt in LDM names, e.g. "
        "vae-ft-mse-840000-ema-pruned.safetensors), of the checkpoint's latents, as A1111's SD VAE")
    add("--vae-tiling", action="store_true", help="decode the picture in overlapping tiles of the VAE's sample size, "
        "blended (diffusers' enable_tiling): less memory for large pictures")


def used(request) -> bool:
    return request.vae is not None or request.vae_tiling


def is_file(request) -> bool:
    return request.vae is not None and os.path.isfile(os.path.expanduser(request.vae))


def vae_config(request):
    """--vae's config.json (kilobytes): an AutoencoderKL's."""
    from ...models import VAEConfig

    return model_config(f"--vae {request.vae}", request.vae, "AutoencoderKL", VAEConfig, "a VAE",
                        "stabilityai/sd-vae-ft-mse")


def check_configs(request, configs):
    """It reads and writes the checkpoint's latents: their channels and the scale factor (a file: it has the
    checkpoint's VAE config)."""
    if request.vae is None or is_file(request):
        return
    theirs, ours = vae_config(request), configs.vae
    if (theirs.latent_channels, theirs.scale_factor) != (ours.latent_channels, ours.scale_factor):
        raise UserError(f"--vae {request.vae} takes latents of {theirs.latent_channels} channels at 1/"
                        f"{theirs.scale_factor} of the picture, {request.model}'s are {ours.latent_channels} at 1/"
                        f"{ours.scale_factor}: give a VAE made for this base model")


def components(request, dtype) -> tuple[dict, dict]:
    from ... import AutoencoderKL

    if request.vae is None or is_file(request):  # a file is read into the checkpoint's VAE (`load`)
        return {}, {}
    try:
        vae, params = AutoencoderKL.from_pretrained(os.path.expanduser(request.vae), dtype=dtype)
    except (OSError, ValueError) as e:  # weights missing, or not matching the config
        raise UserError(f"--vae {request.vae}: {e}") from e
    return {"vae": vae}, {"vae": params}


def load(request, pipeline, params, dtype):
    """The pipeline with --vae-tiling's tiled decode, and --vae's file read into its VAE."""
    from ...loading.vae_file import vae_file_params

    if is_file(request):
        try:
            params = {**params, "vae": vae_file_params(pipeline.vae, os.path.expanduser(request.vae), dtype)}
        except ValueError as e:
            raise UserError(f"--vae {request.vae}: {e}") from e
    return pipeline.replace(vae=pipeline.vae.clone(tiling=True)) if request.vae_tiling else pipeline, params


def settings(request, checkpoint) -> dict:
    return {**({"vae": request.vae} if request.vae is not None else {}),
            **({"vae_tiling": True} if request.vae_tiling else {})}


def parameters(s) -> str:
    """As A1111 writes its VAE (A1111 has no tiling entry: it is its memory setting)."""
    return f", VAE: {quoted(s['vae'])}" if "vae" in s else ""
