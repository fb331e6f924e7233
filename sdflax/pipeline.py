"""StableDiffusion: text -> images in one compiled program, with the API of diffusers' Flax walkthrough."""

from __future__ import annotations

import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from . import sampling
from .models import AutoencoderKL, CLIPTextModel, UNet2DConditionModel
from .schedulers import scheduler_from_config
from .textual_inversion import expand_prompts

COMPONENTS = ("text_encoder", "unet", "vae")


@flax.struct.dataclass
class StableDiffusionOutput:
    """`.images`: float numpy in [0, 1], (B, H, W, 3), or (devices, B, H, W, 3) with jit=True. `output[0]` too."""

    images: Any
    trajectory: Any = None  # sampling.Trajectory with return_trajectory=True

    def __getitem__(self, index):
        return (self.images,)[index]

    @classmethod
    def of(cls, out, return_trajectory=False):
        """From what `_generate` returned: images, or (images, trajectory)."""
        if return_trajectory:
            images, trajectory = out
            return cls(np.asarray(images), jax.tree.map(np.asarray, trajectory))
        return cls(np.asarray(out))


def device_count_of(prompt_ids):
    """The leading (device) axis of pmap-shaped ids, checked against the local devices."""
    devices = prompt_ids.shape[0]
    if devices != jax.local_device_count():
        raise ValueError(f"prompt_ids lead with {devices}, but there are {jax.local_device_count()} devices: "
                         "shard(prompt_ids) splits a batch divisible by the device count")
    return devices


def checkpoint_files(variant=None, components=COMPONENTS, tokenizers=("tokenizer",)):
    """Which files of a diffusers pipeline repo to download: configs, tokenizer, and one weight format."""
    v = f".{variant}" if variant else ""
    weights = [f"{c}/{stem}{v}{suffix}" for c in components for stem in ("diffusion_pytorch_model", "model")
               for suffix in (".safetensors", "-*.safetensors", ".safetensors.index*.json")]  # "-*": shards, not .fp16
    return ["model_index.json", "*/config.json", "scheduler/*", *(f"{t}/*" for t in tokenizers), *weights]


class StableDiffusion:
    """Holds the modules, the tokenizer and the scheduler; the weights live in the params dict you pass in."""

    # What from_pretrained reads: model classes and tokenizers by folder, model_index.json entries for __init__.
    MODELS = {"text_encoder": CLIPTextModel, "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    TOKENIZERS = ("tokenizer",)
    INDEX_OPTIONS = ()

    def __init__(self, text_encoder, unet, vae, tokenizer, scheduler, dtype=jnp.float32):
        self.text_encoder, self.unet, self.vae = text_encoder, unet, vae
        self.tokenizer, self.scheduler, self.dtype = tokenizer, scheduler, dtype
        self.vae_scale_factor = vae.config.scale_factor
        # Tokenizers saved without model_max_length report a huge one; the text encoder knows its length.
        self.max_length = min(tokenizer.model_max_length, text_encoder.config.max_position_embeddings)
        self._empty_prompt_ids = self.prepare_inputs([""])

    # ---- loading ------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_repo_id, revision=None, dtype=jnp.float32, scheduler=None,
                        scheduler_config=None, variant=None, attention="auto"):
        """(pipeline, params) from a diffusers checkpoint folder or hub id.

        `scheduler="ddim"` swaps the kind and keeps the checkpoint's config values; `scheduler_config={...}`
        overrides single values. `params = {"text_encoder": ..., "unet": ..., "vae": ...}`.
        """
        from .hub import ModelNotFoundError, resolve_folder
        from .models.config import read_config_file
        from .weights import load_weights, weight_files

        files = checkpoint_files(variant, tuple(cls.MODELS), cls.TOKENIZERS)
        folder = resolve_folder(path_or_repo_id, revision, allow_patterns=files)
        if not os.path.isfile(os.path.join(folder, "model_index.json")):
            raise ModelNotFoundError(f"{path_or_repo_id}: no model_index.json, so not a diffusers pipeline checkpoint")
        if any(not _has_safetensors(os.path.join(folder, c)) for c in cls.MODELS) and folder != str(path_or_repo_id):
            # Older repos ship .bin or Flax msgpack only: fetch those for the components that need them.
            patterns = [f"{c}/*.bin" for c in cls.MODELS] + [f"{c}/*.msgpack" for c in cls.MODELS]
            folder = resolve_folder(path_or_repo_id, revision, allow_patterns=files + patterns)
        with open(os.path.join(folder, "model_index.json")) as f:
            index = json.load(f)

        scheduler = load_scheduler(folder, scheduler, scheduler_config)  # fail fast, before the weights
        for name in cls.TOKENIZERS:
            check_tokenizer_folder(os.path.join(folder, name))  # before the weights: tokenizers load beside them
        modules = {}
        for name, module_class in cls.MODELS.items():
            sub = os.path.join(folder, name)
            kwargs = {"attention": attention} if name == "unet" else {}
            modules[name] = module_class.from_config(read_config_file(os.path.join(sub, "config.json")), dtype, **kwargs)
            weight_files(sub, variant)  # fail on a missing weights file before reading anything
        # Tracing the models for their parameter shapes and building the tokenizers hold the GIL; copying tensors
        # into device buffers does not. So a side thread does the first while this one copies, biggest model first.
        order = sorted(modules, key=lambda name: name != "unet")
        with ThreadPoolExecutor(1) as side:
            shapes = {name: side.submit(modules[name].param_shapes) for name in order}
            tokenizers = {name: side.submit(load_tokenizer, os.path.join(folder, name)) for name in cls.TOKENIZERS}
            params = {name: load_weights(os.path.join(folder, name), shapes[name].result(), dtype, variant)
                      for name in order}
            tokenizers = {name: pending.result() for name, pending in tokenizers.items()}
        params = {name: params[name] for name in modules}

        options = {key: index[key] for key in cls.INDEX_OPTIONS if key in index}
        return cls(scheduler=scheduler, dtype=dtype, **tokenizers, **modules, **options), params

    @classmethod
    def from_single_file(cls, path, config=None, dtype=jnp.float32, prediction_type=None, scheduler=None,
                         scheduler_config=None, attention="auto", revision=None):
        """(pipeline, params) from one .safetensors / .ckpt file in the CompVis / A1111 layout (SD 1.x or 2.x).

        The version is read from the tensor names. Model, tokenizer and scheduler configs come from `config` (a
        diffusers folder or hub id) or, without it, from stable-diffusion-v1-5 / stable-diffusion-2-1 defaults
        bundled with sdflax; those assume v-prediction for SD 2.x: pass `prediction_type="epsilon"` for a
        512 px SD 2.x base model. The params equal what `from_pretrained` gives for the converted checkpoint."""
        from .single_file import from_single_file

        return from_single_file(cls, path, config, dtype, prediction_type, scheduler, scheduler_config, attention,
                                revision)

    def load_lora(self, params, path, scale=1.0):
        """params with a LoRA file (kohya/A1111 or diffusers/PEFT) merged into the UNet and text encoder.

        Pure: `params` is not changed, so LoRAs stack by calling it again. See `sdflax.lora.merge_lora` for a
        jit-able merge with a traced `scale`."""
        from .lora import load_lora

        return load_lora(params, path, scale)

    def load_textual_inversion(self, params, path, token=None):
        """params with a textual-inversion embedding (A1111 .pt/.safetensors, diffusers learned_embeds) added.

        The token (and `token_1`, ... for a multi-vector embedding) joins this pipeline's tokenizer, so use the
        returned params with this pipeline; `prepare_inputs` expands the token to all its vectors."""
        from .textual_inversion import load_textual_inversion

        return load_textual_inversion(self, params, path, token)

    # ---- inputs -------------------------------------------------------------------------------------------
    def prepare_inputs(self, prompts) -> np.ndarray:
        """Token ids (B, 77) int32, padded and truncated as diffusers does."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        prompts = expand_prompts(prompts, self.tokenizer)  # multi-vector textual-inversion tokens
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.max_length,
                             truncation=True, return_tensors="np").input_ids
        return ids.astype(np.int32)

    @staticmethod
    def numpy_to_pil(images):
        """Float images in [0, 1], (..., H, W, 3) -> list of PIL images."""
        from PIL import Image

        images = np.asarray(images)
        images = images.reshape(-1, *images.shape[-3:])
        return [Image.fromarray((image * 255).round().astype(np.uint8)) for image in images]

    def _sizes(self, height, width):
        f = self.vae_scale_factor
        height = height or self.unet.config.sample_size * f
        width = width or self.unet.config.sample_size * f
        for name, value in (("height", height), ("width", width)):
            if value % f:
                raise ValueError(f"{name}={value} is not a multiple of the VAE scale factor {f}: "
                                 f"use {value // f * f} or {(value // f + 1) * f}")
        return height, width

    def _check_ids(self, prompt_ids, neg_prompt_ids, leading_dims):
        length = self.max_length
        for name, ids in (("prompt_ids", prompt_ids), ("neg_prompt_ids", neg_prompt_ids)):
            if ids is None:
                continue
            if ids.ndim != leading_dims + 1 or ids.shape[-1] != length:
                expected = "(devices, batch, " if leading_dims == 2 else "(batch, "
                raise ValueError(f"{name} has shape {ids.shape}; expected {expected}{length}): "
                                 "make it with pipeline.prepare_inputs(prompts)" + (" and shard()" if leading_dims == 2 else ""))
        if neg_prompt_ids is not None and neg_prompt_ids.shape != prompt_ids.shape:
            raise ValueError(f"neg_prompt_ids {neg_prompt_ids.shape} and prompt_ids {prompt_ids.shape} differ: "
                             "give one negative prompt per prompt")

    # ---- generation ---------------------------------------------------------------------------------------
    def encode_prompt(self, params, prompt_ids):
        return self.text_encoder.apply(params["text_encoder"], prompt_ids).last_hidden_state

    def decode_latents(self, params, latents):
        """Latents as the UNet sees them -> images (B, H, W, 3) in [0, 1]."""
        images = self.vae.apply(params["vae"], latents / self.vae.config.scaling_factor, method="decode")
        images = jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0, 1)
        return jnp.transpose(images, (0, 2, 3, 1))

    def _generate(self, prompt_ids, params, prng_seed, num_inference_steps=50, height=None, width=None,
                  guidance_scale=7.5, latents=None, neg_prompt_ids=None, callback=None, guidance_rescale=0.0,
                  guidance=None, return_trajectory=False, prompt_embeds=None, neg_prompt_embeds=None,
                  unet_kwargs=None):
        """The whole text -> images computation as a pure function; (B, H, W, 3) in [0, 1].

        Differentiable end to end (each sampler step is rematerialised): take `jax.grad` with respect to
        `latents`, `prompt_embeds` (text states (B, 77, D) that replace `prompt_ids`' encoding) or `params`.
        `guidance(uncond, cond, scale) -> prediction` replaces classifier-free guidance (see `sampling`);
        `guidance_rescale` is diffusers' (0 turns it off). With `return_trajectory=True` the result is
        `(images, sampling.Trajectory)`. `callback(step, num_steps, latents)` runs on the host after every
        step. `callback`, `guidance` and `return_trajectory` are static: reuse the same function objects.
        `unet_kwargs`: extra UNet inputs for the doubled batch, unconditional rows first (SDXL's text_embeds).
        """
        height, width = self._sizes(height, width)
        batch = (prompt_ids if prompt_embeds is None else prompt_embeds).shape[0]
        if prompt_embeds is None:
            prompt_embeds = self.encode_prompt(params, prompt_ids)
        if neg_prompt_embeds is None:
            if neg_prompt_ids is None:
                neg_prompt_ids = self._empty_prompt_ids
            neg_prompt_embeds = jnp.broadcast_to(self.encode_prompt(params, neg_prompt_ids), prompt_embeds.shape)
        context = jnp.concatenate([neg_prompt_embeds, prompt_embeds]).astype(self.dtype)

        shape = (batch, self.unet.config.in_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)
        noise_key, sampler_key = jax.random.split(prng_seed)
        if latents is None:
            latents = jax.random.normal(noise_key, shape, jnp.float32)
        elif latents.shape != shape:
            raise ValueError(f"latents have shape {latents.shape}; expected {shape} for a batch of {batch} "
                             f"at {height}x{width}")
        # The first σ can depend on the step count (Euler with leading spacing): the state knows it.
        state = self.scheduler.set_timesteps(num_inference_steps, shape=shape)
        init_noise_sigma = getattr(state, "init_noise_sigma", None) or self.scheduler.init_noise_sigma
        latents = latents.astype(jnp.float32) * init_noise_sigma

        if guidance is None:
            guidance = sampling.rescaled_guidance(guidance_rescale)
        unet_fn = functools.partial(self.unet.apply, params["unet"], **(unet_kwargs or {}))
        model = sampling.guided_model(unet_fn, context, jnp.asarray(guidance_scale, jnp.float32), guidance)
        out = sampling.denoise(model, self.scheduler, latents, num_inference_steps, sampler_key,
                               callback=callback, return_trajectory=return_trajectory, state=state)
        if return_trajectory:
            latents, trajectory = out
            return self.decode_latents(params, latents), trajectory
        return self.decode_latents(params, out)

    # _generate's arguments as (name, how pmap maps it): 0 = split over devices, None = broadcast, "static".
    _GENERATE_ARGS = (("prompt_ids", 0), ("params", 0), ("prng_seed", 0), ("num_inference_steps", "static"),
                      ("height", "static"), ("width", "static"), ("guidance_scale", 0), ("latents", 0),
                      ("neg_prompt_ids", 0), ("callback", "static"), ("guidance_rescale", 0), ("guidance", "static"),
                      ("return_trajectory", "static"))
    _STATIC = tuple(name for name, axis in _GENERATE_ARGS if axis == "static")

    @functools.cached_property
    def _jitted(self):
        return jax.jit(self._generate, static_argnames=self._STATIC)

    @functools.cached_property
    def _pmapped(self):
        axes = [axis for _, axis in self._GENERATE_ARGS]
        return jax.pmap(self._generate, in_axes=tuple(None if a == "static" else a for a in axes),
                        static_broadcasted_argnums=tuple(i for i, a in enumerate(axes) if a == "static"))

    @property
    def scheduler(self):
        return self._scheduler

    @scheduler.setter
    def scheduler(self, scheduler):
        # Compiled programs baked the old scheduler in: drop them.
        self._scheduler = scheduler
        for name in ("_jitted", "_pmapped", "_sharded"):
            self.__dict__.pop(name, None)

    def __call__(self, prompt_ids, params, prng_seed, num_inference_steps=50, height=None, width=None,
                 guidance_scale=7.5, latents=None, neg_prompt_ids=None, jit=False, callback=None,
                 guidance_rescale=0.0, guidance=None, return_trajectory=False):
        """Generate images. With `jit=True` the inputs are sharded over devices (see `sdflax.shard`), params
        replicated (`sdflax.replicate`), and the call runs under `jax.pmap`: images are (devices, B, H, W, 3).

        `callback(step, num_steps, latents)` runs on the host after each step (once per device under pmap);
        `guidance`, `guidance_rescale` and `return_trajectory` as in `_generate` (the trajectory lands in
        `output.trajectory` as numpy arrays, with a leading device axis under `jit=True`)."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be at least 1, got {num_inference_steps}")
        height, width = self._sizes(height, width)
        self._check_ids(prompt_ids, neg_prompt_ids, 2 if jit else 1)
        scalars = jnp.asarray(guidance_scale, jnp.float32), jnp.asarray(guidance_rescale, jnp.float32)
        if jit:
            devices = device_count_of(prompt_ids)
            scalars = [jnp.broadcast_to(s, (devices,)) for s in scalars]
            run = self._pmapped
        else:
            run = self._jitted
        out = run(prompt_ids, params, prng_seed, num_inference_steps, height, width, scalars[0], latents,
                  neg_prompt_ids, callback, scalars[1], guidance, return_trajectory)
        return StableDiffusionOutput.of(out, return_trajectory)

    def _sharded_checks(self, prompt_ids, neg_prompt_ids, prng_seed, height, width, mesh):
        """The mesh (default: all local devices) and the image size, with the inputs checked for the sharded path."""
        from .parallel import device_mesh

        mesh = mesh or device_mesh()
        height, width = self._sizes(height, width)
        self._check_ids(prompt_ids, neg_prompt_ids, 1)
        if prng_seed.shape[0] != mesh.size:
            raise ValueError(f"prng_seed holds {prng_seed.shape[0]} keys for {mesh.size} devices: "
                             "use jax.random.split(key, number_of_devices)")
        return mesh, height, width

    def generate_sharded(self, prompt_ids, params, prng_seed, num_inference_steps=50, height=None, width=None,
                         guidance_scale=7.5, latents=None, neg_prompt_ids=None, mesh=None):
        """The `jit` + `NamedSharding` path: the batch (B, 77) is split over a one-axis device mesh.

        `prng_seed` holds one key per device, (devices, 2) as for `jit=True`; device d draws the noise of
        batch rows [d * B/devices, (d + 1) * B/devices) from its key, so the images equal the pmap path's.
        `params` are plain (not `replicate`d); returns (B, H, W, 3) numpy images.
        """
        from .parallel import replicate_on, shard_batch

        mesh, height, width = self._sharded_checks(prompt_ids, neg_prompt_ids, prng_seed, height, width, mesh)
        inputs = shard_batch({"ids": prompt_ids, "latents": latents, "neg": neg_prompt_ids}, mesh)
        images = self._sharded(inputs["ids"], replicate_on(params, mesh), shard_batch(prng_seed, mesh),
                               num_inference_steps, height, width, jnp.asarray(guidance_scale, jnp.float32),
                               inputs["latents"], inputs["neg"])
        return np.asarray(images)

    @functools.cached_property
    def _sharded(self):
        def generate(prompt_ids, params, keys, steps, height, width, guidance_scale, latents, neg_prompt_ids):
            devices = keys.shape[0]
            per_device = lambda x: None if x is None else x.reshape(devices, -1, *x.shape[1:])  # noqa: E731
            images = jax.vmap(self._generate, in_axes=(0, None, 0, None, None, None, None, 0, 0))(
                per_device(prompt_ids), params, keys, steps, height, width, guidance_scale,
                per_device(latents), per_device(neg_prompt_ids))
            return images.reshape(-1, *images.shape[2:])

        return jax.jit(generate, static_argnums=(3, 4, 5))


def _has_safetensors(folder):
    return os.path.isdir(folder) and any(name.endswith(".safetensors") for name in os.listdir(folder))


def load_tokenizer(folder):
    """CLIPTokenizer from `vocab.json` + `merges.txt` (SD 1.x hub repos) or `tokenizer.json` (transformers 5)."""
    from transformers import CLIPTokenizer

    check_tokenizer_folder(folder)
    return CLIPTokenizer.from_pretrained(folder)


def check_tokenizer_folder(folder):
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no tokenizer folder at {folder}")


def load_scheduler(folder, kind=None, overrides=None):
    """The checkpoint's scheduler, another kind by name with the checkpoint's config, or a scheduler object."""
    if kind is not None and not isinstance(kind, str):
        if overrides:
            raise ValueError("scheduler_config applies to a scheduler given by name, not to a scheduler object")
        return kind
    path = os.path.join(folder, "scheduler", "scheduler_config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no scheduler/scheduler_config.json in {folder}")
    with open(path) as f:
        config = json.load(f)
    config.update(overrides or {})
    return scheduler_from_config(config, kind)
