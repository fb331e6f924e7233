"""Pipelines with the API of diffusers' Flax walkthrough, each a choice of pieces run by one `generate`.

`Pipeline` holds the models, tokenizers and scheduler (the weights live in the params dict you pass in) and does
what every pipeline does the same way: loading, prompts to ids, the checks before compiling, and running
`generate.generate` under jit, pmap or jit + NamedSharding through one `runner.Runner`. A pipeline class names
its two pieces and its public argument order:

    class StableDiffusion(Pipeline):
        conditioning = SDText      # which text encoders, ids -> UNet conditioning (conditioning.py)
        start = FromNoise          # where the latents start (latents.py)
        def __call__(self, prompt_ids, params, prng_seed, num_inference_steps=50, ...): ...

`_generate(...)` (the pure function of `__call__`'s arguments but `jit`) and `generate_sharded(...)` follow
from `__call__`'s signature.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import numbers
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from . import conditioning as text
from .generate import Inputs, Settings, generate
from .latents import FromNoise, is_latent_image, schedule_window
from .runner import Runner

_INPUTS = tuple(f.name for f in dataclasses.fields(Inputs))
_SETTINGS = tuple(f.name for f in dataclasses.fields(Settings))


@flax.struct.dataclass
class StableDiffusionOutput:
    """`.images`: float numpy in [0, 1], (B, H, W, 3), or (devices, B, H, W, 3) with jit=True (with
    output_type="latent": the latents, (B, C, h, w)). `output[0]` too."""

    images: Any
    trajectory: Any = None  # sampling.Trajectory with return_trajectory=True

    def __getitem__(self, index):
        return (self.images,)[index]


class Pipeline:
    """What every pipeline shares; subclasses set `conditioning`, `start` and write `__call__`."""

    conditioning = text.SDText
    start = FromNoise
    controls = ()  # UNet wrappers (ControlNet), see generate.generate
    hooks = ()  # sdflax.hooks in every call (`with_hooks`)
    renamed = {}  # __call__'s argument names that differ from the Inputs field they fill

    def __init__(self, text_encoder, unet, vae, tokenizer, scheduler, dtype=jnp.float32, *, text_encoder_2=None,
                 tokenizer_2=None, force_zeros_for_empty_prompt=True, requires_aesthetics_score=False, controlnet=None):
        self.text_encoder, self.text_encoder_2, self.unet, self.vae = text_encoder, text_encoder_2, unet, vae
        # one ControlNet module or a list of them; their params go in params["controlnet"] (a list for a list)
        self.controlnets = () if controlnet is None else tuple(controlnet) if isinstance(controlnet, (list, tuple)) \
            else (controlnet,)
        if self.controls and not self.controlnets:
            raise ValueError(f"{type(self).__name__} needs controlnet=: a ControlNetModel (or a list of them) from "
                             "ControlNetModel.from_pretrained")
        self.tokenizer, self.tokenizer_2, self.dtype = tokenizer, tokenizer_2, dtype
        self.scheduler = scheduler
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
        self.requires_aesthetics_score = bool(requires_aesthetics_score)  # SDXL refiner: an aesthetic score time id
        self.conditioning.check_components(self)
        self.vae_scale_factor = vae.config.scale_factor
        # Tokenizers saved without model_max_length report a huge one; the text encoder knows its length. (An SDXL
        # refiner has the second encoder alone.)
        tokenizer, text_encoder = (tokenizer, text_encoder) if text_encoder is not None else (tokenizer_2,
                                                                                              text_encoder_2)
        self.max_length = min(tokenizer.model_max_length, text_encoder.config.max_position_embeddings)
        self.empty_prompt_ids = self.conditioning.prepare_ids(self, [""])

    # ---- loading ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_repo_id, revision=None, dtype=jnp.float32, scheduler=None,
                        scheduler_config=None, variant=None, attention="auto", **components):
        """(pipeline, params) from a diffusers checkpoint folder or hub id.

        `scheduler="ddim"` swaps the kind and keeps the checkpoint's config values; `scheduler_config={...}`
        overrides single values. `params = {"text_encoder": ..., "unet": ..., "vae": ...}` (SDXL: and
        "text_encoder_2"). Other components are passed on as given (`controlnet=`).
        """
        from .loading import load_pipeline

        c = cls.conditioning
        parts, params = load_pipeline(path_or_repo_id, c.models, c.tokenizers, c.index_options, revision, dtype,
                                      scheduler, scheduler_config, variant, attention, c.optional)
        return cls(**parts, **components), params

    @classmethod
    def from_single_file(cls, path, config=None, dtype=jnp.float32, prediction_type=None, scheduler=None,
                         scheduler_config=None, attention="auto", revision=None):
        """(pipeline, params) from one .safetensors / .ckpt file in the CompVis / A1111 (SD 1.x, 2.x) or SGM
        (SDXL) layout.

        The version is read from the tensor names. Model, tokenizer and scheduler configs come from `config` (a
        diffusers folder or hub id) or, without it, from stable-diffusion-v1-5 / stable-diffusion-2-1 /
        stable-diffusion-xl-base-1.0 defaults bundled with sdflax; those assume v-prediction for SD 2.x: pass
        `prediction_type="epsilon"` for a 512 px SD 2.x base model. The params equal what `from_pretrained`
        gives for the converted checkpoint."""
        from .single_file import load_single_file

        parts, params = load_single_file(path, config, dtype, prediction_type, scheduler, scheduler_config,
                                         attention, revision, family=cls.conditioning, pipeline=cls.__name__)
        return cls(**parts), params

    def load_lora(self, params, path, scale=1.0):
        """params with a LoRA file (kohya/A1111 or diffusers/PEFT) merged into the UNet and text encoder(s).

        Pure: `params` is not changed, so LoRAs stack by calling it again. See `sdflax.lora.merge_lora` for a
        jit-able merge with a traced `scale`."""
        from .lora import load_lora

        return load_lora(params, path, scale, self.unet.config)

    def load_textual_inversion(self, params, path, token=None):
        """params with a textual-inversion embedding (A1111 .pt/.safetensors, diffusers learned_embeds) added.

        The token (and `token_1`, ... for a multi-vector embedding) joins this pipeline's tokenizer, so use the
        returned params with this pipeline; `prepare_inputs` expands the token to all its vectors. SDXL files
        (`clip_l` and `clip_g` tensors) extend both tokenizers and both text encoders."""
        from .textual_inversion import load_textual_inversion

        return load_textual_inversion(self, params, path, token)

    def with_hooks(self, *hooks):
        """This pipeline with `sdflax.hooks` inside its UNet (the first listed outermost): the same models and
        compiled-program cache, each call's `Inputs.hooks` set to them. A new hook set compiles once; hooks that
        differ only in their numbers (a scale) share the program. What hooks emit comes back in
        `output.trajectory.hooks`."""
        view = copy.copy(self)
        view.hooks = tuple(hooks)
        return view

    # ---- the pieces' state --------------------------------------------------------------------------------
    @property
    def scheduler(self):
        return self._scheduler

    @scheduler.setter
    def scheduler(self, scheduler):
        self._scheduler = scheduler
        self._runner = Runner(self.generate)  # compiled programs baked the old scheduler in

    @property
    def force_zeros_for_empty_prompt(self):
        return self._force_zeros_for_empty_prompt

    @force_zeros_for_empty_prompt.setter
    def force_zeros_for_empty_prompt(self, value):
        self._force_zeros_for_empty_prompt = bool(value)
        self._runner = Runner(self.generate)  # compiled programs baked the old choice in

    @property
    def _jitted(self):
        """The one-device program (its `_cache_size()` counts compiles)."""
        return self._runner.jit

    # ---- inputs -------------------------------------------------------------------------------------------
    def prepare_inputs(self, prompts, prompts_2=None) -> np.ndarray:
        """Token ids: (B, 77) int32 for SD, (B, 2, 77) for SDXL, padded and truncated as diffusers does. SDXL:
        `prompts_2` (diffusers' prompt_2) go to the second tokenizer and text encoder instead of `prompts`."""
        if not prompts_2:  # as diffusers: no or an empty prompt_2 is prompt
            return self.conditioning.prepare_ids(self, _as_prompts(prompts))
        if len(self.conditioning.tokenizers) < 2:
            raise ValueError("prompts_2 is for SDXL's second text encoder; this pipeline has one: give prompts alone")
        return self.conditioning.prepare_ids(self, _as_prompts(prompts), _as_prompts(prompts_2))

    @staticmethod
    def numpy_to_pil(images):
        """Float images in [0, 1], (..., H, W, 3) -> list of PIL images."""
        from PIL import Image

        images = np.asarray(images)
        images = images.reshape(-1, *images.shape[-3:])
        return [Image.fromarray((image * 255).round().astype(np.uint8)) for image in images]

    def encode_prompt(self, params, prompt_ids):
        """The text encoders' output for ids (SD: states (B, 77, D); SDXL: (states, pooled))."""
        return self.conditioning.encode_prompt(self, params, prompt_ids)

    def decode_latents(self, params, latents):
        """Latents as the UNet sees them -> images (B, H, W, 3) in [0, 1]."""
        return text.decode(self, params, latents)

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, params, inputs: Inputs, settings: Settings):
        """`generate.generate` with this pipeline's pieces: a pure function of `params` and `inputs`."""
        return generate(self, params, inputs, settings)

    def _generate(self, *args, **kwargs):
        """The pure function of `__call__`'s arguments (but `jit`): images (B, H, W, 3) in [0, 1], or
        `(images, sampling.Trajectory)` with `return_trajectory=True` or hooks that emit values (`with_hooks`).
        jit, pmap, vmap and grad apply to it."""
        args = self._bind(args, kwargs)
        params = args.pop("params")
        self._check_params(params, None)
        inputs, settings = self._split(args, leading_dims=None)
        out = self.generate(params, inputs, settings)
        return tuple(out) if out.trajectory is not None else out.images

    def _bind(self, args, kwargs) -> dict:
        """`__call__`'s arguments, defaults filled in, from a call with `__call__`'s signature less `jit`."""
        signature = inspect.signature(type(self).__call__)
        parameters = [p for name, p in signature.parameters.items() if name not in ("self", "jit")]
        bound = signature.replace(parameters=parameters).bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def _split(self, args: dict, leading_dims):
        """(Inputs, Settings) from a call's arguments, checked before anything is traced or compiled.
        `leading_dims`: 1 for (B, ...) inputs, 2 for pmap's (devices, B, ...), None inside a trace (no checks
        that need concrete values)."""
        steps = args["num_inference_steps"]
        self.scheduler.check_steps(steps)
        for name in ("height", "width"):
            _check_size(name, args.get(name))
        if args.get("output_type", "np") not in ("np", "latent"):
            raise ValueError(f"output_type={args['output_type']!r}: 'np' (images in [0, 1]) or 'latent' (the latents, "
                             "undecoded, e.g. for a refiner)")
        window = {name: args[name] for name in ("strength", "denoising_start", "denoising_end") if name in args}
        schedule_window(self.scheduler, Settings(steps, **window))  # checked before anything is traced
        args = {self.renamed.get(name, name): value for name, value in args.items()}
        values = {name: args[name] for name in _INPUTS if args.get(name) is not None}
        for name in [name for name, _ in self.start.images] + ["control_image"] * bool(self.controls):
            values[name] = jax.tree.map(_float32_array, values[name])
        values.setdefault("guidance_rescale", 0.0)
        for name in Inputs.shared_fields():  # arrays, so that a Python float and an array share one program
            if name in values:
                values[name] = jnp.asarray(values[name], jnp.float32)
        inputs = Inputs(**values, hooks=self.hooks or None)
        if leading_dims is not None:
            self.conditioning.check_inputs(inputs)
            self._check_shapes(inputs, leading_dims)
            self._check_values(inputs, leading_dims)
        height, width = self._sizes(*self._image_size(inputs, leading_dims, args.get("height"), args.get("width")))
        inputs = self.conditioning.fill_inputs(inputs, height, width)
        settings = Settings(**{**{name: args[name] for name in _SETTINGS if name in args},
                               "height": height, "width": width,
                               # a guidance function of the user's combines both halves at any scale
                               "classifier_free_guidance": args.get("guidance") is not None
                               or _guided(args["guidance_scale"])})
        return inputs, settings

    def _sizes(self, height, width):
        f = self.vae_scale_factor
        height = height or self.unet.config.sample_size * f
        width = width or self.unet.config.sample_size * f
        for name, value in (("height", height), ("width", width)):
            if value % f:
                raise ValueError(f"{name}={value} is not a multiple of the VAE scale factor {f}: "
                                 f"use {value // f * f} or {(value // f + 1) * f}")
        return height, width

    def _check_shapes(self, inputs, leading_dims):
        tail = self.conditioning.ids_tail(self)
        ids = inputs.prompt_ids if inputs.prompt_ids is not None else inputs.prompt_embeds
        if ids is None:
            raise ValueError("give prompt_ids (from pipeline.prepare_inputs(prompts)) or prompt_embeds")
        sharded = " and shard()" if leading_dims == 2 else ""
        for name in ("prompt_ids", "neg_prompt_ids"):
            value = getattr(inputs, name)
            if value is not None and (value.ndim != leading_dims + len(tail) or value.shape[-len(tail):] != tail):
                expected = ("(devices, batch, " if leading_dims == 2 else "(batch, ") + ", ".join(map(str, tail)) + ")"
                both = " (ids of both tokenizers)" if len(tail) == 2 else ""
                raise ValueError(f"{name} has shape {value.shape}; expected {expected}{both}: make it with "
                                 f"pipeline.prepare_inputs(prompts){sharded}")
        for name, twin in (("neg_prompt_ids", "prompt_ids"), ("neg_prompt_embeds", "prompt_embeds")):
            a, b = getattr(inputs, name), getattr(inputs, twin)
            if a is not None and b is not None and a.shape != b.shape:
                raise ValueError(f"{name} {a.shape} and {twin} {b.shape} differ: give one negative prompt per prompt")
        batch = ids.shape[:leading_dims]
        make = "pipeline.prepare_inputs(prompts, " + ", ".join(f"{name}s" for name, _ in self.start.images) + ")"
        size = None
        for name, channels in self.start.images:
            x = getattr(inputs, name)
            channels = channels if isinstance(channels, tuple) else (channels,)  # (3, 4): RGB, or latents
            expected = ("(devices, B, " if leading_dims == 2 else "(B, ") + f"{' or '.join(map(str, channels))}, H, W)"
            if x.ndim != leading_dims + 3 or x.shape[-3] not in channels:
                raise ValueError(f"{name} has shape {x.shape}; expected {expected}: make it with {make}{sharded}")
            if x.shape[:leading_dims] != batch:
                raise ValueError(f"{name} has shape {x.shape} for prompt_ids of {ids.shape}: give one {name} per "
                                 "prompt")
            if size is not None and x.shape[-2:] != size:
                raise ValueError(f"{name} is {x.shape[-1]}x{x.shape[-2]} but the image is {size[1]}x{size[0]}: "
                                 f"give a {name} of the image's size")
            size = x.shape[-2:]

    def _check_values(self, inputs, leading_dims):
        """Keys, token ids and scales of the right kind: what jax would otherwise accept and run into garbage (a
        (3,) guidance scale broadcast over the latent width) or fail on deep inside the trace."""
        _check_key(inputs.prng_seed, leading_dims)
        vocab = min(encoder.config.vocab_size for encoder in (self.text_encoder, self.text_encoder_2) if encoder)
        for name in ("prompt_ids", "neg_prompt_ids"):
            _check_ids(name, getattr(inputs, name), vocab)
        for name in ("guidance_scale", "guidance_rescale"):
            value = getattr(inputs, name)
            if value.ndim:
                raise ValueError(f"{name} must be one number, got an array of shape {value.shape}")
            if not isinstance(value, jax.core.Tracer) and not np.isfinite(np.asarray(value)):
                raise ValueError(f"{name} must be a finite number, got {float(value)}")

    def _check_params(self, params, mode: str | None):
        """params hold every model this pipeline runs, with a leading device axis exactly when pmap runs them.
        `mode`: "jit=True" (pmap), "jit=False", "generate_sharded", or None inside a caller's trace (either)."""
        # every model this pipeline has (an SDXL refiner has no first text encoder), and its ControlNets
        needed = [name for name in self.conditioning.models if getattr(self, name) is not None]
        needed += ["controlnet"] * bool(self.controls)
        if not isinstance(params, Mapping):
            raise TypeError(f"params must be the dict from from_pretrained ({', '.join(needed)}), got "
                            f"{type(params).__name__}")
        missing = [name for name in needed if name not in params]
        if missing:
            raise ValueError(f"params has no {', '.join(map(repr, missing))} (it has {', '.join(map(repr, params))}): "
                             f"pass the params from {type(self).__name__}.from_pretrained")
        kernel = params["unet"].get("conv_in", {}).get("kernel") if isinstance(params["unet"], Mapping) else None
        if kernel is None or mode is None:
            return
        replicated = mode == "jit=True"
        if kernel.ndim == 5 and not replicated:
            raise ValueError(f"params are replicated (a leading device axis), but {mode} takes them as "
                             "from_pretrained gives them: pass unreplicated params, or call with jit=True")
        if kernel.ndim == 4 and replicated:
            raise ValueError("jit=True runs under pmap and needs replicated params: sdflax.replicate(params)")
        if kernel.ndim == 5 and kernel.shape[0] != jax.local_device_count():
            raise ValueError(f"params are replicated for {kernel.shape[0]} devices, but there are "
                             f"{jax.local_device_count()}: sdflax.replicate(params) on this machine")

    def _image_size(self, inputs, leading_dims, height, width):
        """(height, width): the images' for pipelines that take images (a given height/width must agree), else as
        given."""
        sizes = [(name, self._pixels(getattr(inputs, name))) for name, _ in self.start.images]
        for control in self.controls:
            if leading_dims is not None:
                control.check(self, inputs, leading_dims, _batch(inputs).shape[:leading_dims])
            sizes.append(("the control image", control.size(inputs)))
        if not sizes:
            return height, width
        (first, actual), *others = sizes
        for name, size in others:
            if tuple(size) != tuple(actual):
                raise ValueError(f"{name} is {size[1]}x{size[0]} but {first} is {actual[1]}x{actual[0]}: give "
                                 "images of one size")
        for name, given, side in (("height", height, actual[0]), ("width", width, actual[1])):
            if given is not None and given != side:
                raise ValueError(f"{name}={given} but the image is {side}: resize the image, or leave {name} out")
        return tuple(actual)

    def _pixels(self, image):
        """(H, W) of an image, or of the image that latents (an image with the latent channels) decode to."""
        f = self.vae_scale_factor if is_latent_image(self, image) else 1
        return tuple(side * f for side in image.shape[-2:])

    def _run(self, args: dict):
        """`__call__`'s work, given its `locals()`: jit on one device, or pmap over the local devices (`jit=True`)."""
        args = {name: value for name, value in args.items() if name != "self"}
        jit, params = args.pop("jit"), args.pop("params")
        self._check_params(params, f"jit={jit}")
        inputs, settings = self._split(args, 2 if jit else 1)
        if jit:
            devices = _batch(inputs).shape[0]
            if devices != jax.local_device_count():
                raise ValueError(f"prompt_ids lead with {devices}, but there are {jax.local_device_count()} devices: "
                                 "shard(prompt_ids) splits a batch divisible by the device count")
            if inputs.prng_seed.shape[0] != devices:
                raise ValueError(f"prng_seed leads with {inputs.prng_seed.shape[0]} for {devices} devices: one key "
                                 "per device (jax.random.split(key, devices)), or shard(keys) with one key per image")
            out = self._runner.pmap(params, inputs, settings)
        else:
            out = self._runner.jit(params, inputs, settings)
        return StableDiffusionOutput(np.asarray(out.images), jax.tree.map(np.asarray, out.trajectory))

    def generate_sharded(self, *args, mesh=None, **kwargs):
        """The `jit` + `NamedSharding` path, with `__call__`'s arguments (but `jit`): the batch (B, ...) is split
        over a one-axis device mesh (default: all local devices); params are plain (not `replicate`d).
        `prng_seed` holds one key per device, (devices, 2) as for `jit=True`, device d's rows then drawing from
        key d so that the images equal the pmap path's, or one key per image. Returns (B, H, W, 3) numpy
        images, or (images, trajectory) with `return_trajectory=True` (trajectory leaves (evals, B, ...)). On a
        mesh of several processes' devices (`jax.distributed`), every process passes the whole batch and gets
        back the rows of its own devices, in the mesh's order."""
        args = self._bind(args, kwargs)
        params = args.pop("params")
        self._check_params(params, "generate_sharded")
        inputs, settings = self._split(args, 1)
        out = self._runner.run_sharded(params, inputs, settings, mesh)
        images = _own_rows(out.images, 0)
        if out.trajectory is None:  # no return_trajectory, no hook that emits
            return images
        return images, jax.tree.map(lambda x: _own_rows(x, 1), out.trajectory)


def _guided(guidance_scale) -> bool:
    """Classifier-free guidance runs for scales above 1, as diffusers decides; at 1 or below the UNet sees only
    the conditional batch. A scale traced by the caller's own jit keeps guidance on (its value is unknown)."""
    if isinstance(guidance_scale, jax.core.Tracer):
        return True
    return bool(np.any(np.asarray(guidance_scale) > 1))


def _check_size(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0):
        raise ValueError(f"{name} must be a positive whole number of pixels (or None for the default), got {value!r}")


@functools.cache
def _raw_key_size() -> int:
    """uint32 words in a raw key of the default PRNG implementation (2 for threefry), made once per process
    rather than on every call."""
    return jax.random.PRNGKey(0).shape[-1]


def _check_key(key, leading_dims):
    """One PRNG key or one per image ((devices, ...) first under pmap): typed (`jax.random.key`) or raw uint32
    (`jax.random.PRNGKey`)."""
    raw_size = _raw_key_size()
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key) if hasattr(key, "dtype") else False
    if not typed and not (hasattr(key, "dtype") and key.dtype == np.uint32 and key.ndim and key.shape[-1] == raw_size):
        what = f"a {key.dtype} array of shape {key.shape}" if hasattr(key, "dtype") else repr(key)
        raise TypeError(f"prng_seed must be a PRNG key (jax.random.PRNGKey(seed) or jax.random.key(seed)), got "
                        f"{what:.200}")
    key_dims = key.ndim - (0 if typed else 1)  # the dimensions that count keys
    if leading_dims == 2 and key_dims not in (1, 2):
        raise ValueError(f"prng_seed has shape {key.shape}: jit=True needs one key per device, "
                         "jax.random.split(key, jax.local_device_count()), or shard(keys) with one key per image")
    if leading_dims == 1 and key_dims > 1:
        raise ValueError(f"prng_seed has shape {key.shape}: give one key, or one key per image (B, ...)")


def _check_ids(name, ids, vocab_size):
    if ids is None:
        return
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name} must be integer token ids (pipeline.prepare_inputs(prompts)), got {ids.dtype}")
    if isinstance(ids, jax.core.Tracer):
        return
    low, high = int(np.min(ids)), int(np.max(ids))
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}, outside the text encoder's vocabulary [0, {vocab_size}): "
                         "make the ids with pipeline.prepare_inputs(prompts)")


def _batch(inputs):
    return inputs.prompt_ids if inputs.prompt_ids is not None else inputs.prompt_embeds


def _as_prompts(prompts):
    return [prompts] if isinstance(prompts, str) else list(prompts)


def _own_rows(x, axis):
    """A batch split over a mesh as numpy: all of it, or on a mesh spanning several processes the rows of this
    process's devices (the others' rows are not here to copy)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda shard: shard.index[axis].start or 0)
    return np.concatenate([np.asarray(shard.data) for shard in shards], axis)


def _float32_array(x):
    return x if isinstance(x, jax.Array) else np.asarray(x, np.float32)


class StableDiffusion(Pipeline):
    """Text-to-image with SD 1.x / 2.x checkpoints."""

    conditioning, start = text.SDText, FromNoise

    def __call__(self, prompt_ids, params, prng_seed, num_inference_steps=50, height=None, width=None,
                 guidance_scale=7.5, latents=None, neg_prompt_ids=None, jit=False, callback=None,
                 guidance_rescale=0.0, guidance=None, return_trajectory=False, prompt_embeds=None,
                 neg_prompt_embeds=None):
        """Images (B, H, W, 3) in [0, 1]. With `jit=True` the inputs are sharded over devices (`sdflax.shard`),
        params replicated (`sdflax.replicate`), and the call runs under `jax.pmap`: (devices, B, H, W, 3).

        `prng_seed`: one key (one per device with `jit=True`), or one per image. `latents` (B, 4, h, w):
        standard-normal start noise (scaled by the scheduler's initial σ, as diffusers). `prompt_embeds`
        (B, 77, D) replace `prompt_ids`' encoding (pass `None` ids). `guidance(uncond, cond, scale)` replaces
        classifier-free guidance (see `sampling`); `guidance_rescale` is diffusers' (0 turns it off).
        `callback(step, num_steps, latents)` runs on the host after every step (once per device under pmap).
        `return_trajectory=True` fills `output.trajectory` (a `sampling.Trajectory` of (evals, B, ...) numpy
        arrays; (devices, evals, B, ...) with `jit=True`). `callback`, `guidance`, `return_trajectory`, the
        step count and the size are static; everything else is traced and never recompiles.
        """
        return self._run(locals())
