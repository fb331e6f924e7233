"""The command line's side of SD 3.x (`Family.cli`; the UNet families' is `unet.py`, with the same functions): the
parts its checks read, its transformer's config and the request's checks against it, its single files. Its own
flags are a feature, `features/sd3_flags.py`."""

from __future__ import annotations

import os

from . import unet
from .request import UserError

# what SD 3.x does as a UNet family does: the row's class, diffusers' defaults, the denoiser's own size, --guidance
pipeline_class, defaults, default_size, cfg_scale = unet.pipeline_class, unet.defaults, unet.default_size, unet.cfg_scale


def lacks_t5(index: dict) -> bool:
    """Whether an SD 3.x folder's model_index.json has no T5 (saved with text_encoder_3=None)."""
    from ..loading.folders import is_null

    return "text_encoder_3" not in index or is_null(index, "text_encoder_3")


def file_configs(request, tensors) -> tuple[str, dict, bool]:
    """(the folder of configs for an SD 3.x single file, changes to its transformer's config, whether it runs
    without T5): --config's, else sdflax's bundled ones for the MMDiT's size (as `load_sd3_single_file` reads them).
    """
    from ..loading.ldm_names import (SD3_BUNDLED, SD3_TRANSFORMER_CHANGES, sd3_components_in, sd3_model_type,
                                     sd3_with_prefixes)
    from ..loading.folders import check_pipeline_folder
    from ..loading.single_file import bundled_config_folder
    from ..families.sd3 import FAMILY
    from .preflight import config_folder

    tensors = sd3_with_prefixes(tensors)
    t5_in_file = "text_encoder_3" in sd3_components_in(tensors)
    if request.config is not None:
        folder, index = config_folder(request, FAMILY, "an SD 3.x file",
                                      "the diffusers folder or hub id of the same model")
        check_pipeline_folder(folder, f"--config {request.config}", ("transformer", "vae"), ())
        return folder, {}, request.no_t5 or not t5_in_file and lacks_t5(index)
    version = sd3_model_type(tensors)
    if version is None:
        raise UserError(f"--model {request.model}: an MMDiT of a size sdflax bundles no configs for (SD 3 Medium, "
                        "SD 3.5 Medium and Large): pass --config <a diffusers folder or hub id of the same model>")
    return bundled_config_folder(SD3_BUNDLED[version]), SD3_TRANSFORMER_CHANGES.get(version, {}), \
        request.no_t5 or not t5_in_file


def folder_parts(request) -> tuple[tuple, tuple]:
    """(models, tokenizers) whose configs the checks read: the transformer in place of a UNet; T5 where it loads (its
    tokenizer is checked when it loads)."""
    t5 = () if request.no_t5 else ("text_encoder_3",)
    return ("text_encoder", "text_encoder_2", *t5, "transformer", "vae"), ("tokenizer", "tokenizer_2")


def without_t5(request, index) -> bool:
    """--no-t5, or a folder saved without T5."""
    return request.no_t5 or lacks_t5(index)


# a list of modules and the index of one, as --guider-arg config= names the layers a guider perturbs
LAYER_EXAMPLE = "transformer_blocks:7"


def check_guider(request, guider_class):
    """The transformer takes every guider: those that perturb layers name its transformer_blocks."""


def read_denoiser(folder, changes=None):
    """The transformer's config, with `changes` (a single file's with bundled configs: SD 3 Medium's MMDiT)."""
    from ..models import SD3TransformerConfig
    from ..models.config import read_config_file

    config = read_config_file(os.path.join(folder, "transformer", "config.json"))
    return SD3TransformerConfig.from_dict({**config, **(changes or {})})


def check_denoiser(request, family, transformer, vae):
    """The transformer takes latents of the VAE's channels (no SD 3.x inpainting transformer takes a mask)."""
    if transformer.in_channels != vae.latent_channels:
        raise UserError(f"{request.model}: its transformer takes {transformer.in_channels} input channels, its VAE's "
                        f"latents have {vae.latent_channels}: sdflax runs SD 3.x transformers of the VAE's latents")


def size_step(transformer, vae) -> tuple[int, str]:
    """(what the output's sides are multiples of, its name in messages): a patch of latents."""
    return vae.scale_factor * transformer.patch_size, "the VAE scale factor times the patch size"


def check_size(request, height, width, transformer, vae):
    """The largest image the transformer's position table covers."""
    largest = transformer.pos_embed_max_size * transformer.patch_size * vae.scale_factor
    if max(height, width) > largest:
        raise UserError(f"{width}x{height} is larger than {request.model} makes: its position table covers "
                        f"{largest} pixels a side: give --height and --width of at most {largest}")


def load_single_file(request, kind, dtype, extra):
    """(pipeline, params) of `kind` from an SD 3.x single file, the models it lacks from --config (as its configs;
    else sdflax's bundled ones), T5 left out with --no-t5, and the ControlNet pipeline's `controlnet=` (`extra`)."""
    from ..loading.single_file import load_sd3_single_file

    try:
        parts, params = load_sd3_single_file(os.path.expanduser(request.model), request.config, dtype,
                                             scheduler=request.scheduler, attention=request.attention,
                                             left_out=("text_encoder_3",) if request.no_t5 else ())
    except ValueError as e:  # the library's advice names its Python arguments: here they are flags
        advice = str(e).replace("pass config=<", "pass --config <").replace("text_encoder_3=None", "--no-t5")
        advice = advice.replace(f"config={request.config}", f"--config {request.config}")
        raise UserError(f"--model {request.model}: {advice}") from e
    return kind(**parts, **extra), params
