"""Checks before anything loads: the checkpoint's configs (kilobytes) are read and the request is checked against
them with the library's own checks, so that a size, step count or strength the model cannot take fails before
gigabytes download. Configs only: no model is built here."""

from __future__ import annotations

import dataclasses
import importlib
import os

from .parse import is_number
from .pictures import fit_pictures
from .request import CONFIG_FILES, DEFAULT_HIGH_NOISE_FRAC, SINGLE_FILE_SUFFIXES, UserError
from .sd3 import check_family_flags, check_scheduler, sd3_file_configs
from .t2i_adapter import adapter_class, fit_adapters, read_adapter_pictures


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What the configs say and what the request resolves to with them: the folder, the pipeline class, the
    values left to their defaults (the class's `defaults`, the model's size)."""

    folder: str
    local: bool
    commit: str
    family: object  # its `sdflax.families.Family`
    pipeline: type  # the class of the request's cell: family x start x ControlNet (x T2I-Adapter)
    guidance: float
    height: int
    width: int
    steps: int  # --steps, or the pipeline's default
    without_t5: bool = False  # SD 3.x: --no-t5, or a checkpoint without T5
    single_file: bool = False  # --model is one .safetensors / .ckpt file; `folder` holds the configs used for it
    strength: float | None = None  # img2img and inpaint: --strength, or the pipeline's default
    high_noise_frac: float | None = None  # with --refiner: where the base hands over to it
    control_scales: tuple = ()  # one per --controlnet
    scheduler: object = dataclasses.field(default=None, compare=False)  # the one the pipeline loads with
    guider: object = dataclasses.field(default=None, compare=False)  # --guider's, its scale the guidance
    adapters: object = dataclasses.field(default=None, compare=False)  # t2i_adapter.Adapters, at this size


def command_line_side(family):
    """The module of a family's command-line side (`Family.cli`: `unet.py`'s functions)."""
    return importlib.import_module(family.cli)


def read_configs(folder, family, transformer_changes=None):
    """(VAEConfig, the denoiser's config) of a checkpoint folder: its family's (a UNetConfig, SD 3.x's transformer's
    with `transformer_changes`)."""
    from ..models import VAEConfig
    from ..models.config import read_config_file

    vae = VAEConfig.from_dict(read_config_file(os.path.join(folder, "vae", "config.json")))
    return vae, command_line_side(family).read_denoiser(folder, transformer_changes)


def check_checkpoint(request, pictures, controls=None):
    """(Checkpoint, pictures, controls), the pictures resized to the output size."""
    from ..loading.hub import ModelNotFoundError, resolve_folder, snapshot_commit
    from ..loading.folders import check_pipeline_folder, load_scheduler
    from ..models.config import read_config_file
    from ..families import for_index
    from ..schedulers.common import for_family
    from ..pipeline.starts import start_step

    single_file = os.path.isfile(os.path.expanduser(request.model))
    local = single_file or os.path.isdir(os.path.expanduser(request.model))
    if local and request.revision:
        what = "a file" if single_file else "a local folder"
        raise UserError(f"--revision applies to hub ids, but {request.model} is {what}: drop --revision")
    if request.config is not None and not single_file:
        raise UserError(f"--config applies to a single-file --model ({', '.join(SINGLE_FILE_SUFFIXES)}), but "
                        f"{request.model} is not a file: drop --config")
    try:
        if single_file:
            folder, family, transformer_changes, without_t5 = single_file_configs(request)
        else:
            folder = resolve_folder(request.model, request.revision, allow_patterns=CONFIG_FILES)
            index_file = os.path.join(folder, "model_index.json")
            index = read_config_file(index_file) if os.path.isfile(index_file) else {}
            family, transformer_changes = for_index(index), None
            without_t5 = command_line_side(family).without_t5(request, index)
            check_pipeline_folder(folder, request.model, *command_line_side(family).folder_parts(request))
        side = command_line_side(family)
        check_family_flags(request, family)
        cls = family.pipeline_class(request.start, bool(request.controlnet))
        vae, denoiser = read_configs(folder, family, transformer_changes)
        scheduler = for_family(load_scheduler(folder, request.scheduler), cls.text.ays_family)
        check_scheduler(request, family, scheduler)
        request = dataclasses.replace(request, steps=request.steps or cls.defaults["num_inference_steps"])
        scheduler.check_steps(request.steps)
    except (ModelNotFoundError, ValueError, TypeError) as e:
        raise UserError(str(e)) from e
    if request.t2i_adapter and request.start == "noise" and not request.controlnet:
        cls = adapter_class(family) or cls  # the other classes take T2I-Adapters as they are (adapter=)
    strength = None
    if pictures:
        strength = request.strength if request.strength is not None else cls.defaults["strength"]
        try:
            start_step(request.steps, strength)
        except ValueError:
            raise UserError(f"--strength {strength} with --steps {request.steps} runs no denoising step: raise "
                            f"--strength to at least {1 / request.steps:.3g} or --steps") from None
    if len(family.text.tokenizers) == 1:
        for flag, value in (("--prompt-2", request.prompt_2), ("--negative-prompt-2", request.negative_prompt_2)):
            if value is not None:
                raise UserError(f"{flag} is for SDXL's second text encoder, but {request.model} is not an SDXL "
                                f"checkpoint (it has one): drop {flag}")
    adapter_configs = side.check_denoiser(request, family, denoiser, vae)
    step, step_name = side.size_step(denoiser, vae)
    height, width, pictures, controls, adapter_pictures = fit_pictures(
        request, denoiser.sample_size * vae.scale_factor, step, pictures, controls, read_adapter_pictures(request),
        step_name)
    side.check_size(request, height, width, denoiser, vae)
    adapters = fit_adapters(request, adapter_configs, adapter_pictures, height, width, cls.defaults, family)
    guidance = request.guidance if request.guidance is not None else cls.defaults["guidance_scale"]
    high_noise_frac = check_refiner(request, family, scheduler, vae) if request.refiner else None
    if request.high_noise_frac is not None and high_noise_frac is None:
        raise UserError("--high-noise-frac applies with --refiner: add --refiner ID_OR_DIR, or drop it")
    scales = ()
    if controls:
        default = cls.defaults["controlnet_conditioning_scale"]
        scales = controls.scales * (len(request.controlnet) if len(controls.scales) == 1 else 1) or \
            (default,) * len(request.controlnet)
    commit = "" if single_file else snapshot_commit(folder) or ""  # a hub --config's commit is not the model's
    guider = make_guider(request, guidance)
    if guider is not None and getattr(scheduler, "takes_unconditional", False):
        raise UserError(f"--guider {request.guider} with --scheduler {request.scheduler!r}: a CFG++ scheduler "
                        "re-noises with classifier-free guidance's unconditional prediction, which the guider "
                        "replaces: use another scheduler with it")
    side.check_guider(request, guider)
    checkpoint = Checkpoint(folder, local, commit, family, cls, guidance, height, width, request.steps, without_t5,
                            single_file, strength, high_noise_frac, scales, scheduler, guider, adapters)
    return checkpoint, pictures, controls


def make_guider(request, guidance):
    """--guider with its --guider-arg values, its guidance scale --guidance's (or the pipeline's default)."""
    from ..guiders import guider_from_name
    from ..guiders.names import guider_class

    if request.guider is None:
        if request.guider_arg:
            raise UserError("--guider-arg applies with --guider: add --guider NAME, or drop it")
        return None
    arguments = dict(request.guider_arg)
    if "guidance_scale" in arguments:
        raise UserError("--guider-arg guidance_scale=...: give the scale as --guidance")
    if any(f.name == "guidance_scale" for f in dataclasses.fields(guider_class(request.guider))):
        arguments["guidance_scale"] = guidance
    elif request.guidance is not None:  # FDG: a scale per frequency level
        raise UserError(f"--guider {request.guider} has a guidance scale per frequency level: give them as "
                        "--guider-arg guidance_scales=10,5 instead of --guidance")
    try:
        return guider_from_name(request.guider, **arguments)
    except ValueError as e:
        raise UserError(f"--guider {request.guider}: {e}") from None


def check_refiner(request, family, scheduler, vae) -> float:
    """The --high-noise-frac: --refiner's configs (kilobytes) are an SDXL checkpoint (a refiner or a base) whose
    latents are the base model's, and both halves of the schedule, cut there, run a step."""
    from ..loading.hub import ModelNotFoundError, resolve_folder
    from ..loading.folders import check_pipeline_folder, load_scheduler
    from ..models.config import read_config_file
    from ..families.sdxl import StableDiffusionXLImg2Img
    from ..pipeline.starts import schedule_window
    from ..pipeline.types import Settings
    from ..schedulers.common import for_family

    name = f"--refiner {request.refiner}"
    if family is not StableDiffusionXLImg2Img.family:  # the refiner runs as the base's img2img
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
        refiner_vae, unet = read_configs(folder, StableDiffusionXLImg2Img.family)
        refiner_scheduler = for_family(load_scheduler(folder, request.scheduler), text.ays_family)
    except (ModelNotFoundError, ValueError, TypeError) as e:
        raise UserError(str(e)) from e
    if kind is None or unet.addition_embed_type != "text_time":
        raise UserError(f"{name} is not an SDXL refiner or SDXL checkpoint: give the folder or hub id of one, e.g. "
                        "stabilityai/stable-diffusion-xl-refiner-1.0")
    latent = vae.latent_channels
    if (refiner_vae.latent_channels, unet.in_channels) != (latent, latent) \
            or refiner_vae.scale_factor != vae.scale_factor:
        raise UserError(f"{name} takes other latents than {request.model} ({refiner_vae.latent_channels} "
                        f"channels, UNet input {unet.in_channels}, VAE scale factor "
                        f"{refiner_vae.scale_factor}; the base: {latent}, {latent}, {vae.scale_factor}): give "
                        "a refiner made for this base")
    for which, which_scheduler, cut in (("the base", scheduler, dict(denoising_end=fraction)),
                                        (name, refiner_scheduler, dict(denoising_start=fraction))):
        try:
            schedule_window(which_scheduler, Settings(request.steps, **cut))
        except ValueError:
            raise UserError(f"--high-noise-frac {fraction} with --steps {request.steps} leaves {which} no step: "
                            "raise --steps, or move --high-noise-frac towards 0.5") from None
    return fraction


def single_file_configs(request) -> tuple[str, object, dict | None, bool]:
    """(the folder of configs for a single-file --model, its family, changes to an SD 3.x transformer's config,
    whether it runs without T5): the version is told from the tensor names (a .safetensors header, a .ckpt's
    pickle: the tensors are memory-mapped, not read), the configs are --config's or sdflax's bundled ones for that
    version."""
    from ..loading.files import read_checkpoint
    from ..loading.hub import resolve_folder
    from ..loading.ldm_names import is_sd3_file, sd3_with_prefixes
    from ..loading.folders import check_pipeline_folder
    from ..loading.single_file import NAMES, bundled_config_folder, detect_version, file_contents
    from ..loading.folders import read_index
    from ..families import for_index
    from ..families.sd3 import FAMILY as SD3

    suffix = os.path.splitext(request.model)[1].lower()
    if suffix not in SINGLE_FILE_SUFFIXES:
        raise UserError(f"--model {request.model} is a file but not a {' or '.join(SINGLE_FILE_SUFFIXES)} "
                        "checkpoint: give a single-file checkpoint, a diffusers folder or a hub id")
    try:
        tensors = sd3_with_prefixes(read_checkpoint(os.path.expanduser(request.model)))
        if is_sd3_file(tensors):
            folder, transformer_changes, without_t5 = sd3_file_configs(request, tensors)
            return folder, SD3, transformer_changes, without_t5
        version = detect_version(tensors)
    except ValueError as e:
        raise UserError(f"--model {request.model}: {e}") from e
    if version == "sdxl_refiner":
        raise UserError(f"--model {request.model} is {NAMES[version]} checkpoint (one OpenCLIP text encoder, no "
                        "CLIP ViT-L): a refiner finishes a base model's images and does not draw from a prompt "
                        "alone; give an SD 1.x, 2.x or SDXL base checkpoint")
    family = for_index(read_index(bundled_config_folder(version)))  # the family its bundled configs are
    if request.config is None:
        return bundled_config_folder(version), family, None, False
    contents = file_contents(version)
    folder = resolve_folder(request.config, None, allow_patterns=CONFIG_FILES)
    check_pipeline_folder(folder, f"--config {request.config}", tuple(contents.models), contents.tokenizers)
    return folder, family, None, False


def controlnet_configs(request) -> tuple:
    """Each --controlnet's --controlnet-config: the original-layout files take them in order, the others None."""
    files = [os.path.isfile(os.path.expanduser(name)) for name in request.controlnet]
    given = request.controlnet_config
    if given and not any(files):
        raise UserError("--controlnet-config applies to original-layout --controlnet files (.safetensors, .pth), but "
                        "no --controlnet is one: drop --controlnet-config (a folder or hub id has its config.json)")
    if given and len(given) != sum(files):
        raise UserError(f"{len(given)} --controlnet-config for {sum(files)} original-layout --controlnet files: give "
                        "one per file, in their order")
    configs = iter(given)
    return tuple(next(configs) if is_file and given else None for is_file in files)


def check_controlnets(request, unet, vae_scale_factor):
    """Each --controlnet exists and, where its config.json can be read (a folder's, a hub id's or an original-layout
    file's --controlnet-config: kilobytes), was made for the checkpoint's model family and latent size. An
    original-layout file without one is checked when it loads."""
    from ..loading.hub import ModelNotFoundError, resolve_folder
    from ..models.config import read_config_file
    from ..models.controlnet import ControlNetConfig
    from ..pipeline.controlnet import condition_scale_mismatch

    for name, config_source in zip(request.controlnet, controlnet_configs(request)):
        if os.path.isfile(os.path.expanduser(name)):
            if config_source is None:
                continue
            flag, source = f"--controlnet-config {config_source}", config_source
        else:
            flag, source = f"--controlnet {name}", name
        try:
            folder = resolve_folder(source, None, allow_patterns=["config.json"])
            config = ControlNetConfig.from_dict(read_config_file(os.path.join(folder, "config.json")))
        except (ModelNotFoundError, ValueError, TypeError, OSError) as e:
            raise UserError(f"{flag}: {e}") from e
        if (config.cross_attention_dim, config.addition_embed_type) != (unet.cross_attention_dim,
                                                                        unet.addition_embed_type):
            raise UserError(f"{flag} was made for another model family than {request.model} (text "
                            f"width {config.cross_attention_dim} vs {unet.cross_attention_dim}): use a ControlNet "
                            "trained for this base model")
        if config.condition_scale != vae_scale_factor:
            raise UserError(f"{flag}: {condition_scale_mismatch(config, vae_scale_factor)}")


def check_lora_and_embedding_files(request):
    """Each --lora and --embedding file is there, and no two embeddings claim one token (their file names); whether
    they fit the model is known once it is loaded."""
    for path, _ in request.lora:
        if not os.path.isfile(os.path.expanduser(path)):
            head, _, tail = path.rpartition(":")
            if head and os.path.isfile(os.path.expanduser(head)) and not is_number(tail):
                raise UserError(f"--lora {path}: the scale {tail!r} is not a number: write PATH:SCALE with a number, "
                                f"e.g. {head}:0.7")
            raise UserError(f"--lora {path}: no such file: give the path of a LoRA .safetensors file, with :SCALE "
                            "after it if wanted")
    tokens = {}
    for path in request.embedding:
        if not os.path.isfile(os.path.expanduser(path)):
            raise UserError(f"--embedding {path}: no such file: give the path of a textual-inversion .pt or "
                            ".safetensors file")
        token = os.path.splitext(os.path.basename(path))[0]
        if token in tokens:
            raise UserError(f"--embedding {tokens[token]} and --embedding {path} both give the token {token!r} (the "
                            "file name): rename one of the files")
        tokens[token] = path


def check_attention(request, backend, dtype):
    from ..models.layers import attention_for

    if request.attention == "cudnn" and attention_for(64, dtype) != "cudnn":
        raise UserError(f"--attention cudnn needs an NVIDIA GPU and --dtype bfloat16 (here: {backend}, {dtype}): "
                        "use --attention auto")
    if request.attention == "pallas" and backend != "tpu":
        raise UserError(f"--attention pallas needs a TPU (here: {backend}): use --attention auto")
