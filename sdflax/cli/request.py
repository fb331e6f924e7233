"""What one run asks for (`Request`), built from the command line or a line of a prompt file, and the one error
type a user sees (`UserError`)."""

from __future__ import annotations

import dataclasses

DEFAULT_MODEL = "stable-diffusion-v1-5/stable-diffusion-v1-5"
CONFIG_FILES = ["model_index.json", "*/config.json", "scheduler/*", "tokenizer/*", "tokenizer_2/*"]
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")  # --model as one file in the CompVis / A1111 / SGM layout
MAX_PICTURE_SIDE = 8192  # every picture flag: at most 8192x8192 pixels (64 Mpx), read from the header
STARTS = {"generate": "noise", "img2img": "image", "inpaint": "image_mask"}  # command -> the pipeline's start


class UserError(Exception):
    """Something the user can fix; the message is one line that names it and says how."""


def flag_error(flag, path, error) -> UserError:
    """The library's message (an error or its text) about a file, led by the flag that named it."""
    message = str(error)
    return UserError(f"{flag} {message}" if message.startswith(path) else f"{flag} {path}: {message}")


def input_errors() -> tuple[type, ...]:
    """The library's error types for bad files and arguments: their message is the one line a user sees, wherever
    in a command they are raised (imported late: they are only needed once something failed)."""
    from ..loading.files import CheckpointFileError
    from ..hooks.core import LayerError
    from ..loading.hub import ModelNotFoundError
    from ..loading.lora import LoraMismatchError
    from ..models.config import ConfigError
    from ..loading.single_file import SingleFileError
    from ..loading.weights import CheckpointMismatchError

    return CheckpointFileError, ConfigError, CheckpointMismatchError, LayerError, LoraMismatchError, \
        ModelNotFoundError, SingleFileError


@dataclasses.dataclass(frozen=True)
class Request:
    """One run: `generate`, `img2img` or `inpaint`. None means "the default" (the checkpoint's, the pipeline
    class's, or one drawn at run time for the seed)."""

    command: str
    prompt: str
    negative_prompt: str = ""
    prompt_2: str | None = None
    negative_prompt_2: str | None = None
    prompt_3: str | None = None  # SD 3.x's T5 prompt
    negative_prompt_3: str | None = None
    no_t5: bool = False  # SD 3.x loaded without T5 (its states zeros, as diffusers' text_encoder_3=None)
    max_sequence_length: int | None = None  # SD 3.x and Flux.1: T5's tokens
    slg_layers: tuple[int, ...] = ()  # SD 3.x's skip-layer guidance: the transformer blocks skipped
    slg_scale: float | None = None
    true_cfg: float | None = None  # Flux.1's classifier-free guidance scale (--guidance is its distilled guidance)
    reference: str | None = None  # Flux.1 Kontext's picture to edit
    model: str = DEFAULT_MODEL
    revision: str | None = None
    config: str | None = None  # with a single-file model: the folder or hub id of its configs
    refiner: str | None = None
    high_noise_frac: float | None = None
    image: str | None = None
    mask: str | None = None
    strength: float | None = None
    controlnet: tuple[str, ...] = ()
    controlnet_config: tuple[str, ...] = ()  # one per original-layout file of `controlnet`, in their order
    control_image: tuple[str, ...] = ()
    control_scale: tuple[float, ...] = ()
    control_mode: tuple[int, ...] = ()  # a Flux Union ControlNet's mode of each --control-image
    ip_adapter: tuple[tuple[str, float], ...] = ()  # (file or hub file, scale), from one folder
    ip_image: tuple[str, ...] = ()  # one per `ip_adapter`, in their order
    ip_image_encoder: str | None = None  # a folder, hub id or hub folder; None: image_encoder/ beside the files
    t2i_adapter: tuple[str, ...] = ()  # T2I-Adapter folders or hub ids
    adapter_image: tuple[str, ...] = ()  # one per `t2i_adapter`, in their order
    adapter_scale: tuple[float, ...] = ()  # none, one for all, or one per adapter
    adapter_factor: float | None = None  # SDXL's: the fraction of the steps the adapters steer
    vae: str | None = None  # a VAE folder, hub id or single file in place of the checkpoint's
    vae_tiling: bool = False  # decode in overlapping tiles (diffusers' enable_tiling)
    plain_prompt: bool = False  # the prompts as diffusers reads them, not A1111's syntax
    clip_skip: int | None = None  # A1111's Clip skip (diffusers' clip_skip + 1)
    hires: float | None = None  # A1111's hires fix: the upscale of the latents, then img2img
    hires_strength: float | None = None
    hires_steps: int | None = None
    lora: tuple[tuple[str, float], ...] = ()  # (path, scale), merged in order
    embedding: tuple[str, ...] = ()
    scheduler: str | None = None
    eta: float | None = None  # the scheduler's eta (DDIM, DPM++ 3M SDE, TCD); None: its own
    steps: int | None = None  # None: the pipeline's default (50; 28 for SD 3.x)
    guidance: float | None = None
    guider: str | None = None  # sdflax.guiders' name, with `guider_arg` ((key, value), ...) its arguments
    guider_arg: tuple = ()
    height: int | None = None
    width: int | None = None
    seed: int | None = None
    num_images: int | None = None
    dtype: str | None = None
    attention: str = "auto"
    out: str = "outputs"
    grid: bool = False
    progress: bool | None = None  # None: status lines; True: and a step bar; False: results only
    cache_dir: str | None = None
    trajectory: str | None = None  # OUT.webp: the first image's decoded x̂₀ at every evaluation
    trajectory_sheet: str | None = None  # OUT.png: the same side by side, with their σ
    attention_maps: tuple[str, ...] = ()  # words of the prompt: their cross-attention heat maps

    @classmethod
    def from_args(cls, args, **changes) -> Request:
        """From an argparse Namespace: the fields it has (a command may lack some options), then `changes`."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        values = {**values, **changes}
        return cls(**{key: tuple(value) if isinstance(value, list) else value for key, value in values.items()})

    @property
    def start(self) -> str:
        """The pipeline's start: "noise", "image" or "image_mask"."""
        return STARTS[self.command]


@dataclasses.dataclass(frozen=True)
class Made:
    """What a run made, for the features that write more pictures from it (a trajectory, attention maps)."""

    pipeline: object
    params: object
    checkpoint: object
    images: object  # (B, H, W, 3) in [0, 1], this process's rows
    trajectory: object  # the call's trajectory (None unless a feature asked for one)
    seeds: list
    paths: list  # the PNGs written, one per kept image
