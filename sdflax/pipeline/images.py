"""Pictures in and out, on the host: images, masks and control images to the float arrays the pipelines take (as
diffusers' image processors make them), and float images back to PIL."""

from __future__ import annotations

import warnings

import numpy as np



# PIL's modes of 16-bit greyscale PNGs ("I" in older Pillow). Pillow's convert("L" / "RGB") clips their values at
# 255, which makes a picture nearly white: they are scaled to 8 bits (or to [0, 1] for masks) instead.
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def eight_bit(image):
    """A 16-bit greyscale PIL image as 8-bit "L" (value / 257, rounded), a float one (mode "F", as float TIFFs
    are read: values in [0, 1]) as "L" (value * 255, clipped; Pillow's own convert would read them as 0..255, an
    all-white mask as black); any other image as it is."""
    from PIL import Image

    if image.mode == "F":
        values = np.nan_to_num(np.asarray(image, np.float64), nan=0.0)
        return Image.fromarray((np.clip(values, 0, 1) * 255).round().astype(np.uint8))
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


def preprocess_images(images, scale_factor: int, what="image") -> np.ndarray:
    """PIL images or arrays (H, W, 3) (uint8, or float in [0, 1]) -> float32 NCHW in [-1, 1] (a control image:
    in [0, 1], as diffusers' control image processor leaves it).

    Sides are cut down to a multiple of `scale_factor` (Lanczos, as diffusers' VaeImageProcessor), with a
    warning that names the new size.
    """
    from PIL import Image

    out = []
    for image in as_list(images):
        image = to_pil(image, what).convert("RGB")
        size = multiple_size(image.size, scale_factor, what)
        if size != image.size:
            image = image.resize(size, Image.LANCZOS)
        out.append(np.asarray(image, np.float32) / 255.0)
    if len({a.shape for a in out}) > 1:
        raise ValueError(f"{what}s differ in size: {sorted({a.shape[:2] for a in out})}; give {what}s of one size")
    images = np.stack(out).transpose(0, 3, 1, 2)
    return images if what in ("control image", "adapter image") else images * 2.0 - 1.0  # [0, 1] for the nets


def preprocess_control_images(images, scale_factor: int) -> np.ndarray:
    """Control images -> float32 (B, 3, H, W) in [0, 1]."""
    return preprocess_images(images, scale_factor, "control image")


def preprocess_adapter_images(images, scale_factor: int, channels: int) -> np.ndarray:
    """T2I-Adapter pictures -> float32 (B, channels, H, W) in [0, 1]: RGB, or grey for a one-channel adapter
    (sketches), as diffusers reads a greyscale picture for it."""
    rgb = preprocess_images(images, scale_factor, "adapter image")
    if channels == 3:
        return rgb
    if channels != 1:
        raise ValueError(f"a T2I-Adapter with {channels} input channels: sdflax prepares RGB (3) or grey (1) pictures")
    from PIL import Image

    eight = np.round(rgb * 255).astype(np.uint8).transpose(0, 2, 3, 1)  # the pictures' 8-bit values
    grey = np.stack([np.asarray(Image.fromarray(image).convert("L")) for image in eight])  # PIL's weights
    return (grey[:, None] / np.float32(255)).astype(np.float32)


def preprocess_pictures(pictures: dict, scale_factor: int) -> list[np.ndarray]:
    """`prepare_inputs`' pictures by name ("images", "masks", "control_images") -> the arrays `__call__` takes,
    in that order."""
    if "masks" in pictures:  # (which says itself what is missing)
        out = list(preprocess_images_and_masks(pictures["images"], pictures["masks"], scale_factor))
    if any(picture is None for picture in pictures.values()):
        raise ValueError(f"give every picture: prepare_inputs(prompts, {', '.join(pictures)})")
    if "masks" not in pictures:
        out = [preprocess_images(pictures["images"], scale_factor)] if "images" in pictures else []
    if "control_images" in pictures:
        out.append(preprocess_control_images(pictures["control_images"], scale_factor))
    return out


def numpy_to_pil(images):
    """Float images in [0, 1], (..., H, W, 3) -> list of PIL images."""
    from PIL import Image

    images = np.asarray(images)
    images = images.reshape(-1, *images.shape[-3:])
    return [Image.fromarray((image * 255).round().astype(np.uint8)) for image in images]


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


def _size(image):
    """(width, height) of a PIL image or an (H, W, ...) array."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.size
    shape = np.shape(image)
    return shape[1], shape[0]


def preprocess_ip_adapter_masks(masks, height: int, width: int, scale_factor: int) -> np.ndarray:
    """One IP-Adapter's masks, one per picture -> float32 (1, n, height, width) in {0, 1}, as diffusers'
    IPAdapterMaskProcessor.preprocess(masks, height, width) (greyscale, Lanczos to the output size, binarised at
    0.5) and the (1, n, H, W) reshape its documentation shows."""
    from PIL import Image

    resized = []
    for k, mask in enumerate(as_list(masks, (2, 3))):
        if not isinstance(mask, Image.Image):
            array = np.asarray(mask)
            array = array[..., 0] if array.ndim == 3 and array.shape[-1] == 1 else array
            if array.dtype != np.uint8:  # float in [0, 1], as sdflax reads every picture
                array = (np.clip(np.asarray(array, np.float64), 0, 1) * 255).round().astype(np.uint8)
            mask = Image.fromarray(array)
        rgb = np.asarray(mask.convert("RGB"))
        if (rgb != rgb[..., :1]).any():  # greyscale at 0.5 would make a red mask black: it would do nothing
            raise ValueError(f"IP-Adapter mask {k} is coloured; masks are black and white (white: where its picture "
                             "acts), as diffusers' IPAdapterMaskProcessor reads them")
        resized.append(mask.convert("L").resize((width, height), Image.LANCZOS))
    return preprocess_masks(resized, scale_factor)[:, 0][None]
