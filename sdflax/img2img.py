"""Image-to-image (SDEdit, Meng et al. 2022): noise an encoded image to the timestep `strength` picks, then denoise
(`latents.FromImage`), exactly as diffusers' `StableDiffusionImg2ImgPipeline` does for each scheduler; and the
image preprocessing that image-to-image and inpainting share."""

from __future__ import annotations

import warnings

import numpy as np

from .conditioning import SDText
from .latents import FromImage
from .pipeline import Pipeline


# PIL's modes of 16-bit greyscale PNGs ("I" in older Pillow). Pillow's convert("L" / "RGB") clips their values at
# 255, which makes a picture nearly white: they are scaled to 8 bits (or to [0, 1] for masks) instead.
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def eight_bit(image):
    """A 16-bit greyscale PIL image as 8-bit "L" (value / 257, rounded); any other image as it is."""
    from PIL import Image

    if image.mode not in SIXTEEN_BIT_MODES:
        return image
    array = np.clip(np.asarray(image, np.float64) / 257.0, 0, 255).round().astype(np.uint8)
    return Image.fromarray(array)


def to_pil(image, what="image"):
    """A PIL image from a PIL image or an (H, W, C) array (uint8, uint16, or float in [0, 1]); 16-bit greyscale
    images come back 8-bit (`eight_bit`). An alpha channel is kept here and dropped by convert("RGB"), as diffusers
    drops it: the colours under transparent pixels are used as they are."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return eight_bit(image)
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
        raise ValueError(f"an {what} array must be (H, W, 3), got {array.shape}")
    if array.dtype == np.uint16:
        array = (array / 257.0).round().astype(np.uint8)
    elif array.dtype != np.uint8:
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


def as_list(items, single_ndims=(3,)):
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
    for image in as_list(images):
        image = to_pil(image).convert("RGB")
        size = multiple_size(image.size, scale_factor)
        if size != image.size:
            image = image.resize(size, Image.LANCZOS)
        out.append(np.asarray(image, np.float32) / 255.0)
    if len({a.shape for a in out}) > 1:
        raise ValueError(f"images differ in size: {sorted({a.shape[:2] for a in out})}; give images of one size")
    return np.stack(out).transpose(0, 3, 1, 2) * 2.0 - 1.0


class StableDiffusionImg2Img(Pipeline):
    """`from_pretrained` as StableDiffusion; `prepare_inputs(prompts, images) -> (prompt_ids, images)`."""

    conditioning, start = SDText, FromImage

    def prepare_inputs(self, prompts, images=None, prompts_2=None):
        prompt_ids = super().prepare_inputs(prompts, prompts_2)
        if images is None:
            return prompt_ids
        return prompt_ids, preprocess_images(images, self.vae_scale_factor)

    def __call__(self, prompt_ids, image, params, prng_seed, strength=0.8, num_inference_steps=50, height=None,
                 width=None, guidance_scale=7.5, noise=None, neg_prompt_ids=None, jit=False, callback=None,
                 guidance_rescale=0.0, guidance=None, return_trajectory=False, prompt_embeds=None,
                 neg_prompt_embeds=None):
        """Images (B, H, W, 3) in [0, 1] from `image` (B, 3, H, W) in [-1, 1], or (devices, B, H, W, 3) with
        `jit=True` (inputs sharded, params replicated, as for StableDiffusion). `height`/`width`, if given, must
        be the image's. `strength` and the step count are static (they fix the number of steps); `noise`
        (B, 4, h, w) is the standard-normal noise added to the image latents (drawn from `prng_seed` when None);
        `prng_seed` is one key (one per device with `jit=True`), or one per image. The other arguments as
        `StableDiffusion.__call__`."""
        return self._run(locals())
