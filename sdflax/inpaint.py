"""Inpainting: repaint the white part of a mask, keep the black part, exactly as diffusers'
`StableDiffusionInpaintPipeline`.

Two kinds of UNet:
- inpainting UNets (`in_channels=9`, as stable-diffusion-inpainting) see [latents, mask, masked image latents]
  at every step (Rombach et al. 2022, §4.5);
- ordinary 4-channel UNets denoise as image-to-image and, after every step, the known region is pasted back,
  noised to the next step's level (RePaint's simple variant, Lugmayr et al. 2022; Meng et al. 2022).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import sampling
from .img2img import ImagePipeline, _as_list, multiple_size, preprocess_images, random_draws, start_step


def preprocess_masks(masks, scale_factor: int) -> np.ndarray:
    """PIL images or arrays (H, W), (H, W, 1) (uint8, or float in [0, 1]), or RGB(A) (H, W, 3|4) -> float32
    (B, 1, H, W) in {0, 1}: 1 (white) is repainted, 0 kept; greyscale, binarised at 0.5, as diffusers' mask
    processor. Sides are cut down to a multiple of `scale_factor` (Lanczos before binarising, as diffusers)."""
    from PIL import Image

    out = []
    for mask in _as_list(masks, (2, 3)):
        if isinstance(mask, Image.Image):
            if mask.mode not in ("L", "RGB", "RGBA", "F"):
                mask = mask.convert("L")
        else:
            array = np.asarray(mask)
            if array.ndim == 3 and array.shape[-1] == 1:
                array = array[..., 0]
            if array.ndim == 3 and array.shape[-1] in (3, 4) and array.dtype != np.uint8:
                # ITU-R 601-2 luma, as PIL's convert("L"), kept in float
                array = array[..., :3].astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
            if array.ndim == 3 and array.shape[-1] in (3, 4):
                mask = Image.fromarray(array)
            elif array.ndim == 2:
                mask = Image.fromarray(array if array.dtype == np.uint8 else array.astype(np.float32))  # L or F
            else:
                raise ValueError(f"a mask array must be greyscale (H, W) or (H, W, 1), or RGB(A) (H, W, 3|4), got "
                                 f"{array.shape}: give one channel, white where to repaint")
        size = multiple_size(mask.size, scale_factor, "mask")
        if size != mask.size:
            mask = mask.resize(size, Image.LANCZOS)
        if mask.mode == "F":
            array = np.asarray(mask, np.float32)
        else:
            array = np.asarray(mask.convert("L"), np.float32) / 255.0
        out.append((array >= 0.5).astype(np.float32))
    if len({a.shape for a in out}) > 1:
        raise ValueError(f"masks differ in size: {sorted({a.shape for a in out})}; give masks of one size")
    return np.stack(out)[:, None]


class StableDiffusionInpaint(ImagePipeline):
    """`from_pretrained` as StableDiffusion (an inpainting checkpoint or any other);
    `prepare_inputs(prompts, images, masks) -> (prompt_ids, images, masks)`."""

    _ARGS = (("prompt_ids", 0), ("image", 0), ("mask", 0), ("params", 0), ("prng_seed", 0), ("strength", "static"),
             ("num_inference_steps", "static"), ("guidance_scale", 0), ("noise", 0), ("neg_prompt_ids", 0),
             ("callback", "static"))
    _IMAGES = (("image", 3), ("mask", 1))

    def prepare_inputs(self, prompts, images=None, masks=None):
        prompt_ids = super().prepare_inputs(prompts)
        if images is None and masks is None:
            return prompt_ids
        if images is None or masks is None:
            raise ValueError("inpainting takes images and masks: prepare_inputs(prompts, images, masks)")
        images, masks = _as_list(images), _as_list(masks, (2, 3))
        if len(images) != len(masks):
            raise ValueError(f"{len(images)} images and {len(masks)} masks: give one mask per image")
        for image, mask in zip(images, masks):
            image_size, mask_size = _size(image), _size(mask)
            if image_size != mask_size:
                raise ValueError(f"mask of {mask_size[0]}x{mask_size[1]} for an image of {image_size[0]}x"
                                 f"{image_size[1]}: give a mask the size of its image")
        return (prompt_ids, preprocess_images(images, self.vae_scale_factor),
                preprocess_masks(masks, self.vae_scale_factor))

    @property
    def inpainting_unet(self) -> bool:
        """True for a 9-channel inpainting UNet, False for an ordinary one (the known region is pasted back)."""
        latent, given = self.vae.config.latent_channels, self.unet.config.in_channels
        if given not in (latent, 2 * latent + 1):
            raise ValueError(f"the UNet takes {given} input channels; inpainting needs {latent} (an ordinary UNet) "
                             f"or {2 * latent + 1} (latents, mask and masked image: an inpainting UNet)")
        return given != latent

    def _generate(self, prompt_ids, image, mask, params, prng_seed, strength=1.0, num_inference_steps=50,
                  guidance_scale=7.5, noise=None, neg_prompt_ids=None, callback=None):
        """(B, H, W, 3) images in [0, 1] from `image` (B, 3, H, W) in [-1, 1] and `mask` (B, 1, H, W) (≥ 0.5 is
        repainted); a pure function of its inputs.

        `strength` and the step count are static. Strength 1 starts from pure noise (the image enters only
        through the kept region); below 1 the image latents are noised to the starting timestep, as
        image-to-image. `noise` (B, 4, h, w) is that standard-normal noise (drawn from `prng_seed` when None);
        `prng_seed` is one key, or one per image (see `sdflax.img2img.random_draws`).
        """
        start = start_step(num_inference_steps, strength)
        batch = prompt_ids.shape[0]
        if image.shape[0] != batch or mask.shape[0] != batch:
            raise ValueError(f"{image.shape[0]} images and {mask.shape[0]} masks for {batch} prompts: give one "
                             "image and one mask per prompt")
        nine = self.inpainting_unet
        f = self.vae_scale_factor
        shape = self._latent_shape(image)
        (image_eps, masked_eps, drawn), sampler_key = random_draws(prng_seed, shape, 3)
        if noise is None:
            noise = drawn
        elif noise.shape != shape:
            raise ValueError(f"noise has shape {noise.shape}; expected {shape}")
        noise = noise.astype(jnp.float32)

        mask = (jnp.asarray(mask, jnp.float32) >= 0.5).astype(jnp.float32)  # binarised, as diffusers
        image = jnp.asarray(image, jnp.float32)
        # diffusers encodes the image only where it is needed, in this order: the posterior draws stay aligned.
        image_latents = self._encode(params, image, image_eps) if strength < 1 or not nine else None
        masked_latents = self._encode(params, image * (mask < 0.5), masked_eps)
        latent_mask = mask[:, :, ::f, ::f]  # nearest-neighbour resize to (h, w), as torch's interpolate

        context = self._context(params, prompt_ids, neg_prompt_ids)
        state = self.scheduler.set_timesteps(num_inference_steps, shape=shape, start=start)
        if strength == 1:
            init_noise_sigma = getattr(state, "init_noise_sigma", None) or self.scheduler.init_noise_sigma
            latents = noise * init_noise_sigma
        else:
            latents = self.scheduler.add_noise(state, image_latents, noise, 0)

        unet_fn = functools.partial(self.unet.apply, params["unet"])
        post_step = None
        if nine:
            condition = jnp.concatenate([latent_mask, masked_latents], axis=1)
            condition = jnp.concatenate([condition, condition])  # for the [unconditional; conditional] batch
            unet_fn = functools.partial(_conditioned_unet, unet_fn, condition)
        else:
            post_step = functools.partial(self._paste_known, image_latents, noise, latent_mask)
        model = sampling.guided_model(unet_fn, context, jnp.asarray(guidance_scale, jnp.float32))
        latents = sampling.denoise(model, self.scheduler, latents, num_inference_steps, sampler_key,
                                   callback=callback, state=state, post_step=post_step)
        return self.decode_latents(params, latents)

    def _paste_known(self, image_latents, noise, latent_mask, x, i, state):
        """(1 - m) x_known + m x: the kept region is the image latents noised to the next evaluation's timestep
        (not noised after the last)."""
        num_evals = state.timesteps.shape[0]
        known = self.scheduler.add_noise(state, image_latents, noise, jnp.minimum(i + 1, num_evals - 1))
        known = jnp.where(i + 1 < num_evals, known, image_latents)
        return (1 - latent_mask) * known + latent_mask * x

    def __call__(self, prompt_ids, image, mask, params, prng_seed, strength=1.0, num_inference_steps=50,
                 height=None, width=None, guidance_scale=7.5, noise=None, neg_prompt_ids=None, jit=False,
                 callback=None):
        """Images (B, H, W, 3) in [0, 1], or (devices, B, H, W, 3) with `jit=True` (inputs sharded, params
        replicated, as for StableDiffusion). `height`/`width`, if given, must be the image's."""
        return self._run(locals(), jit, height, width)

    def generate_sharded(self, prompt_ids, image, mask, params, prng_seed, strength=1.0, num_inference_steps=50,
                         guidance_scale=7.5, noise=None, neg_prompt_ids=None, mesh=None):
        """The `jit` + `NamedSharding` path, as `StableDiffusionImg2Img.generate_sharded`; (B, H, W, 3) numpy."""
        return self._run_sharded(locals(), mesh)


def _conditioned_unet(unet_fn, condition, x, t, context):
    """An inpainting UNet's input: [latents (scaled by the scheduler), mask, masked image latents] on channels."""
    return unet_fn(jnp.concatenate([x, condition.astype(x.dtype)], axis=1), t, context)


def _size(image):
    """(width, height) of a PIL image or an (H, W, ...) array."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.size
    shape = np.shape(image)
    return shape[1], shape[0]
