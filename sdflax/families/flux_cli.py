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
    if features == 2 * ordinary and (request.controlnet or len(request.control_image) != 1):
        raise UserError(f"{request.model} is a Flux.1 Control checkpoint (Canny / Depth dev: its transformer takes "
                        "the control picture's latents beside the latents): give one --control-image and no "
                        "--controlnet (sdflax generate, img2img or inpaint)")
    if features not in (ordinary, fill, 2 * ordinary):
        raise UserError(f"{request.model}: its transformer takes {features} features per token; sdflax runs Flux.1 "
                        f"transformers of {ordinary} (the VAE's latents, packed), Fill's {fill} and Control's "
                        f"{2 * ordinary}")
    if request.control_image and not request.controlnet and features != 2 * ordinary:
        raise UserError(f"--control-image without --controlnet, but {request.model} is not a Flux.1 Control "
                        "checkpoint (Canny / Depth dev): add --controlnet, the Flux ControlNet it steers")
    if not transformer.guidance_embeds and request.guidance not in (None, 0):
        raise UserError(f"--guidance is the guidance Flux.1 dev was distilled to take, and {request.model}'s "
                        "transformer has no guidance input (as FLUX.1-schnell's): drop --guidance (classifier-free "
                        "guidance: --true-cfg with --negative-prompt)")


def pipeline_class(request, cls, transformer, vae):
    """FluxFill for `inpaint` with a Fill transformer, a Control transformer's class of the command (FluxControl,
    FluxControlImg2Img, FluxControlInpaint); else the family's class of the cell."""
    from .flux import FluxControl, FluxControlImg2Img, FluxControlInpaint, FluxFill

    if request.command == "inpaint" and transformer.in_channels == fill_features(vae):
        return FluxFill
    if transformer.in_channels == 8 * vae.latent_channels:
        return {"noise": FluxControl, "image": FluxControlImg2Img, "image_mask": FluxControlInpaint}[request.start]
    return cls


def check_controlnets(request, configs):
    """Each --controlnet a Flux ControlNet (a diffusers folder or hub id) of the transformer's width and text, a
    Union net with its --control-mode; or, with --control-image alone, a Control checkpoint (check_denoiser)."""
    from ..loading.hub import ModelNotFoundError, resolve_folder
    from ..models.config import read_config_file
    from ..models.flux_controlnet import FluxControlNetConfig

    if request.control_mode and len(request.control_mode) != len(request.control_image):
        raise UserError(f"{len(request.control_mode)} --control-mode for {len(request.control_image)} "
                        "--control-image: give one per picture (-1 for a net that is not a Union net)")
    transformer = configs.denoiser
    for k, name in enumerate(request.controlnet):
        flag = f"--controlnet {name}"
        if os.path.isfile(os.path.expanduser(name)):
            raise UserError(f"{flag}: Flux.1 ControlNets load from diffusers folders or hub ids (config.json and "
                            "the weights), not single files")
        try:
            folder = resolve_folder(name, None, allow_patterns=["config.json"])
            config = read_config_file(os.path.join(folder, "config.json"))
            net = FluxControlNetConfig.from_dict(config)
        except (ModelNotFoundError, ValueError, TypeError, OSError) as e:
            raise UserError(f"{flag}: {e}") from e
        if config.get("_class_name") != "FluxControlNetModel" or (
                net.joint_attention_dim, net.pooled_projection_dim, net.in_channels) != (
                transformer.joint_attention_dim, transformer.pooled_projection_dim, transformer.in_channels):
            raise UserError(f"{flag} is not a ControlNet for {request.model}'s Flux.1 transformer (a "
                            f"{config.get('_class_name')} of text width {net.joint_attention_dim}): use a Flux "
                            "ControlNet trained for this base model")
        pictures = len(request.control_image) if len(request.controlnet) == 1 else 1
        modes = request.control_mode[k:k + pictures] if request.control_mode else ()
        if net.num_mode is not None and not modes:
            raise UserError(f"{flag} is a Union ControlNet of {net.num_mode} modes: give --control-mode N, the kind "
                            f"of its --control-image (0 .. {net.num_mode - 1}; its model card lists them)")
        if any(not -1 <= mode < (net.num_mode or 0) for mode in modes) or net.num_mode is None and any(
                mode != -1 for mode in modes):
            raise UserError(f"--control-mode {' '.join(map(str, modes))} for {flag}: "
                            + (f"a mode in 0 .. {net.num_mode - 1}" if net.num_mode else "-1 (not a Union net)"))


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
    """(pipeline, params) of `kind` from a FLUX.1 transformer file and --config's other models (`extra`: the
    ControlNets)."""
    try:
        return kind.from_single_file(os.path.expanduser(request.model), config=request.config, dtype=dtype,
                                     scheduler=request.scheduler, attention=request.attention, **extra)
    except ValueError as e:  # the library's advice names its Python arguments: here they are flags
        advice = str(e).replace("pass config=<", "pass --config <").replace(f"config={request.config}",
                                                                            f"--config {request.config}")
        raise UserError(f"--model {request.model}: {advice}") from e
