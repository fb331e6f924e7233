"""Inpainting: repaint the white part of a mask, keep the black part, exactly as diffusers'
`StableDiffusionInpaintPipeline`, with inpainting UNets (`in_channels=9`) or ordinary ones (`latents.FromImageMask`
says how each is run); and mask preprocessing.
"""

from __future__ import annotations

import numpy as np

from .conditioning import SDText
from .img2img import SIXTEEN_BIT_MODES, as_list, multiple_size, preprocess_images
from .latents import FromImageMask, is_inpainting_unet
from .pipeline import Pipeline


def has_transparency(mask) -> bool:
    """Whether a PIL image has a pixel that is not fully opaque. A mask's alpha is not read as the mask (diffusers
    drops it), so a mask drawn as transparency would silently become something else: it is refused instead."""
    if "A" not in mask.getbands() and not (mask.mode == "P" and "transparency" in mask.info):
        return False
    return mask.convert("RGBA").getchannel("A").getextrema()[0] < 255


def preprocess_masks(masks, scale_factor: int) -> np.ndarray:
    """PIL images or arrays (H, W), (H, W, 1) (uint8, or float in [0, 1]), or RGB(A) (H, W, 3|4) -> float32
    (B, 1, H, W) in {0, 1}: 1 (white) is repainted, 0 kept; greyscale, binarised at 0.5, as diffusers' mask
    processor. Sides are cut down to a multiple of `scale_factor` (Lanczos before binarising, as diffusers).
    16-bit masks (PIL "I;16" / "I", uint16 arrays) are read as value / 65535. A mask with transparency (alpha below
    opaque) is refused: its alpha would be ignored."""
    from PIL import Image

    out = []
    for mask in as_list(masks, (2, 3)):
        if isinstance(mask, Image.Image):
            if has_transparency(mask):
                raise ValueError("the mask has transparency, which is not read as the mask: give a greyscale "
                                 "mask, white where to repaint and black where to keep")
            if mask.mode in SIXTEEN_BIT_MODES:
                mask = Image.fromarray(np.asarray(mask, np.float32) / 65535.0)  # mode F, in [0, 1]
            elif mask.mode not in ("L", "RGB", "RGBA", "F"):
                mask = mask.convert("L")
        else:
            array = np.asarray(mask)
            if array.ndim == 3 and array.shape[-1] == 1:
                array = array[..., 0]
            if array.dtype == np.uint16:
                array = array.astype(np.float32) / 65535.0
            if array.ndim == 3 and array.shape[-1] == 4 and (array[..., 3] < (255 if array.dtype == np.uint8
                                                                                else 1)).any():
                raise ValueError("the mask has transparency (its alpha channel is below opaque), which is not read "
                                 "as the mask: give a greyscale mask, white where to repaint and black where to keep")
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


def preprocess_images_and_masks(images, masks, scale_factor: int) -> tuple[np.ndarray, np.ndarray]:
    """Images and their masks, one mask per image and of its size -> (preprocess_images, preprocess_masks)."""
    if images is None or masks is None:
        raise ValueError("inpainting takes images and masks: prepare_inputs(prompts, images, masks)")
    images, masks = as_list(images), as_list(masks, (2, 3))
    if len(images) != len(masks):
        raise ValueError(f"{len(images)} images and {len(masks)} masks: give one mask per image")
    for image, mask in zip(images, masks):
        image_size, mask_size = _size(image), _size(mask)
        if image_size != mask_size:
            raise ValueError(f"mask of {mask_size[0]}x{mask_size[1]} for an image of {image_size[0]}x"
                             f"{image_size[1]}: give a mask the size of its image")
    return preprocess_images(images, scale_factor), preprocess_masks(masks, scale_factor)


class StableDiffusionInpaint(Pipeline):
    """`from_pretrained` as StableDiffusion (an inpainting checkpoint or any other);
    `prepare_inputs(prompts, images, masks) -> (prompt_ids, images, masks)`."""

    conditioning, start = SDText, FromImageMask

    def prepare_inputs(self, prompts, images=None, masks=None, prompts_2=None):
        prompt_ids = super().prepare_inputs(prompts, prompts_2)
        if images is None and masks is None:
            return prompt_ids
        return (prompt_ids, *preprocess_images_and_masks(images, masks, self.vae_scale_factor))

    @property
    def inpainting_unet(self) -> bool:
        """True for a 9-channel inpainting UNet, False for an ordinary one (the known region is pasted back)."""
        return is_inpainting_unet(self)

    def __call__(self, prompt_ids, image, mask, params, prng_seed, strength=1.0, num_inference_steps=50,
                 height=None, width=None, guidance_scale=7.5, noise=None, neg_prompt_ids=None, jit=False,
                 callback=None, guidance_rescale=0.0, guidance=None, return_trajectory=False, prompt_embeds=None,
                 neg_prompt_embeds=None):
        """Images (B, H, W, 3) in [0, 1] from `image` (B, 3, H, W) in [-1, 1] and `mask` (B, 1, H, W) (>= 0.5 is
        repainted), or (devices, B, H, W, 3) with `jit=True`. `strength` and the step count are static. Strength 1
        starts from pure noise (the image enters only through the kept region); below 1 the image latents are
        noised to the starting timestep, as image-to-image. The other arguments as
        `StableDiffusionImg2Img.__call__`."""
        return self._run(locals())


def _size(image):
    """(width, height) of a PIL image or an (H, W, ...) array."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.size
    shape = np.shape(image)
    return shape[1], shape[0]
