"""The command line's side of the UNet families (SD 1.x / 2.x, SDXL, and a registered family with a UNet): the
checkpoint parts its checks read, its UNet's config and the request's checks against it (inpainting channels), its
single files. A family names its side in `Family.cli`; SD 3.x's is `sd3.py`, with the same functions."""

from __future__ import annotations

import os

from .request import CONFIG_FILES, UserError


def folder_parts(request) -> tuple[tuple, tuple]:
    """(models, tokenizers) whose configs the checks read."""
    return ("text_encoder", "unet", "vae"), ("tokenizer",)


def without_t5(request, index) -> bool:
    """No UNet family has a T5 to leave out."""
    return False


def read_denoiser(folder, changes=None):
    """The UNet's config."""
    from ..models import UNetConfig
    from ..models.config import read_config_file

    return UNetConfig.from_dict(read_config_file(os.path.join(folder, "unet", "config.json")))


def check_denoiser(request, family, unet, vae):
    """An inpainting UNet (its mask and masked image as input channels) for inpaint only."""
    latent, unet_channels = vae.latent_channels, unet.in_channels
    if request.command == "inpaint" and unet_channels not in (latent, 2 * latent + 1):
        raise UserError(f"{request.model}: its UNet takes {unet_channels} input channels; inpainting needs an "
                        f"ordinary ({latent}) or an inpainting ({2 * latent + 1}) UNet")
    if request.command != "inpaint" and unet_channels == 2 * latent + 1:
        raise UserError(f"{request.model} is an inpainting checkpoint (its UNet takes a mask): use sdflax inpaint")


def pipeline_class(request, cls, denoiser, vae):
    """The class of the request's cell, as the family and the features chose it."""
    return cls


def defaults(cls, denoiser) -> dict:
    """The pipeline class's defaults (diffusers')."""
    return cls.defaults


def default_size(denoiser, vae) -> int:
    """The output's side without --height / --width or a picture: The UNet's own."""
    return denoiser.sample_size * vae.scale_factor


def cfg_scale(request, configs) -> tuple[str, float | None, float]:
    """(the flag of the classifier-free guidance scale a guider takes, its value given, the scale): --guidance's."""
    return "--guidance", request.guidance, configs.guidance


def size_step(denoiser, vae) -> tuple[int, str]:
    """(what the output's sides are multiples of, its name in messages)."""
    return vae.scale_factor, "the VAE scale factor"


def check_size(request, height, width, denoiser, vae):
    """A UNet takes any multiple of the step."""


# a list of modules and the index of one, as --guider-arg config= names the layers a guider perturbs
LAYER_EXAMPLE = "mid_block.attentions.0.transformer_blocks:0"


def check_guider(request, guider_class):
    """A UNet takes every guider."""


def file_configs(request, tensors) -> tuple[str, None, bool]:
    """(the folder of configs for a single file of a UNet family, no config changes, with T5: False): --config's,
    else sdflax's bundled ones for its version (told from its text encoders)."""
    from ..loading.hub import resolve_folder
    from ..loading.folders import check_pipeline_folder
    from ..loading.single_file import NAMES, bundled_config_folder, detect_version, file_contents

    version = detect_version(tensors)
    if version == "sdxl_refiner":
        raise UserError(f"--model {request.model} is {NAMES[version]} checkpoint (one OpenCLIP text encoder, no "
                        "CLIP ViT-L): a refiner finishes a base model's images and does not draw from a prompt "
                        "alone; give an SD 1.x, 2.x or SDXL base checkpoint")
    if request.config is None:
        return bundled_config_folder(version), None, False
    contents = file_contents(version)
    folder = resolve_folder(request.config, None, allow_patterns=CONFIG_FILES)
    check_pipeline_folder(folder, f"--config {request.config}", tuple(contents.models), contents.tokenizers)
    return folder, None, False


def load_single_file(request, kind, dtype, extra):
    """(pipeline, params) of `kind` from a single-file --model, with its configs from --config or the bundled ones,
    and the ControlNet pipelines' `controlnet=`."""
    from ..loading.single_file import SingleFileError, load_single_file as load_file

    try:
        parts, params = load_file(os.path.expanduser(request.model), request.config, dtype,
                                  scheduler=request.scheduler, attention=request.attention, family=kind.text,
                                  pipeline=kind.__name__)
    except SingleFileError as e:
        if request.config is not None:
            raise
        detail = str(e).partition("; the model configs came from")[0]  # the library's hint names its config=
        raise UserError(f"--model {request.model} does not fit sdflax's bundled configs for its version (another "
                        "architecture?): pass --config <a diffusers folder or hub id of the same model>; "
                        f"{detail}") from e
    return kind(**parts, **extra), params
