"""--refiner and --high-noise-frac (generate): an SDXL refiner finishing an SDXL base model's images, diffusers'
ensemble of expert denoisers. Its configs are checked before anything loads; the base runs the first
--high-noise-frac of the schedule and hands its latents to the refiner, which runs the rest and decodes."""

from __future__ import annotations

import os

from ..parse import number
from ..request import CONFIG_FILES, UserError

FLAG = "--refiner"
DENOISERS = ("unet",)
DEFAULT_HIGH_NOISE_FRAC = 0.8  # diffusers' base + refiner example

fraction = number(lambda v: 0 < v < 1, "must be in (0, 1), got {text}: the fraction of the schedule the base runs "
                  "before the refiner takes over (e.g. 0.8)")


def add_flags(add, command):
    if command != "generate":
        return
    add("--refiner", metavar="ID_OR_DIR", help="an SDXL refiner (hub id or diffusers folder) that finishes an SDXL "
        "base model's images: the base runs the first --high-noise-frac of the schedule and hands its latents to the "
        "refiner, which runs the rest of the --steps and decodes (diffusers' ensemble of expert denoisers); it reads "
        "--prompt and --negative-prompt (its one text encoder), --lora and --embedding apply to the base")
    add("--high-noise-frac", type=fraction, metavar="F", help="with --refiner: the fraction of the schedule the "
        "base runs, in (0, 1) (default: 0.8)")


def used(request) -> bool:
    return request.refiner is not None


def check_flags(request, batch):
    if request.high_noise_frac is not None and request.refiner is None:
        raise UserError("--high-noise-frac applies with --refiner: add --refiner ID_OR_DIR, or drop it")


def resolve(request, configs, pictures) -> float:
    """The --high-noise-frac: --refiner's configs (kilobytes) are an SDXL checkpoint (a refiner or a base) whose
    latents are the base model's, and both halves of the schedule, cut there, run a step."""
    from ...loading.hub import ModelNotFoundError, resolve_folder
    from ...loading.folders import check_pipeline_folder, load_scheduler
    from ...models import VAEConfig
    from ...models.config import read_config_file
    from ...families.sdxl import StableDiffusionXLImg2Img
    from ...pipeline.starts import schedule_window
    from ...pipeline.types import Settings
    from ...schedulers.common import for_family

    name = f"--refiner {request.refiner}"
    if configs.family is not StableDiffusionXLImg2Img.family:  # the refiner runs as the base's img2img
        raise UserError(f"{name}: a refiner finishes SDXL base images, but {request.model} is not an SDXL "
                        "checkpoint: drop --refiner, or give an SDXL base --model")
    for flag, given in (("--controlnet", request.controlnet), ("--t2i-adapter", request.t2i_adapter)):
        if given:
            raise UserError(f"{name} with {flag} is not supported: drop one of them")
    if os.path.isfile(os.path.expanduser(request.refiner)):
        raise UserError(f"{name} is a file: sdflax takes a refiner as a hub id or diffusers folder")
    fraction = request.high_noise_frac if request.high_noise_frac is not None else DEFAULT_HIGH_NOISE_FRAC
    text = StableDiffusionXLImg2Img.text
    try:
        folder = resolve_folder(request.refiner, None, allow_patterns=CONFIG_FILES)
        index_file = os.path.join(folder, "model_index.json")
        kind = read_config_file(index_file).get("_class_name") if os.path.isfile(index_file) else None
        if kind is not None and not str(kind).startswith("StableDiffusionXL"):  # before naming files it lacks
            raise UserError(f"{name} is a {kind} checkpoint, not an SDXL refiner or SDXL one: give the folder or hub "
                            "id of one, e.g. stabilityai/stable-diffusion-xl-refiner-1.0")
        check_pipeline_folder(folder, name, tuple(text.models), text.tokenizers)  # null parts need no files
        refiner_vae = VAEConfig.from_dict(read_config_file(os.path.join(folder, "vae", "config.json")))
        unet = configs.side.read_denoiser(folder)  # the base's family's: SDXL
        refiner_scheduler = for_family(load_scheduler(folder, request.scheduler), text.ays_family)
    except (ModelNotFoundError, ValueError, TypeError) as e:
        raise UserError(str(e)) from e
    if kind is None or unet.addition_embed_type != "text_time":
        raise UserError(f"{name} is not an SDXL refiner or SDXL checkpoint: give the folder or hub id of one, e.g. "
                        "stabilityai/stable-diffusion-xl-refiner-1.0")
    vae, latent = configs.vae, configs.vae.latent_channels
    if (refiner_vae.latent_channels, unet.in_channels) != (latent, latent) \
            or refiner_vae.scale_factor != vae.scale_factor:
        raise UserError(f"{name} takes other latents than {request.model} ({refiner_vae.latent_channels} "
                        f"channels, UNet input {unet.in_channels}, VAE scale factor "
                        f"{refiner_vae.scale_factor}; the base: {latent}, {latent}, {vae.scale_factor}): give "
                        "a refiner made for this base")
    for which, which_scheduler, cut in (("the base", configs.scheduler, dict(denoising_end=fraction)),
                                        (name, refiner_scheduler, dict(denoising_start=fraction))):
        try:
            schedule_window(which_scheduler, Settings(configs.steps, **cut))
        except ValueError:
            raise UserError(f"--high-noise-frac {fraction} with --steps {configs.steps} leaves {which} no step: "
                            "raise --steps, or move --high-noise-frac towards 0.5") from None
    return fraction


def next_stage(request, checkpoint, dtype):
    """(pipeline, params) of --refiner, an SDXL image-to-image pipeline (a refiner: its second encoder alone), which
    the call hands its latents to."""
    import jax.numpy as jnp

    from ... import StableDiffusionXLImg2Img

    try:
        return StableDiffusionXLImg2Img.from_pretrained(request.refiner, dtype=getattr(jnp, dtype),
                                                        scheduler=request.scheduler, attention=request.attention)
    except (OSError, ValueError) as e:
        raise UserError(f"--refiner {request.refiner}: {e}") from e


def staged(base, refiner, mesh, checkpoint, rows, keys, configure):
    """The base call stopped at --high-noise-frac, returning its latents, and the refiner continuing from them with
    the same steps, guidance and per-image keys: diffusers' base + refiner, `denoising_end` then `denoising_start`.
    The refiner has one text encoder (the second): as diffusers, it reads the prompt and negative prompt.
    `configure`: the pipeline as the features set it up (a guider)."""
    from ...parallel import replicate_on

    pipe, params = refiner
    pipe = configure(pipe)
    high_noise_frac = checkpoint.features["refiner"]
    ids = pipe.prepare_inputs([r.prompt for r in rows])
    # No negative prompt: the refiner's own default (the empty prompt's embedding: it does not force zeros)
    negative = any(r.negative_prompt for r in rows)
    neg_ids = pipe.prepare_inputs([r.negative_prompt for r in rows]) if negative else None
    params = replicate_on(params, mesh)

    def call():
        latents = base(denoising_end=high_noise_frac, output_type="latent")
        return pipe.generate_sharded(ids, latents, params, keys, num_inference_steps=rows[0].steps,
                                     guidance_scale=checkpoint.guidance, neg_prompt_ids=neg_ids,
                                     denoising_start=high_noise_frac, mesh=mesh)
    return call


def settings(request, checkpoint) -> dict:
    if "refiner" not in checkpoint.features:
        return {}
    return {"refiner": request.refiner, "high_noise_frac": checkpoint.features["refiner"]}


def parameters(s) -> str:
    """As A1111 writes its refiner."""
    return f", Refiner: {s['refiner']}, Refiner switch at: {s['high_noise_frac']}" if "refiner" in s else ""
