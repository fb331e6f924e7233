"""--vae: another VAE than the checkpoint's (a diffusers AutoencoderKL folder or hub id, as
stabilityai/sd-vae-ft-mse), as A1111's "SD VAE" setting; it must take the checkpoint's latents."""

from __future__ import annotations

import os

from ..manifest import quoted
from ..request import UserError
from .model_config import model_config

FLAG = "--vae"
DENOISERS = ("unet",)  # SD 3.x's single files are read by their own layout, which takes no VAE given


def add_flags(add, command):
    add("--vae", metavar="ID_OR_DIR", help="a VAE in place of the checkpoint's: a diffusers AutoencoderKL folder or "
        "hub id (stabilityai/sd-vae-ft-mse), of the checkpoint's latents, as A1111's SD VAE")


def used(request) -> bool:
    return request.vae is not None


def vae_config(request):
    """--vae's config.json (kilobytes): an AutoencoderKL's."""
    from ...models import VAEConfig

    return model_config(f"--vae {request.vae}", request.vae, "AutoencoderKL", VAEConfig, "a VAE",
                        "stabilityai/sd-vae-ft-mse")


def check_configs(request, configs):
    """It reads and writes the checkpoint's latents: their channels and the scale factor."""
    theirs, ours = vae_config(request), configs.vae
    if (theirs.latent_channels, theirs.scale_factor) != (ours.latent_channels, ours.scale_factor):
        raise UserError(f"--vae {request.vae} takes latents of {theirs.latent_channels} channels at 1/"
                        f"{theirs.scale_factor} of the picture, {request.model}'s are {ours.latent_channels} at 1/"
                        f"{ours.scale_factor}: give a VAE made for this base model")


def components(request, dtype) -> tuple[dict, dict]:
    from ... import AutoencoderKL

    try:
        vae, params = AutoencoderKL.from_pretrained(os.path.expanduser(request.vae), dtype=dtype)
    except (OSError, ValueError) as e:  # weights missing, or not matching the config
        raise UserError(f"--vae {request.vae}: {e}") from e
    return {"vae": vae}, {"vae": params}


def settings(request, checkpoint) -> dict:
    return {"vae": request.vae} if request.vae is not None else {}


def parameters(s) -> str:
    """As A1111 writes its VAE."""
    return f", VAE: {quoted(s['vae'])}" if "vae" in s else ""
