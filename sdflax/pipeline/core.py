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
from ..loading.pipelines import PipelineLoaders
from ..models import T2IAdapter
from ..schedulers import Scheduler, scheduler_from_config
from ..schedulers.common import for_family
from . import checks
from .controlnet import ControlNet
from .generate import generate, generate_fn
from .images import numpy_to_pil, preprocess_ip_adapter_masks, preprocess_pictures
from .ip_adapter import load_ip_adapter
from .runner import Runner
from .starts import FromNoise, is_inpainting_unet
from .t2i_adapter import T2IAdapters
from .text import SDText, prompt_length
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


class Pipeline(PipelineLoaders):
    """What every pipeline shares; its loading calls are `sdflax.loading.pipelines.PipelineLoaders`'. A row of the
    table sets the class attributes: the family's text piece, the start, the UNet wrappers, `__call__`'s signature."""

    text = SDText
    start = FromNoise
    wrappers = ()
    signature: inspect.Signature
    renamed = {}  # argument names that differ from the Inputs field they fill (`defaults`: the table's)
    hooks = ()  # sdflax.hooks in every call (`with_hooks`)
    ip_adapter = None  # ip_adapter.IPAdapter (`load_ip_adapter`)
    ip_adapter_piece = staticmethod(load_ip_adapter)  # what `load_ip_adapter` makes the piece with
    conditionings = ()  # a user's conditionings (`with_conditioning`), the last outermost
    # what a scheduler name is built from (`scheduler`): the checkpoint's scheduler_config.json with the loader's
    # overrides, as from_pretrained builds a name; None (a pipeline made here): the current scheduler's config
    scheduler_base_config = None

    def __init__(self, **components):
        """The family's components by name, as `from_pretrained` loads them (`component_names()`), and its
        conditioning nets (`nets`: a UNet's `controlnet=` and `adapter=`, a ControlNet row's `controlnet=`), one or a
        list (their params in params["controlnet"] and params["adapter"], a list for a list)."""
        given = given_components(type(self), components)
        for name in (*self.text.models, *self.text.tokenizers):
            setattr(self, name, given[name])
        self.denoiser = self.text.denoiser(given[self.text.denoiser.component])
        self.controlnets, self.adapters = (given[name] for name in ("controlnet", "adapter"))
        self.dtype = given["dtype"]
        self._scheduler = fitting_scheduler(given["scheduler"], type(self).__name__, self.text)
        self._force_zeros = bool(given.get("force_zeros_for_empty_prompt", True))
        self.requires_aesthetics_score = bool(given.get("requires_aesthetics_score", False))  # an SDXL refiner's
        self.text.check_components(SimpleNamespace(**self.components()))
        self.vae_scale_factor = self.vae.config.scale_factor
        self.max_length = prompt_length(self.components())
        self.empty_prompt_ids = self.text.prepare_ids(self.parts(), [""])
        self._runners = {}  # spec -> its programs, shared with the hooked views (`with_hooks`)
        self._spec = None

    @classmethod
    def component_names(cls) -> tuple:
        """What the constructor takes: this family's components, its options, and a UNet's conditioning nets."""
        return (*cls.text.models, *cls.text.tokenizers, "scheduler", "dtype", *cls.text.index_options, *nets(cls))

    def components(self) -> dict:
        """The constructor's arguments that made this pipeline."""
        own = {"scheduler": self.scheduler, "dtype": self.dtype, "controlnet": list(self.controlnets) or None,
               "adapter": list(self.adapters) or None, "force_zeros_for_empty_prompt": self.force_zeros_for_empty_prompt,
               "requires_aesthetics_score": self.requires_aesthetics_score}
        return {name: own[name] if name in own else getattr(self, name) for name in self.component_names()}

    def parts(self) -> SimpleNamespace:
        """The components as the text piece reads them, a value, with the prompts' token length."""
        return SimpleNamespace(**self.components(), max_length=self.max_length)

    def prepare_ip_adapter_image(self, images):
        """Pictures (PIL or arrays; one, or a list) -> `ip_adapter_image=`, the image encoder's pixels."""
        return ip_adapter_pixels(self.ip_adapter, images)

    def prepare_ip_adapter_masks(self, masks, height, width):
        """One adapter's masks (PIL or arrays, one per picture; white: the picture acts there) -> its entry of
        `ip_adapter_masks=[...]`, as diffusers' IPAdapterMaskProcessor.preprocess."""
        return preprocess_ip_adapter_masks(masks, height, width, self.vae_scale_factor)

    def replace(self, **components):
        """A pipeline of this class with some components replaced (and this one's hooks and conditionings)."""
        pipeline = type(self)(**{**self.components(), **components})
        pipeline.hooks, pipeline.scheduler_base_config = self.hooks, self.scheduler_base_config
        pipeline.ip_adapter = self.ip_adapter
        for piece in self.conditionings:
            pipeline = pipeline.with_conditioning(piece)
        return pipeline

    def with_conditioning(self, piece):
        """This pipeline with `piece`, a conditioning (docs/extending.md), wrapping its denoiser in every call,
        outside its own; `__call__` takes the piece's `arguments` too, after its own, with their defaults."""
        view = copy.copy(self)
        view.conditionings, view._spec = (*self.conditionings, piece), None
        view.signature = signature_with(self.signature, piece, type(self).__name__)
        return view

    def with_hooks(self, *hooks):
        """This pipeline with `sdflax.hooks` inside its UNet (the first outermost; what they emit: `trajectory.hooks`)
        in place of its hooks, its guider kept, sharing its programs: hooks that differ in numbers only share one."""
        view = copy.copy(self)
        view.hooks = (*(hook for hook in self.hooks if isinstance(hook, Guider)), *hooks)
        return view

    def with_guider(self, guider):
        """This pipeline with `guider` (`sdflax.guiders`, diffusers' classes) combining the UNet's predictions in
        every call, in place of the call's `guidance_scale` and `guidance_rescale` (None: none, the pipeline's own
        guidance); sharing its compiled programs, so a guider that differs only in its numbers never recompiles."""
        if guider is not None and not isinstance(guider, Guider):
            raise TypeError(f"with_guider takes a guider from sdflax.guiders (e.g. ClassifierFreeGuidance(7.5)), "
                            f"not {type(guider).__name__}")
        view = copy.copy(self)
        guiders = () if guider is None else (jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), guider),)
        view.hooks = (*guiders, *(hook for hook in self.hooks if not isinstance(hook, Guider)))
        return view

    @property
    def spec(self) -> Spec:
        """The pieces this pipeline runs (`types.Spec`), made from the components and the table row."""
        if self._spec is None:
            vae = VAE(self.vae, self.text.upcast_vae(self.vae))
            # an adapter given to any pipeline (a ControlNet one too) joins the row's own wrappers
            extra = (T2IAdapters,) if self.adapters and T2IAdapters not in self.wrappers else ()
            wrappers = (*((self.ip_adapter,) if self.ip_adapter else ()),  # innermost: the UNet's layers only
                        *(wrapper.build(self.parts(), vae, self.denoiser) for wrapper in (*extra, *self.wrappers)),
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
        # a new spec: the old one's programs stay cached, for a scheduler set back
        self._scheduler = fitting_scheduler(scheduler, type(self).__name__, self.text)
        self._spec = None

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
        if self.spec not in self._runners:
            self._runners[self.spec] = Runner(generate_fn)
        return self._runners[self.spec]

    @property
    def _jitted(self):
        """The one-device program (its `_cache_size()` counts compiles)."""
        return self._runner.jit

    numpy_to_pil = staticmethod(numpy_to_pil)

    def encode_prompt(self, params, prompt_ids, *options):
        """The text encoders' output for ids (SD: states; SDXL: (states, pooled)); SD's options: weights, clip_skip."""
        return self.spec.text.encode_prompt(params, prompt_ids, *options)

    def decode_latents(self, params, latents):
        """Latents as the UNet sees them -> images (B, H, W, 3) in [0, 1]."""
        return self.spec.vae.decode(params, latents)

    def generate(self, params, inputs: Inputs, settings: Settings):
        """`sdflax.generate` with this pipeline's spec: a pure function of `params` and `inputs`, compiled."""
        return generate(self.spec, params, inputs, settings)

    def _call(self, args, kwargs):
        """`__call__`: jit on one device, or pmap over the local devices (`jit=True`)."""
        jit = bind(self.signature, args, kwargs)["jit"]
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
        out = generate_fn(self.spec, *self._checked(args, kwargs, without_jit(self.signature), None, None))
        return tuple(out) if out.trajectory is not None else out.images

    def generate_sharded(self, *args, mesh=None, **kwargs):
        """`__call__`'s arguments (but `jit`) run by jit + NamedSharding, the batch split over a one-axis mesh (the
        local devices): (B, H, W, 3) numpy images, or (images, trajectory); on several processes, this one's rows."""
        params, inputs, settings = self._checked(args, kwargs, without_jit(self.signature), "generate_sharded", 1)
        with checks.params_named_in_errors(type(self).__name__):
            out = self._runner.run_sharded(self.spec, params, inputs, settings, mesh)
        images = own_rows(out.images, 0)
        return images if out.trajectory is None else (images, jax.tree.map(lambda x: own_rows(x, 1), out.trajectory))

    def _checked(self, args, kwargs, signature, mode, leading_dims):
        """(params, Inputs, Settings) from a call's arguments, checked (`mode`, `leading_dims`: see checks)."""
        values = bind(signature, args, kwargs)
        values.pop("jit", None)
        params = values.pop("params")
        checks.check_params(self.spec, params, mode, type(self).__name__)
        return (params, *checks.split(self.spec, values, leading_dims, self.renamed, self.hooks, self.defaults))


CONDITIONING_PROTOCOL = ("params_name", "picture", "arguments", "call_inputs", "wrap")
# the conditioning nets a pipeline's wrappers are built from: their argument, their class, how to give them
NEEDED_NETS = {T2IAdapters: ("adapter", T2IAdapter, "a T2IAdapter (or a list of them) from "
                             "sdflax.T2IAdapter.from_pretrained")}


def nets(cls) -> tuple:
    """The conditioning nets a pipeline class takes: a UNet's ControlNets and T2I-Adapters, else its row's nets."""
    if cls.text.denoiser.component == "unet":
        return ("controlnet", "adapter")
    return ("controlnet",) if control_piece(cls) else ()


def control_piece(cls):
    """The ControlNet piece of a pipeline class's row (`ControlNet`, or its SD 3 sibling), or None."""
    return next((wrapper for wrapper in cls.wrappers if issubclass(wrapper, ControlNet)), None)


def needed_nets(cls) -> dict:
    """The conditioning nets a pipeline class's wrappers are built from: their argument, their class, how to give
    them (the ControlNets of the class's own piece, a UNet's otherwise)."""
    control = control_piece(cls) or ControlNet
    return {control: ("controlnet", control.net_class, control.net_needs), **NEEDED_NETS}


def given_components(cls, components: dict) -> dict:
    """A pipeline class's constructor arguments, checked, with their defaults; the conditioning nets as tuples."""
    names = cls.component_names()
    if unknown := sorted(set(components) - set(names)):
        nets = " (ControlNets and T2I-Adapters are for UNets)" if {"controlnet", "adapter"} & set(unknown) else ""
        raise TypeError(f"{cls.__name__} takes no {', '.join(unknown)}{nets}; its components: {', '.join(names)}")
    given = {**dict.fromkeys(names), "dtype": jnp.float32, **components}
    for name in (cls.text.denoiser.component, "vae", "scheduler"):
        if given[name] is None:
            raise ValueError(f"{cls.__name__} needs {name}= (from_pretrained loads every component)")
    for name, model_class in cls.text.models.items():
        if given[name] is not None and not isinstance(given[name], model_class):
            raise TypeError(f"{cls.__name__}: {name}= takes a {model_class.__name__} (as from_pretrained loads it), "
                            f"not {type(given[name]).__name__} {given[name]!r:.60}")
    for name in ("controlnet", "adapter"):
        net = given.get(name)
        given[name] = () if net is None else tuple(net) if isinstance(net, (list, tuple)) else (net,)
    for wrapper, (name, net_class, what) in needed_nets(cls).items():
        if wrapper in cls.wrappers and not given[name]:
            raise ValueError(f"{cls.__name__} needs {name}=: {what}")
        if wrong := [net for net in given.get(name, ()) if not isinstance(net, net_class)]:
            raise TypeError(f"{cls.__name__}: {name}= takes {what}, not {type(wrong[0]).__name__} {wrong[0]!r:.60}")
    return given


def fitting_scheduler(scheduler, pipeline_name: str, text):
    """A scheduler checked (a flow-matching one for a flow model, no other), its "auto" Align Your Steps levels
    or a flow's σ spacing the family's (`text`: its text piece)."""
    scheduler, flow = checked_scheduler(scheduler), text.denoiser.flow
    predicts_flow = getattr(getattr(scheduler, "config", None), "prediction_type", None) == "flow"
    if predicts_flow and not flow:  # a UNet predicts ε or v
        raise ValueError(f"{type(scheduler).__name__} is a flow-matching scheduler, for SD 3.x and Flux checkpoints; "
                         f"{pipeline_name}'s UNet predicts noise: choose one of sdflax.schedulers.SCHEDULERS' other "
                         "samplers")
    if flow and not predicts_flow:
        raise ValueError(f"{pipeline_name}'s transformer predicts a flow's velocity: it samples with a flow-matching "
                         f"scheduler ('flow_match_euler', A1111's 'Euler'), not {type(scheduler).__name__}")
    if predicts_flow:
        return scheduler.with_sigma_spacing(text.sigma_spacing)
    return for_family(scheduler, text.ays_family)


def signature_with(signature: inspect.Signature, piece, pipeline_name: str) -> inspect.Signature:
    """`__call__`'s signature with a conditioning's arguments after its own."""
    lacking = [name for name in CONDITIONING_PROTOCOL if not hasattr(piece, name)]
    if lacking:
        raise TypeError(f"with_conditioning takes a conditioning (docs/extending.md); {type(piece).__name__} has no "
                        f"{', '.join(lacking)}")
    taken = [name for name in piece.arguments if name in signature.parameters]
    if taken:
        raise ValueError(f"{type(piece).__name__}'s arguments {taken} are {pipeline_name}'s already: name them "
                         "otherwise")
    kind = inspect.Parameter.KEYWORD_ONLY
    return signature.replace(parameters=[*signature.parameters.values(), *(
        inspect.Parameter(name, kind, default=default) for name, default in piece.arguments.items())])


def ip_adapter_pixels(piece, images):
    """`prepare_ip_adapter_image`: pictures -> the IP-Adapter's image encoder's pixels."""
    if piece is None or piece.image_encoder is None:
        raise ValueError("prepare_ip_adapter_image needs an IP-Adapter with its image encoder: "
                         "pipeline.load_ip_adapter(params, ...) first")
    return piece.prepare_image(images)


def prepared_inputs(text, parts, vae_scale_factor, prompts, texts: dict, pictures: dict):
    """`prepare_inputs` (its signature is the table's): token ids, (B, 77) int32 for SD, (B, 2, 77) for SDXL,
    (B, 77 + 77 + max_sequence_length) for SD 3, padded and truncated as diffusers does; with pictures,
    `(ids, *arrays)` in the order `__call__` takes them. SD and SDXL with `weighting="a1111"`: A1111's prompt
    syntax, `(ids, weights, *arrays)`, ids and weights (B, 77 k) (SDXL (B, 2, 77 k)) for `prompt_weights=`."""
    prompts, texts = prompt_lists(prompts, texts)
    ids = text.prepare_ids(parts, prompts, **texts)
    if all(picture is None for picture in pictures.values()):
        return ids
    return *(ids if isinstance(ids, tuple) else (ids,)), *preprocess_pictures(pictures, vae_scale_factor)


def prompt_lists(prompts, texts: dict) -> tuple:
    """(prompts, the other prompt arguments) as lists: `prompts_*` one string, a list, or None / empty (the prompts
    themselves, as diffusers)."""
    if not (isinstance(prompts, str) or isinstance(prompts, (list, tuple)) and all(
            isinstance(p, str) for p in prompts)):
        raise TypeError(f"prompts must be a string or a list of strings, got {prompts!r:.60}")
    texts = {name: (None if not value else [value] if isinstance(value, str) else list(value))
             if name.startswith("prompts_") else value for name, value in texts.items()}
    return [prompts] if isinstance(prompts, str) else list(prompts), texts


def bind(signature: inspect.Signature, args, kwargs) -> dict:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def without_jit(signature: inspect.Signature) -> inspect.Signature:
    return signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "jit"])


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


def own_rows(x, axis):
    """A batch split over a mesh as numpy: all of it, or on a mesh spanning several processes the rows of this
    process's devices (the others' rows are not here to copy)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda shard: shard.index[axis].start or 0)
    return np.concatenate([np.asarray(shard.data) for shard in shards], axis)
