"""Image-to-image (SDEdit, Meng et al. 2022): noise an encoded image to the timestep `strength` picks, then denoise.

The same compiled scan as text-to-image, begun part-way through the schedule, exactly as diffusers'
`StableDiffusionImg2ImgPipeline` does for each scheduler.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import sampling
from .pipeline import StableDiffusion, StableDiffusionOutput


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


def preprocess_images(images, scale_factor: int) -> np.ndarray:
    """PIL images or arrays (H, W, 3) (uint8, or float in [0, 1]) -> float32 NCHW in [-1, 1].

    Sides are cut down to a multiple of `scale_factor` (Lanczos, as diffusers' VaeImageProcessor), with a
    warning that names the new size.
    """
    from PIL import Image

    single = isinstance(images, Image.Image) or (isinstance(images, np.ndarray) and images.ndim == 3)
    images = [images] if single else list(images)
    out = []
    for image in images:
        if not isinstance(image, Image.Image):
            array = np.asarray(image)
            if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
                raise ValueError(f"an image array must be (H, W, 3), got {array.shape}")
            if array.dtype != np.uint8:
                array = (np.clip(array, 0, 1) * 255).round().astype(np.uint8)
            image = Image.fromarray(array.squeeze(-1) if array.shape[-1] == 1 else array)
        image = image.convert("RGB")
        width, height = (side - side % scale_factor for side in image.size)
        if (width, height) != image.size:
            if not width or not height:
                raise ValueError(f"image of {image.size[0]}x{image.size[1]} is smaller than the VAE scale factor "
                                 f"{scale_factor}")
            warnings.warn(f"image of {image.size[0]}x{image.size[1]} resized to {width}x{height} (a multiple of "
                          f"the VAE scale factor {scale_factor})", stacklevel=3)
            image = image.resize((width, height), Image.LANCZOS)
        out.append(np.asarray(image, np.float32) / 255.0)
    if len({a.shape for a in out}) > 1:
        raise ValueError(f"images differ in size: {sorted({a.shape[:2] for a in out})}; give images of one size")
    return np.stack(out).transpose(0, 3, 1, 2) * 2.0 - 1.0


class StableDiffusionImg2Img(StableDiffusion):
    """`from_pretrained` as StableDiffusion; `prepare_inputs(prompts, images) -> (prompt_ids, images)`."""

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
        """
        start = start_step(num_inference_steps, strength)
        batch = prompt_ids.shape[0]
        if image.shape[0] != batch:
            raise ValueError(f"{image.shape[0]} images for {batch} prompts: give one image per prompt")
        posterior_key, noise_key, sampler_key = jax.random.split(prng_seed, 3)
        image_latents = self.vae.apply(params["vae"], jnp.asarray(image, self.dtype), method="encode")
        image_latents = image_latents.sample(posterior_key).astype(jnp.float32) * self.vae.config.scaling_factor
        if noise is None:
            noise = jax.random.normal(noise_key, image_latents.shape, jnp.float32)
        elif noise.shape != image_latents.shape:
            raise ValueError(f"noise has shape {noise.shape}; expected {image_latents.shape}")

        if neg_prompt_ids is None:
            neg_prompt_ids = jnp.broadcast_to(self._empty_prompt_ids, prompt_ids.shape)
        context = self.encode_prompt(params, jnp.concatenate([neg_prompt_ids, prompt_ids]))
        state = self.scheduler.set_timesteps(num_inference_steps, shape=image_latents.shape, start=start)
        latents = self.scheduler.add_noise(state, image_latents, noise.astype(jnp.float32), 0)

        unet_fn = functools.partial(self.unet.apply, params["unet"])
        model = sampling.guided_model(unet_fn, context, jnp.asarray(guidance_scale, jnp.float32))
        latents = sampling.denoise(model, self.scheduler, latents, num_inference_steps, sampler_key,
                                   callback=callback, state=state)
        return self.decode_latents(params, latents)

    _IMG2IMG_ARGS = (("prompt_ids", 0), ("image", 0), ("params", 0), ("prng_seed", 0), ("strength", "static"),
                     ("num_inference_steps", "static"), ("guidance_scale", 0), ("noise", 0), ("neg_prompt_ids", 0),
                     ("callback", "static"))

    @functools.cached_property
    def _jitted(self):
        return jax.jit(self._generate, static_argnames=("strength", "num_inference_steps", "callback"))

    @functools.cached_property
    def _pmapped(self):
        axes = [axis for _, axis in self._IMG2IMG_ARGS]
        return jax.pmap(self._generate, in_axes=tuple(None if a == "static" else a for a in axes),
                        static_broadcasted_argnums=tuple(i for i, a in enumerate(axes) if a == "static"))

    def __call__(self, prompt_ids, image, params, prng_seed, strength=0.8, num_inference_steps=50, height=None,
                 width=None, guidance_scale=7.5, noise=None, neg_prompt_ids=None, jit=False, callback=None):
        """Images (B, H, W, 3) in [0, 1], or (devices, B, H, W, 3) with `jit=True` (inputs sharded, params
        replicated, as for StableDiffusion). `height`/`width`, if given, must be the image's."""
        start_step(num_inference_steps, strength)  # check before compiling
        self._check_ids(prompt_ids, neg_prompt_ids, 2 if jit else 1)
        image = np.asarray(image, np.float32) if not isinstance(image, jax.Array) else image
        if image.ndim != (5 if jit else 4) or image.shape[-3] != 3:
            expected = "(devices, B, 3, H, W)" if jit else "(B, 3, H, W)"
            raise ValueError(f"image has shape {image.shape}; expected {expected}: make it with "
                             "pipeline.prepare_inputs(prompts, images)" + (" and shard()" if jit else ""))
        for name, given, actual in (("height", height, image.shape[-2]), ("width", width, image.shape[-1])):
            if given is not None and given != actual:
                raise ValueError(f"{name}={given} but the image is {actual}: resize the image, or leave {name} out")
        self._sizes(image.shape[-2], image.shape[-1])
        if jit:
            devices = prompt_ids.shape[0]
            if devices != jax.local_device_count():
                raise ValueError(f"prompt_ids lead with {devices}, but there are {jax.local_device_count()} devices: "
                                 "shard(prompt_ids) splits a batch divisible by the device count")
            images = self._pmapped(prompt_ids, image, params, prng_seed, strength, num_inference_steps,
                                   jnp.full((devices,), guidance_scale, jnp.float32), noise, neg_prompt_ids, callback)
        else:
            images = self._jitted(prompt_ids, image, params, prng_seed, strength, num_inference_steps,
                                  jnp.asarray(guidance_scale, jnp.float32), noise, neg_prompt_ids, callback)
        return StableDiffusionOutput(np.asarray(images))
