"""CLIP score (Hessel et al. 2021) as torchmetrics' `CLIPScore` defines it: 100 · cos(E_image, E_text) of each
picture and its prompt, averaged, then clipped at 0: max(100 · mean cos, 0). The embeddings are a transformers
`CLIPModel`'s `get_image_features` and `get_text_features` (its towers and projections), made by sdflax's CLIP text
and vision towers; pictures are prepared as CLIP's image processor prepares them (`clip_image_inputs`), prompts
tokenized, padded and cut at the text tower's length (77) as torchmetrics does it."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .pictures import batches, pictures


@dataclasses.dataclass(frozen=True)
class CLIP:
    """A CLIPModel's two towers and their params, its tokenizer and image preprocessing (`load_clip`)."""

    text: Any  # CLIPTextModelWithProjection
    text_params: Any
    vision: Any  # CLIPVisionModelWithProjection
    vision_params: Any
    tokenizer: Any
    image_options: dict  # clip_image_inputs' keywords
    source: str
    encode_text: Any = dataclasses.field(repr=False, default=None)
    encode_images: Any = dataclasses.field(repr=False, default=None)

    def __post_init__(self):  # one program per batch shape, for as long as this value lives
        object.__setattr__(self, "encode_text", jax.jit(lambda p, ids: self.text.apply(p, ids).text_embeds))
        object.__setattr__(self, "encode_images", jax.jit(lambda p, x: self.vision.apply(p, x).image_embeds))


def tower_config(config: dict, tower: str) -> dict:
    """A tower's config from a CLIPConfig, with the model's projection width (CLIPModel projects both towers to
    the top-level `projection_dim`)."""
    from ..models.config import ConfigError, config_source

    nested = config.get(f"{tower}_config")
    if not isinstance(nested, dict):
        raise ConfigError(f"{config_source(config)}not a CLIPModel config (no {tower}_config): give the folder of a "
                          "transformers CLIPModel, e.g. openai/clip-vit-large-patch14")
    return {**nested, **({"projection_dim": config["projection_dim"]} if "projection_dim" in config else {})}


def load_clip(path_or_repo_id, revision=None, dtype=jnp.float32) -> CLIP:
    """A transformers CLIPModel folder or hub id (config.json, weights, tokenizer, preprocessor_config.json)."""
    from ..loading.assemble import assemble
    from ..loading.folders import load_tokenizer
    from ..loading.hub import resolve_folder
    from ..loading.weights import read_weights
    from ..models import CLIPTextModelWithProjection, CLIPVisionModelWithProjection
    from ..models.config import read_config_file
    from ..pipeline.clip_image import clip_image_options

    folder = resolve_folder(path_or_repo_id, revision, allow_patterns=[
        "config.json", "model.safetensors", "preprocessor_config.json", "tokenizer*", "vocab.json", "merges.txt",
        "special_tokens_map.json"])
    config = read_config_file(os.path.join(folder, "config.json"))
    configs = {tower: tower_config(config, tower) for tower in ("text", "vision")}

    def tensors(tower, _):
        state = {k: v for k, v in read_weights(folder).items() if k != "logit_scale"}  # the loss's temperature
        is_vision = lambda k: k.startswith(("vision_model.", "visual_projection."))  # noqa: E731
        return f"{folder} ({tower} tower)", {k: v for k, v in state.items() if is_vision(k) == (tower == "vision")}

    modules, params, _ = assemble({"text": CLIPTextModelWithProjection, "vision": CLIPVisionModelWithProjection},
                                  configs, tensors, dtype)
    preprocessor = os.path.join(folder, "preprocessor_config.json")
    size = modules["vision"].config.image_size
    options = clip_image_options(preprocessor) if os.path.isfile(preprocessor) else {"size": size, "crop_size": size}
    return CLIP(modules["text"], params["text"], modules["vision"], params["vision"], load_tokenizer(folder), options,
                str(path_or_repo_id))


def text_ids(clip: CLIP, prompts) -> np.ndarray:
    """(B, 77) ids: padded with the tokenizer's pad token, a longer prompt cut at 77 ids (its end-of-text token cut
    off too, as torchmetrics cuts it)."""
    length = clip.text.config.max_position_embeddings
    ids = clip.tokenizer(list(prompts), padding="max_length", max_length=length).input_ids
    return np.asarray([row[:length] for row in ids], np.int32)


def normalized(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def padded(x, size):
    return np.concatenate([x, np.zeros((size - len(x), *x.shape[1:]), x.dtype)]) if len(x) < size else x


def clip_scores(images, prompts, clip, batch_size=32) -> np.ndarray:
    """(N,) 100 · cos of each picture's and its prompt's embeddings (before the mean and the clip at 0).
    `images`: a folder (pictures sorted by name), an (N, H, W, 3) array or a list of arrays and PIL images;
    `prompts`: a list of N texts; `clip`: a CLIPModel folder or hub id, or `load_clip`'s value."""
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts: a list of texts, one per picture")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: a positive whole number")
    clip = clip if isinstance(clip, CLIP) else load_clip(clip)
    from ..pipeline.clip_image import clip_image_inputs

    scores, done = [], 0
    for batch in batches(pictures(images), batch_size):
        if done + len(batch) > len(prompts):
            raise ValueError(f"more pictures than the {len(prompts)} prompts: give one prompt per picture")
        size = batch_size if done else len(batch)  # after the first batch, every batch at the first's shape
        pixels = padded(clip_image_inputs(batch, **clip.image_options), size)
        image_embeds = clip.encode_images(clip.vision_params, jnp.asarray(pixels, clip.vision.dtype))
        text_embeds = clip.encode_text(clip.text_params, padded(text_ids(clip, prompts[done:done + len(batch)]), size))
        scores.append(100 * (normalized(image_embeds) * normalized(text_embeds)).sum(-1)[:len(batch)])
        done += len(batch)
    if done != len(prompts) or not done:
        raise ValueError(f"{done} pictures and {len(prompts)} prompts: give one prompt per picture")
    return np.concatenate(scores)


def clip_score(images, prompts, clip, batch_size=32) -> float:
    """torchmetrics' CLIPScore: max(mean of 100 · cos(image, prompt), 0)."""
    return float(max(clip_scores(images, prompts, clip, batch_size).mean(), 0.0))
