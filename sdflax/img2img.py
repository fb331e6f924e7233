"""Image-to-image (SDEdit, Meng et al. 2022): noise an encoded image to the timestep `strength` picks, then denoise.

The same compiled scan as text-to-image, begun part-way through the schedule, exactly as diffusers'
`StableDiffusionImg2ImgPipeline` does for each scheduler. `ImagePipeline` is what image-to-image and inpainting
(`sdflax.inpaint`) share: image inputs, random draws, and running `_generate` under jit, pmap or jit + sharding.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import sampling
from .pipeline import StableDiffusion, StableDiffusionOutput, device_count_of


def start_step(num_inference_steps: int, strength: float) -> int:
    """How many steps of the schedule img2img skips (diffusers' `get_timesteps`)."""
    if not 0 < strength <= 1:
        raise ValueError(f"strength must be in (0, 1], got {strength}: 1 repaints everything, small values keep "
                         "the image")
    steps_run = min(int(num_inference_steps * strength), num_inference_steps)
    if steps_run == 0:
        raise ValueError(f"strength={strength} with num_inference_steps={num_inference_steps} runs no denoising "
                         f"step: raise the strength to at least {1 / num_inference_steps:.3g} or the step count")
    return num_inference_steps - steps_run


def _to_pil(image, what="image"):
    """A PIL image from a PIL image or an (H, W, C) array (uint8, or float in [0, 1])."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
        raise ValueError(f"an {what} array must be (H, W, 3), got {array.shape}")
    if array.dtype != np.uint8:
        array = (np.clip(array, 0, 1) * 255).round().astype(np.uint8)
    return Image.fromarray(array.squeeze(-1) if array.shape[-1] == 1 else array)


def multiple_size(size, scale_factor: int, what="image"):
    """(width, height) cut down to multiples of `scale_factor`, as diffusers' VaeImageProcessor; a warning names
    the new size."""
    width, height = (side - side % scale_factor for side in size)
    if (width, height) != tuple(size):
        if not width or not height:
            raise ValueError(f"{what} of {size[0]}x{size[1]} is smaller than the VAE scale factor {scale_factor}")
        warnings.warn(f"{what} of {size[0]}x{size[1]} resized to {width}x{height} (a multiple of the VAE scale "
                      f"factor {scale_factor})", stacklevel=4)
    return width, height


def _as_list(items, single_ndims=(3,)):
    """One image (PIL, or an array of `single_ndims` dimensions) or several -> a list."""
    from PIL import Image

    single = isinstance(items, Image.Image) or (isinstance(items, np.ndarray) and items.ndim in single_ndims)
    return [items] if single else list(items)


def preprocess_images(images, scale_factor: int) -> np.ndarray:
    """PIL images or arrays (H, W, 3) (uint8, or float in [0, 1]) -> float32 NCHW in [-1, 1].

    Sides are cut down to a multiple of `scale_factor` (Lanczos, as diffusers' VaeImageProcessor), with a
    warning that names the new size.
    """
    from PIL import Image

    out = []
    for image in _as_list(images):
        image = _to_pil(image).convert("RGB")
        size = multiple_size(image.size, scale_factor)
        if size != image.size:
            image = image.resize(size, Image.LANCZOS)
        out.append(np.asarray(image, np.float32) / 255.0)
    if len({a.shape for a in out}) > 1:
        raise ValueError(f"images differ in size: {sorted({a.shape[:2] for a in out})}; give images of one size")
    return np.stack(out).transpose(0, 3, 1, 2) * 2.0 - 1.0


def random_draws(prng_seed, shape, count):
    """`count` standard-normal arrays of `shape` (B, ...) and the sampler's key, from one PRNG key, or from one key
    per image (B,), image b then drawing exactly what a batch of one with key b draws (diffusers' list of
    generators). The sampler's key is then image 0's: samplers that add noise at every step draw it for the batch.
    """
    typed = jnp.issubdtype(prng_seed.dtype, jax.dtypes.prng_key)
    if prng_seed.ndim == (0 if typed else 1):
        keys = jax.random.split(prng_seed, count + 1)
        return [jax.random.normal(keys[j], shape, jnp.float32) for j in range(count)], keys[count]
    if prng_seed.shape[0] != shape[0]:
        raise ValueError(f"{prng_seed.shape[0]} PRNG keys for a batch of {shape[0]}: give one key, or one per image")
    keys = jax.vmap(lambda k: jax.random.split(k, count + 1))(prng_seed)  # (B, count + 1)
    one = (1, *shape[1:])
    draws = [jax.vmap(lambda k: jax.random.normal(k, one, jnp.float32))(keys[:, j]).reshape(shape)
             for j in range(count)]
    return draws, keys[0, count]


class ImagePipeline(StableDiffusion):
    """Image-conditioned generation: `_generate(prompt_ids, *IMAGES, params, prng_seed, strength, ...)`.

    `_ARGS` lists `_generate`'s arguments as (name, how pmap maps it: 0 split over devices, "static");
    `_IMAGES` the (B, C, H, W) inputs as (name, channels).
    """

    _ARGS: tuple = ()
    _IMAGES: tuple = ()

    def _context(self, params, prompt_ids, neg_prompt_ids):
        """Text states (2B, T, D), unconditional rows first (an empty negative prompt by default)."""
        if neg_prompt_ids is None:
            neg_prompt_ids = jnp.broadcast_to(self._empty_prompt_ids, prompt_ids.shape)
        return self.encode_prompt(params, jnp.concatenate([neg_prompt_ids, prompt_ids]))

    def _encode(self, params, image, eps):
        """Latents of `image` (B, 3, H, W) in [-1, 1]: a posterior sample mean + std * eps, scaled as the UNet
        sees them (diffusers' `latent_dist.sample(generator) * scaling_factor`)."""
        posterior = self.vae.apply(params["vae"], jnp.asarray(image, self.dtype), method="encode")
        latents = posterior.mean + posterior.std * eps
        return latents.astype(jnp.float32) * self.vae.config.scaling_factor

    def _latent_shape(self, image):
        f = self.vae_scale_factor
        return (image.shape[0], self.vae.config.latent_channels, image.shape[-2] // f, image.shape[-1] // f)

    # ---- running ------------------------------------------------------------------------------------------
    @functools.cached_property
    def _jitted(self):
        return jax.jit(self._generate, static_argnames=self._static_names)

    @functools.cached_property
    def _pmapped(self):
        axes = [axis for _, axis in self._ARGS]
        return jax.pmap(self._generate, in_axes=tuple(None if a == "static" else a for a in axes),
                        static_broadcasted_argnums=tuple(i for i, a in enumerate(axes) if a == "static"))

    @functools.cached_property
    def _sharded(self):
        """jit over (B, ...) inputs split over a device mesh: each device runs `_generate` on its rows with its
        own key (a vmap over a leading device axis), so the images equal the pmap path's."""
        names = [name for name, _ in self._ARGS]
        static = self._static_names

        def generate(*args):
            args = dict(zip(names, args))
            statics = {name: args.pop(name) for name in static}
            devices = args["prng_seed"].shape[0]
            per_device = lambda x: None if x is None else x.reshape(devices, -1, *x.shape[1:])  # noqa: E731
            traced, shared = list(args), ("params", "guidance_scale")
            images = jax.vmap(lambda *values: self._generate(**dict(zip(traced, values)), **statics),
                              in_axes=tuple(None if name in shared else 0 for name in traced))(
                *(args[name] if name in (*shared, "prng_seed") else per_device(args[name]) for name in traced))
            return images.reshape(-1, *images.shape[2:])

        return jax.jit(generate, static_argnums=tuple(names.index(name) for name in static))

    @property
    def _static_names(self):
        return tuple(name for name, axis in self._ARGS if axis == "static")

    def _check(self, args, leading_dims, height=None, width=None):
        """Inputs checked before compiling; returns the (H, W) of the images."""
        start_step(args["num_inference_steps"], args["strength"])
        self._check_ids(args["prompt_ids"], args["neg_prompt_ids"], leading_dims)
        make = "pipeline.prepare_inputs(prompts, " + ", ".join(f"{name}s" for name, _ in self._IMAGES) + ")"
        sharded = " and shard()" if leading_dims == 2 else ""
        batch = args["prompt_ids"].shape[:leading_dims]
        size = None
        for name, channels in self._IMAGES:
            x = args[name]
            expected = ("(devices, B, " if leading_dims == 2 else "(B, ") + f"{channels}, H, W)"
            if x.ndim != leading_dims + 3 or x.shape[-3] != channels:
                raise ValueError(f"{name} has shape {x.shape}; expected {expected}: make it with {make}{sharded}")
            if x.shape[:leading_dims] != batch:
                raise ValueError(f"{name} has shape {x.shape} for prompt_ids of {args['prompt_ids'].shape}: give "
                                 f"one {name} per prompt")
            if size is not None and x.shape[-2:] != size:
                raise ValueError(f"{name} is {x.shape[-1]}x{x.shape[-2]} but the image is {size[1]}x{size[0]}: "
                                 f"give a {name} of the image's size")
            size = x.shape[-2:]
        for name, given, actual in (("height", height, size[0]), ("width", width, size[1])):
            if given is not None and given != actual:
                raise ValueError(f"{name}={given} but the image is {actual}: resize the image, or leave {name} out")
        return self._sizes(*size)

    def _run(self, args, jit, height=None, width=None):
        """`_generate` under jit (one device) or pmap (`jit=True`: inputs sharded, params replicated)."""
        args = {name: args.get(name) for name, _ in self._ARGS}
        for name, _ in self._IMAGES:
            if not isinstance(args[name], jax.Array):
                args[name] = np.asarray(args[name], np.float32)
        self._check(args, 2 if jit else 1, height, width)
        if jit:
            devices = device_count_of(args["prompt_ids"])
            if args["prng_seed"].shape[0] != devices:
                raise ValueError(f"prng_seed leads with {args['prng_seed'].shape[0]} for {devices} devices: one key "
                                 "per device (jax.random.split(key, devices)), or shard(keys) with one key per image")
            args["guidance_scale"] = jnp.full((devices,), args["guidance_scale"], jnp.float32)
            images = self._pmapped(*args.values())
        else:
            args["guidance_scale"] = jnp.asarray(args["guidance_scale"], jnp.float32)
            images = self._jitted(*args.values())
        return StableDiffusionOutput(np.asarray(images))

    def _run_sharded(self, args, mesh=None):
        """`_generate` under jit with the batch split over a one-axis mesh; (B, H, W, 3) numpy images."""
        from .parallel import device_mesh, replicate_on, shard_batch

        mesh = mesh or device_mesh()
        args = {name: args.get(name) for name, _ in self._ARGS}
        for name, _ in self._IMAGES:
            args[name] = np.asarray(args[name], np.float32)
        self._check(args, 1)
        keys = args["prng_seed"]
        batch = args["prompt_ids"].shape[0]
        if keys.shape[0] not in (mesh.size, batch):
            raise ValueError(f"prng_seed holds {keys.shape[0]} keys for {mesh.size} devices and {batch} images: use "
                             "jax.random.split(key, number_of_devices), or one key per image")
        if keys.shape[0] != mesh.size:  # one key per image: (devices, B / devices)
            keys = keys.reshape(mesh.size, -1, *keys.shape[1:])
        for name in ("prompt_ids", "neg_prompt_ids", "noise", *(name for name, _ in self._IMAGES)):
            if args[name] is not None:
                args[name] = shard_batch(args[name], mesh)
        args.update(params=replicate_on(args["params"], mesh), prng_seed=shard_batch(keys, mesh),
                    guidance_scale=jnp.asarray(args["guidance_scale"], jnp.float32))
        return np.asarray(self._sharded(*args.values()))


class StableDiffusionImg2Img(ImagePipeline):
    """`from_pretrained` as StableDiffusion; `prepare_inputs(prompts, images) -> (prompt_ids, images)`."""

    _ARGS = (("prompt_ids", 0), ("image", 0), ("params", 0), ("prng_seed", 0), ("strength", "static"),
             ("num_inference_steps", "static"), ("guidance_scale", 0), ("noise", 0), ("neg_prompt_ids", 0),
             ("callback", "static"))
    _IMAGES = (("image", 3),)

    def prepare_inputs(self, prompts, images=None):
        prompt_ids = super().prepare_inputs(prompts)
        if images is None:
            return prompt_ids
        return prompt_ids, preprocess_images(images, self.vae_scale_factor)

    def _generate(self, prompt_ids, image, params, prng_seed, strength=0.8, num_inference_steps=50,
                  guidance_scale=7.5, noise=None, neg_prompt_ids=None, callback=None):
        """(B, H, W, 3) images in [0, 1] from `image` (B, 3, H, W) in [-1, 1]; a pure function of its inputs.

        `strength` and the step count are static (they fix the number of steps); `noise` (B, 4, h, w) is
        the standard-normal noise added to the image latents (drawn from `prng_seed` when None).
        `prng_seed` is one key, or one per image (see `random_draws`).
        """
        start = start_step(num_inference_steps, strength)
        batch = prompt_ids.shape[0]
        if image.shape[0] != batch:
            raise ValueError(f"{image.shape[0]} images for {batch} prompts: give one image per prompt")
        shape = self._latent_shape(image)
        (posterior_eps, drawn), sampler_key = random_draws(prng_seed, shape, 2)
        image_latents = self._encode(params, image, posterior_eps)
        if noise is None:
            noise = drawn
        elif noise.shape != shape:
            raise ValueError(f"noise has shape {noise.shape}; expected {shape}")

        context = self._context(params, prompt_ids, neg_prompt_ids)
        state = self.scheduler.set_timesteps(num_inference_steps, shape=shape, start=start)
        latents = self.scheduler.add_noise(state, image_latents, noise.astype(jnp.float32), 0)

        unet_fn = functools.partial(self.unet.apply, params["unet"])
        model = sampling.guided_model(unet_fn, context, jnp.asarray(guidance_scale, jnp.float32))
        latents = sampling.denoise(model, self.scheduler, latents, num_inference_steps, sampler_key,
                                   callback=callback, state=state)
        return self.decode_latents(params, latents)

    def __call__(self, prompt_ids, image, params, prng_seed, strength=0.8, num_inference_steps=50, height=None,
                 width=None, guidance_scale=7.5, noise=None, neg_prompt_ids=None, jit=False, callback=None):
        """Images (B, H, W, 3) in [0, 1], or (devices, B, H, W, 3) with `jit=True` (inputs sharded, params
        replicated, as for StableDiffusion). `height`/`width`, if given, must be the image's."""
        return self._run(locals(), jit, height, width)

    def generate_sharded(self, prompt_ids, image, params, prng_seed, strength=0.8, num_inference_steps=50,
                         guidance_scale=7.5, noise=None, neg_prompt_ids=None, mesh=None):
        """The `jit` + `NamedSharding` path: the batch (B, ...) is split over a one-axis device mesh, params are
        plain (not `replicate`d); `prng_seed` holds one key per device, as for `jit=True` (device d's rows draw
        from key d, so the images equal the pmap path's), or one per image. (B, H, W, 3) numpy images."""
        return self._run_sharded(locals(), mesh)
