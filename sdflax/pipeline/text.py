"""Text conditioning of a model family: which models and tokenizers it loads, how prompts become ids (on the host),
and how ids become what the UNet sees (`types.Cond`, in the program).

- `SDText`: SD 1.x / 2.x, one CLIP text encoder (its last hidden state).
- `SDXLText`: SDXL (Podell et al. 2023): two text encoders (the penultimate layer of each, concatenated; the
  second's projected pooled output conditions the UNet too), size and crop micro-conditioning (`time_ids`), zero
  negative embeddings when no negative prompt is given (`force_zeros_for_empty_prompt`). The refiner has the
  second encoder alone and an aesthetic score in its time ids (`requires_aesthetics_score`).

Each is a frozen value holding the encoders it runs; the class attributes describe the family to the loader.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..models import AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, UNet2DConditionModel
from ..loading.embeddings import expand_prompts
from .denoisers import UNetDenoiser
from .types import Cond


def prompt_length(components: dict) -> int:
    """The prompts' token length: the first CLIP encoder's. Tokenizers saved without model_max_length report a huge
    one; the text encoder knows its length (an SDXL refiner has the second encoder alone)."""
    tokenizer, encoder = next((components[t], components[e]) for t, e in (
        ("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")) if components.get(e) is not None)
    return min(tokenizer.model_max_length, encoder.config.max_position_embeddings)


def tokenize(tokenizer, prompts, max_length) -> np.ndarray:
    """Token ids (B, max_length) int32, padded and truncated as diffusers does; multi-vector textual-inversion
    tokens expanded to all their tokens."""
    ids = tokenizer(expand_prompts(prompts, tokenizer), padding="max_length", max_length=max_length,
                    truncation=True, return_tensors="np").input_ids
    return ids.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class SDText:
    """SD 1.x / 2.x: ids (B, 77), text states (B, 77, D) from one CLIP text encoder."""

    text_encoder: Any
    empty_ids: tuple  # the empty prompt's ids (1, 77), as nested tuples: part of the hashable spec
    dtype: Any = jnp.float32

    models = {"text_encoder": CLIPTextModel, "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    tokenizers = ("tokenizer",)
    ays_family = "sd1"  # whose Align Your Steps levels an "auto" schedule takes
    optional = ()  # components that may be null in model_index.json
    index_options = ()  # model_index.json entries the pipeline takes
    tokenizer_loaders = {}  # tokenizers that are not CLIP's: name -> loader(folder)
    denoiser = UNetDenoiser
    prompt_arguments = {"prompts_2": None}  # prepare_inputs' text arguments after prompts, with their defaults

    @staticmethod
    def check_components(parts):
        if parts.text_encoder is None or parts.tokenizer is None:
            raise ValueError("SD pipelines need text_encoder and tokenizer (this checkpoint has none: an SDXL "
                             "refiner? use StableDiffusionXLImg2Img)")
        if parts.unet.config.addition_embed_type is not None:
            raise ValueError("this UNet is an SDXL UNet (addition_embed_type='text_time'): use StableDiffusionXL")

    @staticmethod
    def prepare_ids(parts, prompts, prompts_2=None) -> np.ndarray:
        """Token ids (B, 77) int32."""
        if prompts_2:
            raise ValueError("prompts_2 is for SDXL's second text encoder; this pipeline has one: give prompts alone")
        return tokenize(parts.tokenizer, prompts, parts.max_length)

    def ids_tail(self, ids) -> tuple:
        """The shape ids must have after the batch (`ids`: the ids given): the empty prompt's."""
        return np.shape(self.empty_ids)[1:]

    @classmethod
    def build(cls, parts, empty_ids) -> "SDText":
        return cls(parts.text_encoder, frozen_ids(empty_ids), parts.dtype)

    @staticmethod
    def upcast_vae(vae) -> bool:
        return False

    @staticmethod
    def check_inputs(inputs):
        pass

    @staticmethod
    def can_guide(inputs) -> bool:
        """Whether classifier-free guidance may run: always (no negative prompt is the empty prompt's)."""
        return True

    def fill_inputs(self, inputs, height, width):
        return fill_negative(inputs, self.empty_ids)[0]

    def encode_prompt(self, params, prompt_ids):
        return self.text_encoder.apply(params["text_encoder"], prompt_ids).last_hidden_state

    def encode(self, params, inputs, settings) -> Cond:
        neg_ids = jnp.asarray(self.empty_ids) if inputs.neg_prompt_ids is None else inputs.neg_prompt_ids
        if settings.classifier_free_guidance and inputs.prompt_embeds is None and inputs.neg_prompt_embeds is None:
            # One text-encoder call on [negative; prompt] ids, 2B rows for any B: a batch of one compiles to other
            # kernels (XLA drops the unit dimension), and an image must not change with the batch it is made in.
            ids = inputs.prompt_ids
            both = jnp.concatenate([jnp.broadcast_to(neg_ids, ids.shape), ids])
            return Cond(self.encode_prompt(params, both).astype(self.dtype), {})
        embeds = inputs.prompt_embeds
        if embeds is None:
            embeds = self.encode_prompt(params, inputs.prompt_ids)
        neg = inputs.neg_prompt_embeds
        if neg is None:
            neg = jnp.broadcast_to(self.encode_prompt(params, neg_ids), embeds.shape)
        return Cond(jnp.concatenate([neg, embeds]).astype(self.dtype), {})


@dataclasses.dataclass(frozen=True)
class SDXLText:
    """SDXL: ids (B, 2, 77) (one row per tokenizer), states (B, 77, D1 + D2), pooled (B, P), time ids (B, 6).
    The refiner (no first encoder): ids (B, 1, 77), states (B, 77, D2), time ids (B, 5) with the aesthetic score."""

    text_encoder: Any  # None in a refiner
    text_encoder_2: Any
    empty_ids: tuple
    force_zeros_for_empty_prompt: bool
    requires_aesthetics_score: bool
    dtype: Any = jnp.float32

    models = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection,
              "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    tokenizers = ("tokenizer", "tokenizer_2")
    ays_family = "sdxl"
    optional = ("text_encoder", "tokenizer")  # null in a refiner's model_index.json
    index_options = ("force_zeros_for_empty_prompt", "requires_aesthetics_score")
    tokenizer_loaders = {}
    denoiser = UNetDenoiser
    prompt_arguments = {"prompts_2": None}

    @staticmethod
    def check_components(parts):
        if parts.unet.config.addition_embed_type != "text_time":
            raise ValueError("StableDiffusionXL needs an SDXL UNet (addition_embed_type='text_time'); this one has "
                             f"{parts.unet.config.addition_embed_type!r}: use StableDiffusion")
        if parts.text_encoder_2 is None or parts.tokenizer_2 is None:
            raise ValueError("SDXL pipelines need text_encoder_2 and tokenizer_2")
        if (parts.text_encoder is None) != (parts.tokenizer is None):
            raise ValueError("give text_encoder and tokenizer together (or neither, for a refiner)")
        unet, projection = parts.unet.config, parts.text_encoder_2.config.projection_dim
        ids = 5 if parts.requires_aesthetics_score else 6  # a refiner's aesthetic score replaces the target size
        given, expected = unet.addition_time_embed_dim * ids + projection, unet.projection_class_embeddings_input_dim
        if given != expected:
            other = unet.addition_time_embed_dim * {5: 6, 6: 5}[ids] + projection  # with the other layout
            hint = f"requires_aesthetics_score={ids == 6}" if other == expected else "the text_encoder_2 of this UNet"
            raise ValueError(f"the UNet takes {expected} pooled + time-id features, not {given} ({ids} time ids and "
                             f"a pooled embedding of {projection}): use {hint}")

    @staticmethod
    def prepare_ids(parts, prompts, prompts_2=None) -> np.ndarray:
        """Token ids (B, 2, 77) int32: `prompts` by the first tokenizer, `prompts_2` (diffusers' prompt_2; default,
        or empty: `prompts`) by the second (which pads with its own pad token, "!" in SDXL). A refiner's
        (B, 1, 77): `prompts` by its one tokenizer, the second."""
        if parts.tokenizer is None:
            if prompts_2:
                raise ValueError("this checkpoint has one text encoder (a refiner): give prompts alone, not prompts_2")
            rows = [(parts.tokenizer_2, prompts)]
        else:
            prompts_2 = prompts_2 or prompts  # as diffusers: an empty prompt_2 is prompt
            if len(prompts_2) != len(prompts):
                raise ValueError(f"{len(prompts_2)} prompts_2 for {len(prompts)} prompts: give one per prompt")
            rows = [(parts.tokenizer, prompts), (parts.tokenizer_2, prompts_2)]
        return np.stack([tokenize(tokenizer, texts, parts.max_length) for tokenizer, texts in rows], axis=1)

    def ids_tail(self, ids) -> tuple:
        """(2, 77), a refiner's (1, 77): the empty prompt's."""
        return np.shape(self.empty_ids)[1:]

    @classmethod
    def build(cls, parts, empty_ids) -> "SDXLText":
        return cls(parts.text_encoder, parts.text_encoder_2, frozen_ids(empty_ids), parts.force_zeros_for_empty_prompt,
                   parts.requires_aesthetics_score, parts.dtype)

    @staticmethod
    def upcast_vae(vae) -> bool:
        """SDXL's VAE overflows in float16: float32 where its config says force_upcast (`VAE` says when)."""
        return bool(vae.config.force_upcast)

    @staticmethod
    def check_inputs(inputs):
        check_pooled_with_states(inputs, "SDXL")

    can_guide = staticmethod(SDText.can_guide)

    def fill_inputs(self, inputs, height, width):
        """The size ids and aesthetic scores filled in before the compiled call, so that other values reuse the
        same program."""
        sizes = size_conditioning(height, width, inputs.original_size, inputs.crops_coords_top_left,
                                  inputs.target_size)
        scores = [jnp.asarray(default if given is None else given, jnp.float32) for given, default in
                  ((inputs.aesthetic_score, 6.0), (inputs.negative_aesthetic_score, 2.5))]  # diffusers' defaults
        inputs, filled = fill_negative(inputs, self.empty_ids)
        if inputs.neg_prompt_ids is not None:
            inputs = inputs.replace(no_negative_prompt=np.full(inputs.neg_prompt_ids.shape[:-2], filled))
        return inputs.replace(**dict(zip(("original_size", "crops_coords_top_left", "target_size"), sizes)),
                              **dict(zip(("aesthetic_score", "negative_aesthetic_score"), scores)))

    def encode_prompt(self, params, prompt_ids):
        """(B, 2, 77) ids -> (text states (B, 77, D1 + D2), pooled (B, P)): both encoders' penultimate layer,
        concatenated, and the second's projected pooled output, as diffusers' SDXL does (clip_skip None). A
        refiner's (B, 1, 77) ids: the second encoder's alone."""
        second = self.text_encoder_2.apply(params["text_encoder_2"], prompt_ids[:, -1], output_hidden_states=True)
        if self.text_encoder is None:
            return second.hidden_states[-2], second.text_embeds
        first = self.text_encoder.apply(params["text_encoder"], prompt_ids[:, 0], output_hidden_states=True)
        return jnp.concatenate([first.hidden_states[-2], second.hidden_states[-2]], axis=-1), second.text_embeds

    def encode(self, params, inputs, settings) -> Cond:
        """Text states and pooled embeddings from ids, or given (`prompt_embeds` with `pooled_prompt_embeds`, as
        `encode_prompt` returns them). Without a negative prompt the unconditional embeddings are zeros if the
        checkpoint says `force_zeros_for_empty_prompt`, else those of the empty prompt."""
        negatives_from_ids = inputs.neg_prompt_embeds is None and inputs.neg_prompt_ids is not None
        if negatives_from_ids and inputs.prompt_embeds is None:
            # One call of each encoder on [negative; prompt] ids, 2B rows for any B, as SD's: the encoders are in
            # the program once, and a batch of one runs the kernels of any other
            ids = inputs.prompt_ids
            states, pooled = self.encode_prompt(params, jnp.concatenate([jnp.broadcast_to(inputs.neg_prompt_ids,
                                                                                          ids.shape), ids]))
            (neg_context, context), (neg_pooled, pooled) = jnp.split(states, 2), jnp.split(pooled, 2)
        else:
            context, pooled = (self.encode_prompt(params, inputs.prompt_ids) if inputs.prompt_embeds is None
                               else (inputs.prompt_embeds, inputs.pooled_prompt_embeds))
            if negatives_from_ids:
                neg_context, neg_pooled = self.encode_prompt(params, inputs.neg_prompt_ids)
            elif inputs.neg_prompt_embeds is not None:
                neg_context, neg_pooled = inputs.neg_prompt_embeds, inputs.neg_pooled_prompt_embeds
            else:
                neg_context, neg_pooled = self.default_negative(params, context, pooled)
        if negatives_from_ids and inputs.no_negative_prompt is not None:  # chosen in the program: one for both calls
            default_context, default_pooled = self.default_negative(params, context, pooled)
            absent = inputs.no_negative_prompt
            neg_context = jnp.where(absent[:, None, None], default_context, neg_context)
            neg_pooled = jnp.where(absent[:, None], default_pooled, neg_pooled)
        ids, neg_ids = self.time_ids(inputs)
        batch = context.shape[0]
        unet_kwargs = {"text_embeds": jnp.concatenate([neg_pooled, pooled]),
                       "time_ids": jnp.concatenate([jnp.broadcast_to(neg_ids, (batch, neg_ids.shape[0])),
                                                    jnp.broadcast_to(ids, (batch, ids.shape[0]))])}
        return Cond(jnp.concatenate([neg_context, context]).astype(self.dtype), unet_kwargs)

    def default_negative(self, params, context, pooled):
        """The negative (states, pooled) of rows given no negative prompt: zeros if the checkpoint says
        `force_zeros_for_empty_prompt`, else the empty prompt's."""
        if self.force_zeros_for_empty_prompt:
            return jnp.zeros_like(context), jnp.zeros_like(pooled)
        neg_context, neg_pooled = self.encode_prompt(params, jnp.asarray(self.empty_ids))
        return jnp.broadcast_to(neg_context, context.shape), jnp.broadcast_to(neg_pooled, pooled.shape)

    def time_ids(self, inputs):
        """(time ids, the unconditional rows' time ids), from filled inputs (`fill_inputs`). Base: original size,
        crop, target size, the same for both (diffusers' negative_original_size is not taken). Refiner
        (requires_aesthetics_score): original size, crop, aesthetic score; the unconditional rows get crop (0, 0)
        (diffusers' default negative_crops_coords_top_left) and the negative aesthetic score."""
        original, crop = inputs.original_size.reshape(-1), inputs.crops_coords_top_left.reshape(-1)
        if not self.requires_aesthetics_score:
            ids = jnp.concatenate([original, crop, inputs.target_size.reshape(-1)])
            return ids, ids
        return (jnp.concatenate([original, crop, inputs.aesthetic_score.reshape(1)]),
                jnp.concatenate([original, jnp.zeros_like(crop), inputs.negative_aesthetic_score.reshape(1)]))


def check_pooled_with_states(inputs, family):
    """Given text states come with their pooled embedding (SDXL, SD 3)."""
    for states, pooled in (("prompt_embeds", "pooled_prompt_embeds"),
                           ("neg_prompt_embeds", "neg_pooled_prompt_embeds")):
        if (getattr(inputs, states) is None) != (getattr(inputs, pooled) is None):
            raise ValueError(f"{family} takes {states} and {pooled} together: (states, pooled) = "
                             "pipeline.encode_prompt(params, ids)")


def fill_negative(inputs, empty_ids):
    """(inputs, filled): `neg_prompt_ids` the empty prompt's ids where prompt ids came without a negative prompt
    (filled True), so that calls with and without one share a program; else as given (filled False)."""
    ids = inputs.prompt_ids
    if ids is None or inputs.prompt_embeds is not None or inputs.neg_prompt_ids is not None or \
            inputs.neg_prompt_embeds is not None:
        return inputs, False
    empty = np.asarray(empty_ids, np.int32)[0]  # (77,), SDXL (2, 77)
    xp = np if isinstance(ids, np.ndarray) else jnp
    return inputs.replace(neg_prompt_ids=xp.broadcast_to(empty.astype(ids.dtype), ids.shape)), True


def size_conditioning(height, width, original_size=None, crops_coords_top_left=None, target_size=None):
    """original (h, w), crop (top, left), target (h, w) as float32 arrays, sizes defaulting to (height, width)."""
    sizes = ((height, width) if original_size is None else original_size,
             (0, 0) if crops_coords_top_left is None else crops_coords_top_left,
             (height, width) if target_size is None else target_size)
    return [jnp.asarray(v, jnp.float32) for v in sizes]


def frozen_ids(ids) -> tuple:
    """Nested tuples of an int array's values (hashable, unlike the array)."""
    as_tuples = lambda x: tuple(map(as_tuples, x)) if isinstance(x, list) else x  # noqa: E731
    return as_tuples(np.asarray(ids).tolist())
