"""Flux.1 Redux (Black Forest Labs 2024), as diffusers' `FluxPriorReduxPipeline`: an image becomes the prompt of a
Flux pipeline. SigLIP's last hidden states, through the Redux image embedder, are appended to the T5 states as
image tokens; the pooled embedding stays CLIP's. Without a text prompt both are zeros (T5-XXL's 512 tokens, CLIP-L's
768 pooled features), as diffusers' pipeline without text encoders. Each image's embeddings are scaled and the
images summed into one prompt."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from ..models.redux import ReduxImageEncoder
from ..models.siglip import SiglipVisionModel
from .clip_image import siglip_image_inputs

T5_TOKENS = 512  # diffusers' zero prompt: max_sequence_length 512 ...
CLIP_POOLED = 768  # ... and CLIP-L's pooled width, whatever the checkpoint


@dataclasses.dataclass(frozen=True, eq=False)
class FluxPriorRedux:
    """`redux, params = FluxPriorRedux.from_pretrained(folder)`; `redux(params, redux.prepare_image(pictures))` ->
    (prompt_embeds (1, T + N, D), pooled_prompt_embeds (1, P)) for a Flux pipeline's `prompt_embeds` and
    `pooled_prompt_embeds`."""

    image_encoder: SiglipVisionModel
    image_embedder: ReduxImageEncoder

    def __post_init__(self):
        width, redux_dim = self.image_encoder.config.hidden_size, self.image_embedder.config.redux_dim
        if width != redux_dim:
            raise ValueError(f"the Redux image embedder takes SigLIP states {redux_dim} wide (redux_dim), the image "
                             f"encoder's are {width}: use the image_encoder of the Redux checkpoint")

    @classmethod
    def from_pretrained(cls, path_or_repo_id, revision=None, dtype=jnp.float32):
        """(redux, params) from a Redux folder or hub id (image_encoder/: SiglipVisionModel, image_embedder/:
        ReduxImageEncoder)."""
        from ..loading.folders import checkpoint_files
        from ..loading.hub import resolve_folder

        parts = ("image_encoder", "image_embedder")
        folder = resolve_folder(path_or_repo_id, revision, allow_patterns=checkpoint_files(None, parts, ()))
        for part in parts:
            if not os.path.isfile(os.path.join(folder, part, "config.json")):
                raise ValueError(f"{path_or_repo_id} has no {part}/config.json: a Flux Redux checkpoint holds "
                                 "image_encoder/ (SigLIP) and image_embedder/ (black-forest-labs/FLUX.1-Redux-dev)")
        (encoder, encoder_params), (embedder, embedder_params) = (
            model.from_pretrained(folder, subfolder=part, dtype=dtype)
            for model, part in ((SiglipVisionModel, "image_encoder"), (ReduxImageEncoder, "image_embedder")))
        return cls(encoder, embedder), {"image_encoder": encoder_params, "image_embedder": embedder_params}

    def prepare_image(self, images) -> np.ndarray:
        """Pictures (PIL or arrays; one, or a list) -> SigLIP's pixels (B, 3, S, S), as the Redux feature extractor
        makes them at the image encoder's size."""
        return siglip_image_inputs(images, size=self.image_encoder.config.image_size)

    def __call__(self, params, pixels, prompt_embeds=None, pooled_prompt_embeds=None, prompt_embeds_scale=1.0,
                 pooled_prompt_embeds_scale=1.0):
        """(prompt_embeds, pooled_prompt_embeds), each image's scaled by its scale (a number, or one per image;
        traced) and summed. `prompt_embeds` (B or 1, T, D) and `pooled_prompt_embeds` (B or 1, P): a text prompt's
        (a Flux pipeline's `encode_prompt`); None: zeros."""
        pixels = jnp.asarray(pixels, jnp.float32)
        if pixels.ndim != 4:
            raise ValueError(f"pixels of shape {pixels.shape}: give SigLIP pixels (B, 3, S, S), "
                             "redux.prepare_image(pictures) makes them")
        if (prompt_embeds is None) != (pooled_prompt_embeds is None):
            raise ValueError("give prompt_embeds with pooled_prompt_embeds (a Flux pipeline's encode_prompt), or "
                             "neither")
        b = pixels.shape[0]
        width = self.image_embedder.config.txt_in_features
        if prompt_embeds is None:
            prompt_embeds, pooled_prompt_embeds = np.zeros((1, T5_TOKENS, width)), np.zeros((1, CLIP_POOLED))
        states, pooled = (jnp.asarray(x, jnp.float32) for x in (prompt_embeds, pooled_prompt_embeds))
        if states.ndim != 3 or states.shape[-1] != width or states.shape[0] not in (1, b):
            raise ValueError(f"prompt_embeds of shape {states.shape}: the Redux image tokens are {width} wide; give "
                             f"(1 or {b}, T, {width}), one row for every image or one per image")
        if pooled.ndim != 2 or pooled.shape[0] not in (1, b):
            raise ValueError(f"pooled_prompt_embeds of shape {pooled.shape}: give (1 or {b}, P)")
        scales = tuple(per_image(s, b, name) for s, name in ((prompt_embeds_scale, "prompt_embeds_scale"),
                                                            (pooled_prompt_embeds_scale, "pooled_prompt_embeds_scale")))
        return self._embeds(params, pixels, states, pooled, *scales)

    @functools.cached_property
    def _embeds(self):
        @jax.jit
        def embeds(params, pixels, states, pooled, scale, pooled_scale):
            dtype = self.image_encoder.dtype
            hidden = self.image_encoder.apply(params["image_encoder"], pixels.astype(dtype)).last_hidden_state
            image_tokens = self.image_embedder.apply(params["image_embedder"], hidden).astype(jnp.float32)
            states = jnp.broadcast_to(states, (pixels.shape[0], *states.shape[1:]))
            joint = jnp.concatenate([states, image_tokens], axis=1) * scale[:, None, None]
            pooled = jnp.broadcast_to(pooled, (pixels.shape[0], pooled.shape[-1])) * pooled_scale[:, None]
            return joint.sum(0, keepdims=True), pooled.sum(0, keepdims=True)

        return embeds


def per_image(scale, images: int, name: str):
    """A number, or one per image, as a traced (images,) array."""
    values = jnp.asarray(scale, jnp.float32)
    if values.ndim > 1 or values.ndim == 1 and values.shape[0] != images:
        raise ValueError(f"{name} of shape {values.shape}: give one number, or one per image ({images})")
    return jnp.broadcast_to(values, (images,))
