"""`Pipeline`: the models, tokenizers and scheduler of one checkpoint (the weights live in the params you pass in),
and the calls every pipeline answers the same way. Which pieces a pipeline runs and its public argument order
come from its row of the table (`table.py`); the checks are in `checks.py`, the computation in `generate.py`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from types import SimpleNamespace
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from ..guiders import Guider
from ..schedulers import Scheduler, scheduler_from_config
from ..schedulers.common import for_family
from . import checks
from .controlnet import ControlNet
from .generate import generate, generate_fn
from .images import numpy_to_pil, preprocess_pictures
from .runner import Runner
from .starts import FromNoise, is_inpainting_unet
from .t2i_adapter import T2IAdapters
from .text import SDText
from .types import Inputs, Settings, Spec
from .vae import VAE


@flax.struct.dataclass
class StableDiffusionOutput:
    """`.images`: float numpy in [0, 1], (B, H, W, 3), or (devices, B, H, W, 3) with jit=True (with
    output_type="latent": the latents, (B, C, h, w)). `output[0]` too."""

    images: Any
    trajectory: Any = None  # sampling.Trajectory with return_trajectory=True

    def __getitem__(self, index):
        return (self.images,)[index]


class Pipeline:
    """What every pipeline shares. A row of the table sets the class attributes: the family's text conditioning
    (`text`), the start kind (`start`), the UNet wrappers (`wrappers`), and `signature`, `__call__`'s."""

    text = SDText
    start = FromNoise
    wrappers = ()
    signature: inspect.Signature
    renamed = {}  # argument names that differ from the Inputs field they fill
    hooks = ()  # sdflax.hooks in every call (`with_hooks`)
    ip_adapter = None  # ip_adapter.IPAdapter (`load_ip_adapter`)
    conditionings = ()  # a user's conditionings (`with_conditioning`), the last outermost

    def __init__(self, **components):
        """The family's components by name, as `from_pretrained` loads them (`components()` gives them back): its
        models and tokenizers (`text.models`, `text.tokenizers`), `scheduler`, `dtype`, the options its
        model_index.json may hold (`text.index_options`) and, on a UNet, `controlnet=` and `adapter=` (a
        ControlNetModel or T2IAdapter, or a list of them; their params go in params["controlnet"] and
        params["adapter"], a list for a list)."""
        names = self.component_names()
        if unknown := sorted(set(components) - set(names)):
            nets = " (ControlNets and T2I-Adapters are for UNets)" if {"controlnet", "adapter"} & set(unknown) else ""
            raise TypeError(f"{type(self).__name__} takes no {', '.join(unknown)}{nets}; its components: "
                            f"{', '.join(names)}")
        given = {**dict.fromkeys(names), "dtype": jnp.float32, **components}
        for name in (*self.text.models, *self.text.tokenizers):
            setattr(self, name, given[name])
        denoiser = self.text.denoiser.component
        for name in (denoiser, "vae", "scheduler"):
            if given[name] is None:
                raise ValueError(f"{type(self).__name__} needs {name}= (from_pretrained loads every component)")
        self.denoiser = self.text.denoiser(given[denoiser])
        self.controlnets, self.adapters = (() if given.get(name) is None else tuple(given[name])
                                           if isinstance(given[name], (list, tuple)) else (given[name],)
                                           for name in ("controlnet", "adapter"))
        if ControlNet in self.wrappers and not self.controlnets:
            raise ValueError(f"{type(self).__name__} needs controlnet=: a ControlNetModel (or a list of them) from "
                             "ControlNetModel.from_pretrained")
        if T2IAdapters in self.wrappers and not self.adapters:
            raise ValueError(f"{type(self).__name__} needs adapter=: a T2IAdapter (or a list of them) from "
                             "sdflax.T2IAdapter.from_pretrained")
        self.dtype = given["dtype"]
        self._scheduler = self._own(given["scheduler"])
        self._force_zeros = bool(given.get("force_zeros_for_empty_prompt", True))
        # SDXL refiner: an aesthetic score time id
        self.requires_aesthetics_score = bool(given.get("requires_aesthetics_score", False))
        self.text.check_components(SimpleNamespace(**self.components()))
        self.vae_scale_factor = self.vae.config.scale_factor
        # Tokenizers saved without model_max_length report a huge one; the text encoder knows its length (an SDXL
        # refiner has the second encoder alone).
        tokenizer, text_encoder = next((getattr(self, t), getattr(self, e)) for t, e in (
            ("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")) if getattr(self, e, None) is not None)
        self.max_length = min(tokenizer.model_max_length, text_encoder.config.max_position_embeddings)
        self.empty_prompt_ids = self.text.prepare_ids(self.parts(), [""])
        self._runners = {}  # spec -> its programs, shared with the hooked views (`with_hooks`)
        # what a scheduler name is built from (`scheduler`): the checkpoint's scheduler_config.json with the loader's
        # overrides, as from_pretrained builds a name; None (a pipeline made here): the current scheduler's config
        self.scheduler_base_config = None
        self._spec = None

    @classmethod
    def component_names(cls) -> tuple:
        """What the constructor takes: this family's components, its options, and a UNet's conditioning nets."""
        nets = ("controlnet", "adapter") if cls.text.denoiser.component == "unet" else ()
        return (*cls.text.models, *cls.text.tokenizers, "scheduler", "dtype", *cls.text.index_options, *nets)

    # ---- loading ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_repo_id, revision=None, dtype=jnp.float32, scheduler=None,
                        scheduler_config=None, variant=None, attention="auto", **components):
        """(pipeline, params) from a diffusers checkpoint folder or hub id; `scheduler="ddim"` swaps the kind,
        `scheduler_config={...}` single values; other components are passed on (`controlnet=`)."""
        from ..loading.pipelines import load_folder

        parts, params, base = load_folder(cls.text, path_or_repo_id, revision, dtype, scheduler, scheduler_config,
                                          variant, attention, components)
        return cls.made_from(parts, components, base), params

    @classmethod
    def from_single_file(cls, path, config=None, dtype=jnp.float32, prediction_type=None, scheduler=None,
                         scheduler_config=None, attention="auto", revision=None, **components):
        """(pipeline, params) from one .safetensors / .ckpt file in the CompVis / A1111 or SGM layout (SD 3.x:
        Stability's); configs from `config` or bundled defaults (docs/checkpoints.md); other components are passed
        on (`text_encoder_3=None`: SD 3 without T5)."""
        from ..loading.pipelines import load_file

        parts, params, base = load_file(cls.family, cls.__name__, path, config, dtype, prediction_type, scheduler,
                                        scheduler_config, attention, revision, components)
        return cls.made_from(parts, components, base), params

    @classmethod
    def made_from(cls, parts, components, scheduler_base_config):
        pipeline = cls(**{**parts, **components})
        pipeline.scheduler_base_config = scheduler_base_config
        return pipeline

    def load_lora(self, params, path, scale=1.0):
        """params with a LoRA file (kohya/A1111 or diffusers/PEFT) merged into the UNet and text encoder(s). Pure:
        LoRAs stack by calling it again (`sdflax.loading.lora.merge_lora` merges under jit with a traced `scale`)."""
        from ..loading.lora import load_lora

        self._unet_only("LoRAs")
        return load_lora(params, path, scale, self.unet.config)

    def _unet_only(self, what):
        if self.denoiser.component != "unet":
            raise ValueError(f"{type(self).__name__}: {what} are for UNet checkpoints (SD 1.x, 2.x, SDXL); SD 3.x's "
                             "are not supported yet")

    def load_textual_inversion(self, params, path, token=None):
        """(pipeline, params) with a textual-inversion embedding added (A1111 .pt/.safetensors, diffusers
        learned_embeds; SDXL's clip_l + clip_g): a new pipeline whose tokenizer(s) know the token. Pure."""
        from ..loading.embeddings import load_textual_inversion

        self._unet_only("textual-inversion embeddings")
        parts, params = load_textual_inversion(self.components(), params, path, token)
        return self.replace(**parts), params

    def load_ip_adapter(self, params, pretrained_model_name_or_path, subfolder="models", weight_name=None,
                        image_encoder_folder="image_encoder", revision=None):
        """(pipeline, params) with IP-Adapters (h94's files, as diffusers' `load_ip_adapter`: a hub id or folder,
        its `subfolder` and `weight_name`, a list of names for several adapters) and their CLIP image encoder
        (`image_encoder_folder`: a name under `subfolder`, or with a "/" a folder of the repository's own, as
        diffusers; None: only `ip_adapter_image_embeds` are given). Pure: this pipeline and params are unchanged."""
        from .ip_adapter import load_ip_adapter

        self._unet_only("IP-Adapters")
        piece, added = load_ip_adapter(self.unet, self.dtype, pretrained_model_name_or_path, subfolder, weight_name,
                                       image_encoder_folder, revision)
        view = copy.copy(self)
        view.ip_adapter, view._spec = piece, None
        return view, {**params, **added}

    def prepare_ip_adapter_image(self, images):
        """Pictures (PIL or arrays; one, or a list) -> the image encoder's pixels, float32 (N, 3, h, w), as
        diffusers' CLIPImageProcessor makes them: `ip_adapter_image=`."""
        from .clip_image import clip_image_inputs

        if self.ip_adapter is None or self.ip_adapter.image_encoder is None:
            raise ValueError("prepare_ip_adapter_image needs an IP-Adapter with its image encoder: "
                             "pipeline.load_ip_adapter(params, ...) first")
        side = self.ip_adapter.image_encoder.config.image_size
        return clip_image_inputs(images, size=side, crop_size=side)

    def prepare_ip_adapter_masks(self, masks, height, width):
        """One adapter's masks (PIL or arrays, one per picture) -> float32 (1, n, height, width) of 0 and 1 (white:
        the picture acts there), as diffusers' IPAdapterMaskProcessor.preprocess and the reshape its docs show:
        `ip_adapter_masks=[...]`, one per adapter (None: everywhere)."""
        from .images import preprocess_ip_adapter_masks

        return preprocess_ip_adapter_masks(masks, height, width, self.vae_scale_factor)

    def components(self) -> dict:
        """The constructor's arguments that made this pipeline."""
        own = {"scheduler": self.scheduler, "dtype": self.dtype, "controlnet": list(self.controlnets) or None,
               "adapter": list(self.adapters) or None, "force_zeros_for_empty_prompt": self.force_zeros_for_empty_prompt,
               "requires_aesthetics_score": self.requires_aesthetics_score}
        return {name: own[name] if name in own else getattr(self, name) for name in self.component_names()}

    def parts(self) -> SimpleNamespace:
        """The components as the text piece reads them, a value (`text.SDText.prepare_ids`), with the prompts'
        token length."""
        return SimpleNamespace(**self.components(), max_length=self.max_length)

    def replace(self, **components):
        """A pipeline of this class with some components replaced (and this one's hooks)."""
        pipeline = type(self)(**{**self.components(), **components})
        pipeline.hooks, pipeline.scheduler_base_config = self.hooks, self.scheduler_base_config
        pipeline.ip_adapter = self.ip_adapter
        for piece in self.conditionings:
            pipeline = pipeline.with_conditioning(piece)
        return pipeline

    def with_conditioning(self, piece):
        """This pipeline with `piece`, a conditioning (docs/extending.md: `params_name`, `picture`, `arguments`,
        `call_inputs`, `wrap`), wrapping its denoiser in every call, outside its own; `__call__` takes the piece's
        `arguments` too, after its own, with their defaults."""
        lacking = [name for name in CONDITIONING_PROTOCOL if not hasattr(piece, name)]
        if lacking:
            raise TypeError(f"with_conditioning takes a conditioning (docs/extending.md); {type(piece).__name__} has no "
                            f"{', '.join(lacking)}")
        taken = [name for name in piece.arguments if name in self.signature.parameters]
        if taken:
            raise ValueError(f"{type(piece).__name__}'s arguments {taken} are {type(self).__name__}'s already: name "
                             "them otherwise")
        kind = inspect.Parameter.KEYWORD_ONLY
        view = copy.copy(self)
        view.conditionings, view._spec = (*self.conditionings, piece), None
        view.signature = self.signature.replace(parameters=[*self.signature.parameters.values(), *(
            inspect.Parameter(name, kind, default=default) for name, default in piece.arguments.items())])
        return view

    def with_hooks(self, *hooks):
        """This pipeline with `sdflax.hooks` inside its UNet (the first listed outermost) in place of its hooks
        (its guider stays), sharing its compiled programs; hooks that differ only in their numbers share a program.
        What they emit: `trajectory.hooks`."""
        view = copy.copy(self)
        view.hooks = (*(hook for hook in self.hooks if isinstance(hook, Guider)), *hooks)
        return view

    def with_guider(self, guider):
        """This pipeline with `guider` (`sdflax.guiders`, diffusers' classes) combining the UNet's predictions in
        every call, in place of the call's `guidance_scale` and `guidance_rescale` (None: none, the pipeline's own
        guidance); sharing its compiled programs, so a guider that differs only in its numbers (scales, momentum)
        never recompiles. Hooks stay."""
        if guider is not None and not isinstance(guider, Guider):
            raise TypeError(f"with_guider takes a guider from sdflax.guiders (e.g. ClassifierFreeGuidance(7.5)), "
                            f"not {type(guider).__name__}")
        view = copy.copy(self)
        guiders = () if guider is None else (jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), guider),)
        view.hooks = (*guiders, *(hook for hook in self.hooks if not isinstance(hook, Guider)))
        return view

    # ---- what generate runs -------------------------------------------------------------------------------
    @property
    def spec(self) -> Spec:
        """The pieces this pipeline runs (`types.Spec`), made from the components and the table row."""
        if self._spec is None:
            vae = VAE(self.vae, self.text.upcast_vae(self.vae))
            # an adapter given to any pipeline (a ControlNet one too) joins the row's own wrappers
            extra = (T2IAdapters,) if self.adapters and T2IAdapters not in self.wrappers else ()
            wrappers = (*((self.ip_adapter,) if self.ip_adapter else ()),  # innermost: the UNet's layers only
                        *(wrapper(getattr(self, wrapper.component)) for wrapper in (*extra, *self.wrappers)),
                        *self.conditionings)
            self._spec = Spec(self.text.build(self.parts(), self.empty_prompt_ids), self.start.build(vae, self.denoiser),
                              self.denoiser, vae, self._scheduler, wrappers)
        return self._spec

    @property
    def scheduler(self):
        return self._scheduler

    @scheduler.setter
    def scheduler(self, scheduler):
        """A scheduler object, or a name (sdflax's, diffusers' class name or A1111's, as `from_pretrained` takes)
        built from the current scheduler's config."""
        if isinstance(scheduler, str):
            scheduler = scheduler_by_name(scheduler, self.scheduler_base_config or config_dict(self._scheduler))
        self._scheduler, self._spec = self._own(scheduler), None  # a new spec: old programs stay cached

    def _own(self, scheduler):
        """A scheduler checked (a flow-matching one for a flow model, no other), its "auto" Align Your Steps levels
        this family's."""
        flow = getattr(getattr(scheduler, "config", None), "prediction_type", None) == "flow"
        if flow and not self.denoiser.flow:  # a UNet predicts ε or v
            raise ValueError(f"{type(scheduler).__name__} is a flow-matching scheduler, for SD 3.x checkpoints; "
                             f"{type(self).__name__}'s UNet predicts noise: choose one of sdflax.schedulers.SCHEDULERS'"
                             " other samplers")
        if self.denoiser.flow and not flow and isinstance(scheduler, Scheduler):
            raise ValueError(f"{type(self).__name__}'s transformer predicts a flow's velocity: it samples with a "
                             f"flow-matching scheduler ('flow_match_euler', A1111's 'Euler'), not "
                             f"{type(scheduler).__name__}")
        return for_family(checked_scheduler(scheduler), self.text.ays_family)

    @property
    def force_zeros_for_empty_prompt(self) -> bool:
        return self._force_zeros

    @force_zeros_for_empty_prompt.setter
    def force_zeros_for_empty_prompt(self, value):
        self._force_zeros, self._spec = bool(value), None

    @property
    def inpainting_unet(self) -> bool:
        """True for a 9-channel inpainting UNet, False for an ordinary one (the known region is pasted back)."""
        return is_inpainting_unet(self.vae.config.latent_channels, self.denoiser.in_channels)

    @property
    def _runner(self) -> Runner:
        """The programs of this pipeline's current spec (a scheduler set back finds its programs again)."""
        spec = self.spec
        if spec not in self._runners:
            self._runners[spec] = Runner(generate_fn)
        return self._runners[spec]

    @property
    def _jitted(self):
        """The one-device program (its `_cache_size()` counts compiles)."""
        return self._runner.jit

    # ---- inputs and outputs -------------------------------------------------------------------------------
    def _prepare(self, prompts, texts: dict, pictures: dict):
        """`prepare_inputs` (its signature is the table's): token ids, (B, 77) int32 for SD, (B, 2, 77) for SDXL,
        (B, 77 + 77 + max_sequence_length) for SD 3, padded and truncated as diffusers does; with pictures,
        `(ids, *arrays)` in the order `__call__` takes them."""
        if not (isinstance(prompts, str) or isinstance(prompts, (list, tuple)) and all(
                isinstance(p, str) for p in prompts)):
            raise TypeError(f"prompts must be a string or a list of strings, got {prompts!r:.60}")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        for name in [name for name in texts if name.startswith("prompts_")]:  # one string, a list, or None / empty
            value = texts[name]  # (empty: the prompts themselves, as diffusers)
            texts[name] = None if not value else [value] if isinstance(value, str) else list(value)
        ids = self.text.prepare_ids(self.parts(), prompts, **texts)
        if all(picture is None for picture in pictures.values()):
            return ids
        return ids, *preprocess_pictures(pictures, self.vae_scale_factor)

    numpy_to_pil = staticmethod(numpy_to_pil)

    def encode_prompt(self, params, prompt_ids):
        """The text encoders' output for ids (SD: states (B, 77, D); SDXL: (states, pooled))."""
        return self.spec.text.encode_prompt(params, prompt_ids)

    def decode_latents(self, params, latents):
        """Latents as the UNet sees them -> images (B, H, W, 3) in [0, 1]."""
        return self.spec.vae.decode(params, latents)

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, params, inputs: Inputs, settings: Settings):
        """`sdflax.generate` with this pipeline's spec: a pure function of `params` and `inputs`, compiled."""
        return generate(self.spec, params, inputs, settings)

    def _call(self, args, kwargs):
        """`__call__`: jit on one device, or pmap over the local devices (`jit=True`)."""
        jit = self._bind(args, kwargs, self.signature)["jit"]
        params, inputs, settings = self._checked(args, kwargs, self.signature, f"jit={jit}", 2 if jit else 1)
        if jit:
            checks.check_devices(inputs)
        with checks.params_named_in_errors(type(self).__name__):
            out = (self._runner.pmap if jit else self._runner.jit)(self.spec, params, inputs, settings)
        return StableDiffusionOutput(np.asarray(out.images), jax.tree.map(np.asarray, out.trajectory))

    def _generate(self, *args, **kwargs):
        """The pure function of `__call__`'s arguments (but `jit`): images (B, H, W, 3) in [0, 1], or
        `(images, sampling.Trajectory)` with `return_trajectory=True` or hooks that emit values (`with_hooks`).
        jit, pmap, vmap and grad apply to it."""
        out = generate_fn(self.spec, *self._checked(args, kwargs, self.signature_without_jit(), None, None))
        return tuple(out) if out.trajectory is not None else out.images

    def generate_sharded(self, *args, mesh=None, **kwargs):
        """`__call__`'s arguments (but `jit`) run by jit + NamedSharding: the batch (B, ...) split over a one-axis
        device mesh (default: the local devices), plain params; one key per device or per image. (B, H, W, 3)
        numpy images, or (images, trajectory); on a mesh of several processes, this process's rows."""
        params, inputs, settings = self._checked(args, kwargs, self.signature_without_jit(), "generate_sharded", 1)
        with checks.params_named_in_errors(type(self).__name__):
            out = self._runner.run_sharded(self.spec, params, inputs, settings, mesh)
        images = _own_rows(out.images, 0)
        if out.trajectory is None:  # no return_trajectory, no hook that emits
            return images
        return images, jax.tree.map(lambda x: _own_rows(x, 1), out.trajectory)

    def _checked(self, args, kwargs, signature, mode, leading_dims):
        """(params, Inputs, Settings) from a call's arguments, checked (`mode`, `leading_dims`: see checks)."""
        values = self._bind(args, kwargs, signature)
        values.pop("jit", None)
        params = values.pop("params")
        checks.check_params(self.spec, params, mode, type(self).__name__)
        return (params, *checks.split(self.spec, values, leading_dims, self.renamed, self.hooks))

    def signature_without_jit(self) -> inspect.Signature:
        return self.signature.replace(parameters=[p for p in self.signature.parameters.values() if p.name != "jit"])

    @staticmethod
    def _bind(args, kwargs, signature) -> dict:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)


CONDITIONING_PROTOCOL = ("params_name", "picture", "arguments", "call_inputs", "wrap")


def scheduler_by_name(name: str, config: dict):
    """The scheduler `name` built from a scheduler config dict, as `from_pretrained(..., scheduler=name)` builds it
    from the checkpoint's."""
    try:
        return scheduler_from_config(config, name)
    except ValueError as e:
        raise ValueError(f"pipeline.scheduler = {name!r}: {e}") from None


def config_dict(scheduler) -> dict:
    config = scheduler.config
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)


def checked_scheduler(scheduler):
    """`scheduler` if it follows the scheduler protocol (`sdflax.schedulers.Scheduler`), else a TypeError now
    rather than at the next call."""
    if not isinstance(scheduler, Scheduler):
        raise TypeError(f"scheduler must be an sdflax scheduler object or, for pipeline.scheduler, a name such as "
                        f"'dpmpp_2m' or 'DPM++ 2M Karras'; got {type(scheduler).__name__} {scheduler!r:.60}")
    return scheduler


def _own_rows(x, axis):
    """A batch split over a mesh as numpy: all of it, or on a mesh spanning several processes the rows of this
    process's devices (the others' rows are not here to copy)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda shard: shard.index[axis].start or 0)
    return np.concatenate([np.asarray(shard.data) for shard in shards], axis)
