"""The command line's side of Flux.1 (`Family.cli`; the UNet families' is `sdflax/cli/unet.py`, SD 3.x's
`sdflax/cli/sd3.py`, with the same functions): the parts its checks read, its transformer's config and the
request's checks against it (an ordinary transformer, or Fill's for `inpaint`), schnell's defaults, the size step,
its single files (a transformer alone in Black Forest Labs' layout, the rest from --config). Its own flag is a
feature, `sdflax/cli/features/flux_flags.py`; T5's --max-sequence-length is `features/t5.py`."""

from __future__ import annotations

import os

from ..cli.request import UserError

SCHNELL_STEPS = 4  # a transformer without a guidance input (schnell, timestep-distilled): Black Forest Labs' steps

# a list of modules and the index of one, as --guider-arg config= names the layers a guider perturbs
LAYER_EXAMPLE = "transformer_blocks:1"


def folder_parts(request) -> tuple[tuple, tuple, tuple]:
    """(models, tokenizers, T5's tokenizers) whose files the checks look for: CLIP-L, T5, the transformer, the VAE."""
    return ("text_encoder", "text_encoder_2", "transformer", "vae"), ("tokenizer", "tokenizer_2"), ("tokenizer_2",)


def without_t5(request, index) -> bool:
    """T5 always loads: without it a Flux.1 pipeline takes prompt embeddings, not prompts."""
    return False


def read_denoiser(folder, changes=None):
    """The transformer's config, with `changes` (a single file's: its own shapes over --config's)."""
    from ..models.config import read_config_file
    from ..models.flux import FluxTransformerConfig

    config = read_config_file(os.path.join(folder, "transformer", "config.json"))
    return FluxTransformerConfig.from_dict({**config, **(changes or {})})


def fill_features(vae) -> int:
    """The features per token of Flux.1 Fill's transformer: latents, masked image latents and the f x f-folded
    mask, each 2x2 patch packed."""
    return 4 * (2 * vae.latent_channels + vae.scale_factor ** 2)


def check_denoiser(request, family, transformer, vae):
    """An ordinary transformer (the VAE's latents, packed), or Fill's for inpaint only; --guidance where the
    transformer takes a distilled guidance (dev, not schnell)."""
    ordinary, fill, features = 4 * vae.latent_channels, fill_features(vae), transformer.in_channels
    if features == fill and request.command != "inpaint":
        raise UserError(f"{request.model} is a Flux.1 Fill checkpoint (its transformer takes the masked image and the "
                        "mask beside the latents): use sdflax inpaint")
    if features not in (ordinary, fill):
        control = " (Flux.1 Canny or Depth, which sdflax does not run yet)" if features == 2 * ordinary else ""
        raise UserError(f"{request.model}: its transformer takes {features} features per token{control}; sdflax runs "
                        f"Flux.1 transformers of {ordinary} (the VAE's latents, packed) and Fill's {fill}")
    if not transformer.guidance_embeds and request.guidance not in (None, 0):
        raise UserError(f"--guidance is the guidance Flux.1 dev was distilled to take, and {request.model}'s "
                        "transformer has no guidance input (as FLUX.1-schnell's): drop --guidance (classifier-free "
                        "guidance: --true-cfg with --negative-prompt)")


def pipeline_class(request, cls, transformer, vae):
    """FluxFill for `inpaint` with a Fill transformer; else the family's class of the cell."""
    from .flux import FluxFill

    if request.command == "inpaint" and transformer.in_channels == fill_features(vae):
        return FluxFill
    return cls


def defaults(cls, transformer) -> dict:
    """The pipeline class's (diffusers'); a transformer without a guidance input (schnell) 4 steps and no distilled
    guidance, as Black Forest Labs run it (diffusers' FluxPipeline leaves them to the caller: 28 steps, 3.5)."""
    if transformer.guidance_embeds:
        return cls.defaults
    return {**cls.defaults, "num_inference_steps": SCHNELL_STEPS, "guidance_scale": 0.0}


def default_size(transformer, vae) -> int:
    """diffusers' default: 128 latents a side (1024 pixels with FLUX.1's VAE)."""
    from .flux_text import DEFAULT_SAMPLE_SIZE

    return DEFAULT_SAMPLE_SIZE * vae.scale_factor


def cfg_scale(request, configs) -> tuple[str, float | None, float]:
    """(--true-cfg, its value given, the scale: given, else the pipeline's 1): --guidance is the distilled guidance
    the transformer takes (the call's guidance_scale), not classifier-free guidance's."""
    given = request.true_cfg
    return "--true-cfg", given, configs.pipeline.defaults["true_cfg_scale"] if given is None else given


def check_guider(request, guider_class):
    """The transformer takes every guider: those that perturb layers name its transformer_blocks (double-stream)
    or single_transformer_blocks."""


def size_step(transformer, vae) -> tuple[int, str]:
    """(what the output's sides are multiples of, its name in messages): a 2x2 patch of latents, one token."""
    return vae.scale_factor * 2, "the VAE scale factor times the patch size"


def check_size(request, height, width, transformer, vae):
    """Rotary positions: any size the step allows."""


def file_configs(request, tensors) -> tuple[str, dict, bool]:
    """(the folder of configs for a FLUX.1 transformer file, its transformer's config from the file's shapes, with
    T5: False): --config's, a diffusers FLUX.1 folder or hub id, which also gives the models the file lacks (sdflax
    bundles none)."""
    from ..loading.flux_names import flux_config, without_prefix
    from ..cli.preflight import config_folder
    from ..loading.folders import check_pipeline_folder
    from .flux import FAMILY

    if request.config is None:
        raise UserError(f"--model {request.model} holds a FLUX.1 transformer alone (Black Forest Labs' layout): pass "
                        "--config <a diffusers FLUX.1 folder or hub id, e.g. black-forest-labs/FLUX.1-dev> for its "
                        "text encoders, VAE, tokenizers and scheduler")
    folder, _ = config_folder(request, FAMILY, "a FLUX.1 transformer file", "a diffusers FLUX.1 folder or hub id")
    check_pipeline_folder(folder, f"--config {request.config}", *folder_parts(request))
    return folder, flux_config(without_prefix(tensors), os.path.basename(request.model)), False


def load_single_file(request, kind, dtype, extra):
    """(pipeline, params) of `kind` from a FLUX.1 transformer file and --config's other models (`extra`: none,
    Flux.1 takes no ControlNet here)."""
    try:
        return kind.from_single_file(os.path.expanduser(request.model), config=request.config, dtype=dtype,
                                     scheduler=request.scheduler, attention=request.attention, **extra)
    except ValueError as e:  # the library's advice names its Python arguments: here they are flags
        advice = str(e).replace("pass config=<", "pass --config <").replace(f"config={request.config}",
                                                                            f"--config {request.config}")
        raise UserError(f"--model {request.model}: {advice}") from e
