"""Pictures -> the pixel values CLIP's image tower takes (`CLIPVisionModelWithProjection`), as transformers'
CLIPImageProcessor makes them with its PIL backend (CLIPImageProcessorPil: what transformers 5 falls back to without
torchvision, and what transformers 4 always ran): RGB with transparency over white, the shortest side resized to
`size` with PIL's bicubic filter, a centred crop, scaled by 1/255, then normalised by CLIP's mean and std.
SigLIP's (`siglip_image_inputs`): the same, resized to a square without a crop, mean and std 0.5."""

from __future__ import annotations

import os

import numpy as np

from ..models.config import SOURCE_KEY, ConfigError, config_source, read_config_file
from .images import as_list, to_pil

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' OPENAI_CLIP_MEAN and OPENAI_CLIP_STD
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL's (and transformers' PILImageResampling) number for the bicubic filter


# The most pixels a picture becomes on its way to the image encoder (8192 x 8192, as sdflax reads at most)
MAX_RESIZED_PIXELS = 8192 * 8192


def clip_image_inputs(images, size=224, crop_size=224, mean=CLIP_MEAN, std=CLIP_STD) -> np.ndarray:
    """PIL images or (H, W, C) arrays (uint8, or float in [0, 1] as sdflax reads every picture) -> float32
    (B, 3, crop height, crop width). `size` is the shortest side after resizing, `crop_size` an int or
    (height, width); a crop larger than the resized picture is padded with black, as transformers pads it."""
    from PIL import Image

    crop_height, crop_width = (crop_size, crop_size) if isinstance(crop_size, int) else crop_size
    mean, std = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    out = []
    for image in as_list(images, (2, 3)):  # (H, W): one grey picture
        image = rgb(image)
        width, height = image.size
        short, long = sorted((width, height))
        new_long = int(size * long / short)  # transformers' rounding (down), as torchvision's Resize
        if size * new_long > MAX_RESIZED_PIXELS:  # a 1-pixel-wide strip would grow without bound
            raise ValueError(f"an image of {width}x{height} pixels, resized to {size} on its short side for the "
                             f"image encoder, would be {size}x{new_long}: crop it nearer to a square (at most "
                             f"{MAX_RESIZED_PIXELS // size // size}:1)")
        image = image.resize((size, new_long) if width <= height else (new_long, size), Image.Resampling.BICUBIC)
        out.append(normalised(center_crop(np.asarray(image), crop_height, crop_width), mean, std))
    if not out:
        raise ValueError("clip_image_inputs: no images given")
    return np.stack(out)


def siglip_image_inputs(images, size=224) -> np.ndarray:
    """Pictures -> the pixel values SigLIP's image tower takes (`SiglipVisionModel`), as transformers'
    SiglipImageProcessorPil makes them: RGB, resized to size x size (bicubic, no crop), scaled by 1/255,
    normalised by mean and std 0.5. (B, 3, size, size) float32."""
    from PIL import Image

    half = np.full(3, 0.5, np.float32)  # transformers' IMAGENET_STANDARD_MEAN and _STD
    out = [normalised(np.asarray(rgb(image).resize((size, size), Image.Resampling.BICUBIC)), half, half)
           for image in as_list(images, (2, 3))]
    if not out:
        raise ValueError("siglip_image_inputs: no images given")
    return np.stack(out)


def normalised(pixels, mean, std) -> np.ndarray:
    """uint8 (H, W, 3) -> (3, H, W): transformers' rescale by 1/255 (in float64), then (x - mean) / std."""
    scaled = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
    return ((scaled - mean) / std).transpose(2, 0, 1)


def rgb(image):
    """A PIL RGB image; transparency is composited over white as transformers' convert_to_rgb does (in floats,
    rounded, for a uint8 array; by PIL's alpha_composite for a PIL image)."""
    from PIL import Image

    if isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[-1] == 4:
        alpha = image[..., 3:] / 255
        image = np.round(alpha * image[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    image = to_pil(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA"))
    return image.convert("RGB")


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop of an (H, W, C) array: the window starts at (side - crop) // 2; a side shorter
    than the crop is padded with zeros instead, the odd row or column on top or left."""
    for axis, crop in ((0, height), (1, width)):
        side = pixels.shape[axis]
        if side < crop:
            before = (crop - side + 1) // 2
            pixels = np.pad(pixels, [(before, crop - side - before) if a == axis else (0, 0) for a in range(3)])
        else:
            start = (side - crop) // 2
            pixels = pixels[start:start + crop] if axis == 0 else pixels[:, start:start + crop]
    return pixels


def clip_image_options(config) -> dict:
    """clip_image_inputs' keywords from a preprocessor_config.json (its path, or the dict); a setting that
    clip_image_inputs does not follow (no resize, another filter, ...) is one ConfigError naming it."""
    if not isinstance(config, dict):
        if not os.path.isfile(config):
            raise FileNotFoundError(f"no preprocessor_config.json at {config}")
        config = read_config_file(config)
    where = f"{config_source(config)}preprocessor config: "
    fixed = {"do_resize": True, "do_center_crop": True, "do_rescale": True, "do_normalize": True,
             "do_convert_rgb": True, "resample": BICUBIC}
    for key, value in fixed.items():
        if config.get(key, value) != value:
            raise ConfigError(f"{where}{key}={config[key]!r:.100}; sdflax's CLIP preprocessing does only {value!r}")
    factor = config.get("rescale_factor", 1 / 255)
    if not isinstance(factor, (int, float)) or abs(factor - 1 / 255) > 1e-12:
        raise ConfigError(f"{where}rescale_factor={factor!r:.100}; sdflax's CLIP preprocessing scales by 1/255")
    # read_config_file marks nested objects with their file too
    size, crop = ({k: v for k, v in value.items() if k != SOURCE_KEY} if isinstance(value, dict) else value
                  for value in (config.get("size", 224), config.get("crop_size", 224)))
    if isinstance(size, dict) and set(size) - {"shortest_edge"} == set():
        size = size.get("shortest_edge")
    if isinstance(crop, dict) and set(crop) == {"height", "width"}:
        crop = (crop["height"], crop["width"])
    if not positive_int(size):
        raise ConfigError(f"{where}size={config['size']!r:.100}; expected an int or {{\"shortest_edge\": int}}")
    if not (positive_int(crop) or isinstance(crop, tuple) and all(map(positive_int, crop))):
        raise ConfigError(f"{where}crop_size={config['crop_size']!r:.100}; expected an int or "
                          "{\"height\": int, \"width\": int}")
    options = {"size": size, "crop_size": crop}
    for key, name in (("image_mean", "mean"), ("image_std", "std")):
        value = config.get(key, CLIP_MEAN if name == "mean" else CLIP_STD)
        if not (isinstance(value, (list, tuple)) and len(value) == 3
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise ConfigError(f"{where}{key}={value!r:.100}; expected three numbers, one per RGB channel")
        if name == "std" and any(v <= 0 for v in value):
            raise ConfigError(f"{where}{key}={value!r:.100}; a standard deviation must be positive")
        options[name] = tuple(value)
    return options


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
