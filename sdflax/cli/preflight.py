"""Checks before anything loads: the checkpoint's configs (kilobytes) are read and the request is checked against
them with the library's own checks, so that a size, step count or strength the model cannot take fails before
gigabytes download. Configs only: no model is built here."""

from __future__ import annotations

import dataclasses
import importlib
import os

from .features import having, name, used
from .pictures import fit_pictures
from .request import CONFIG_FILES, SINGLE_FILE_SUFFIXES, UserError


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What the configs say and what the request resolves to with them: the folder, the pipeline class, the
    values left to their defaults (the class's `defaults`, the model's size), and what each feature the request
    uses resolved to."""

    folder: str
    local: bool
    commit: str
    family: object  # its `sdflax.families.Family`
    pipeline: type  # the class of the request's cell: family x start x ControlNet (x T2I-Adapter)
    guidance: float
    height: int
    width: int
    steps: int  # --steps, or the pipeline's default
    without_t5: bool = False  # SD 3.x: run without T5 (asked for, or a checkpoint without it)
    single_file: bool = False  # --model is one .safetensors / .ckpt file; `folder` holds the configs used for it
    strength: float | None = None  # img2img and inpaint: --strength, or the pipeline's default
    scheduler: object = dataclasses.field(default=None, compare=False)  # the one the pipeline loads with
    denoiser: object = dataclasses.field(default=None, compare=False)  # its config (read_denoiser's)
    # a feature's name -> what it resolved to (`features.*.resolve`: the guider, the nets' pictures and scales, ...)
    features: dict = dataclasses.field(default_factory=dict, compare=False)


@dataclasses.dataclass(frozen=True)
class Configs:
    """What a feature checks a request against: the checkpoint's family and its command-line side, the pipeline class
    of the request's cell (its `defaults`), its denoiser's and VAE's configs, its scheduler and the steps; once the
    output size is known, that size and the guidance scale."""

    family: object
    side: object  # the family's command-line side (`Family.cli`)
    pipeline: type
    denoiser: object
    vae: object
    scheduler: object
    steps: int
    height: int | None = None
    width: int | None = None
    guidance: float | None = None


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


def check_checkpoint(request, pictures):
    """(Checkpoint, pictures), the pictures resized to the output size."""
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
    features = used(request)
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
        check_family_flags(request, family, features)
        cls = family.pipeline_class(request.start, False)
        for _, choose in having("pipeline_class", features):
            cls = choose(request, family, cls)
        vae, denoiser = read_configs(folder, family, transformer_changes)
        cls = side.pipeline_class(request, cls, denoiser, vae)  # Flux.1 Fill's inpainting
        defaults = side.defaults(cls, denoiser)
        try:
            scheduler = for_family(load_scheduler(folder, request.scheduler), cls.text.ays_family)
        except ValueError:  # another sampler may not read a flow's config (Flux.1's dynamic shift): say why
            if family.flow and request.scheduler is not None:
                raise UserError(flow_only(request, family)) from None
            raise
        check_scheduler(request, family, scheduler)
        request = dataclasses.replace(request, steps=request.steps or defaults["num_inference_steps"])
        # the step count fits whatever the size: a schedule shifted by the image's tokens (Flux.1's) at any
        sized = scheduler.for_image_seq_len(1) if hasattr(scheduler, "for_image_seq_len") else scheduler
        sized.check_steps(request.steps)
    except (ModelNotFoundError, ValueError, TypeError) as e:
        raise UserError(str(e)) from e
    strength = None
    if pictures and "strength" in defaults:  # SD 3.x's inpainting ControlNet starts from noise: none
        strength = request.strength if request.strength is not None else defaults["strength"]
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
    configs = Configs(family, side, cls, denoiser, vae, scheduler, request.steps)
    side.check_denoiser(request, family, denoiser, vae)
    for _, check in having("check_configs", features):
        check(request, configs)
    step, step_name = side.size_step(denoiser, vae)
    shown = [(name(feature), pictures_of(request)) for feature, pictures_of in having("pictures", features)]
    height, width, pictures, resized = fit_pictures(request, side.default_size(denoiser, vae), step, pictures,
                                                    [given for _, given in shown], step_name)
    side.check_size(request, height, width, denoiser, vae)
    guidance = request.guidance if request.guidance is not None else defaults["guidance_scale"]
    configs = dataclasses.replace(configs, height=height, width=width, guidance=guidance)
    resized = {feature: pictures for (feature, _), pictures in zip(shown, resized)}
    values = {name(feature): resolve(request, configs, resized.get(name(feature), ()))
              for feature, resolve in having("resolve", features)}
    commit = "" if single_file else snapshot_commit(folder) or ""  # a hub --config's commit is not the model's
    checkpoint = Checkpoint(folder, local, commit, family, cls, guidance, height, width, request.steps, without_t5,
                            single_file, strength, scheduler, denoiser, values)
    return checkpoint, pictures


def check_family_flags(request, this, features):
    """A family's own flags (some shared by several: T5's sequence length) for its checkpoints only, and each
    feature for the denoisers it takes."""
    from ..families import registered

    own, takers = {field for _, field in this.flags}, {}
    for other in registered().values():
        for pair in other.flags:
            takers.setdefault(pair, []).append(other.title)
    for (flag, field), titles in takers.items():
        if field not in own and getattr(request, field) not in (None, False, ()):
            raise UserError(f"{flag} is for {' and '.join(titles)} checkpoints, but {request.model} is "
                            f"{with_article(this.title)} checkpoint: drop {flag}")
    denoiser = this.text.denoiser.component
    for feature in features:
        takes = denoiser in getattr(feature, "DENOISERS", (denoiser,)) or this.name in getattr(feature, "FAMILIES", ())
        if not takes:
            raise UserError(f"{feature.FLAG} is not supported with {this.title} checkpoints yet ({request.model} is "
                            f"one): drop {feature.FLAG}")


def with_article(title) -> str:
    """"an SD 3.x", "a Flux.1": SD is spelt out."""
    return f"{'an' if title[:1] in 'AEIOU' or title.startswith('SD') else 'a'} {title}"


def check_scheduler(request, family, scheduler):
    """A flow-matching scheduler for a flow family's denoiser (SD 3.x's transformer) and for no UNet."""
    flow = getattr(scheduler.config, "prediction_type", None) == "flow"
    if family.flow and not flow:
        raise UserError(flow_only(request, family))
    if not family.flow and flow:
        from ..families import registered

        flows = " and ".join(other.title for other in registered().values() if other.flow)
        raise UserError(f"--scheduler {request.scheduler} is flow-matching Euler, for {flows}; {request.model}'s "
                        "UNet predicts noise: choose another sampler")


def flow_only(request, family) -> str:
    given = f"--scheduler {request.scheduler}" if request.scheduler else f"{request.model}'s scheduler"
    return (f"{given}: {family.title}'s {family.text.denoiser.component} samples with flow-matching Euler (A1111's "
            "Euler, flow_match_euler): give --scheduler Euler")


def single_file_configs(request) -> tuple[str, object, dict | None, bool]:
    """(the folder of configs for a single-file --model, its family, changes to its denoiser's config, whether it
    runs without T5): the family is told from the tensor names (a .safetensors header, a .ckpt's pickle: the
    tensors are memory-mapped, not read), the configs are --config's or sdflax's bundled ones (its family's side
    says, `file_configs`)."""
    from ..loading.files import read_checkpoint
    from ..families import for_single_file

    suffix = os.path.splitext(request.model)[1].lower()
    if suffix not in SINGLE_FILE_SUFFIXES:
        raise UserError(f"--model {request.model} is a file but not a {' or '.join(SINGLE_FILE_SUFFIXES)} "
                        "checkpoint: give a single-file checkpoint, a diffusers folder or a hub id")
    try:
        tensors = read_checkpoint(os.path.expanduser(request.model))
        family, _ = for_single_file(tensors)
        folder, changes, without_t5 = command_line_side(family).file_configs(request, tensors)
    except ValueError as e:
        raise UserError(f"--model {request.model}: {e}") from e
    return folder, family, changes, without_t5


def config_folder(request, family, what: str, give: str) -> tuple[str, dict]:
    """(the folder, its model_index.json) of --config for a single-file --model of `family` (`what` the file is):
    a diffusers folder or hub id of that family's, or one line saying what to `give`."""
    from ..families import for_index
    from ..loading.folders import check_pipeline_folder, read_index
    from ..loading.hub import resolve_folder
    from .request import CONFIG_FILES

    folder = resolve_folder(request.config, None, allow_patterns=CONFIG_FILES)
    check_pipeline_folder(folder, f"--config {request.config}", (), ())  # model_index.json, the scheduler's
    index = read_index(folder)
    if for_index(index) is not family:
        raise UserError(f"--config {request.config} is a {index.get('_class_name')} checkpoint, but --model "
                        f"{request.model} is {what}: give {give}")
    return folder, index


def check_attention(request, backend, dtype):
    from ..models.layers import attention_for

    if request.attention == "cudnn" and attention_for(64, dtype) != "cudnn":
        raise UserError(f"--attention cudnn needs an NVIDIA GPU and --dtype bfloat16 (here: {backend}, {dtype}): "
                        "use --attention auto")
    if request.attention == "pallas" and backend != "tpu":
        raise UserError(f"--attention pallas needs a TPU (here: {backend}): use --attention auto")
