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
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..models import AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, UNet2DConditionModel
from ..models.layers import LayerNorm
from ..loading.embeddings import expand_prompts
from .denoisers import UNetDenoiser
from .prompt_weighting import encode_chunks, padded_chunks, weighted_ids
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
    # prepare_inputs' text arguments after prompts, with their defaults
    prompt_arguments = {"prompts_2": None, "weighting": None}
    # the call's arguments of A1111's prompts (`prompt_weighting`) and of the encoders' layer (static)
    call_arguments = {"prompt_weights": None, "neg_prompt_weights": None, "clip_skip": None}

    @staticmethod
    def check_components(parts):
        if parts.text_encoder is None or parts.tokenizer is None:
            raise ValueError("SD pipelines need text_encoder and tokenizer (this checkpoint has none: an SDXL "
                             "refiner? use StableDiffusionXLImg2Img)")
        if parts.unet.config.addition_embed_type is not None:
            raise ValueError("this UNet is an SDXL UNet (addition_embed_type='text_time'): use StableDiffusionXL")

    @staticmethod
    def prepare_ids(parts, prompts, prompts_2=None, weighting=None):
        """Token ids (B, 77) int32; with weighting="a1111", A1111's prompt syntax: (ids, weights) (B, 77 k)."""
        if prompts_2:
            raise ValueError("prompts_2 is for SDXL's second text encoder; this pipeline has one: give prompts alone")
        if a1111_weighting(weighting):
            return weighted_ids(parts.tokenizer, prompts, parts.max_length)
        return tokenize(parts.tokenizer, prompts, parts.max_length)

    def ids_tail(self, ids) -> tuple:
        """The shape ids must have after the batch (`ids`: the ids given): the empty prompt's, or k chunks of it."""
        return chunked_tail(self.empty_ids, ids)

    @classmethod
    def build(cls, parts, empty_ids) -> "SDText":
        return cls(parts.text_encoder, frozen_ids(empty_ids), parts.dtype)

    @staticmethod
    def upcast_vae(vae) -> bool:
        return False

    @staticmethod
    def check_inputs(inputs):
        check_weights(inputs)

    def match_chunks(self, inputs):
        return matched_chunks(inputs, self.empty_ids)

    @staticmethod
    def can_guide(inputs) -> bool:
        """Whether classifier-free guidance may run: always (no negative prompt is the empty prompt's)."""
        return True

    def fill_inputs(self, inputs, height, width):
        return fill_negative(inputs, self.empty_ids)[0]

    def encode_prompt(self, params, prompt_ids, weights=None, clip_skip=None):
        """ids (B, 77 k) -> states (B, 77 k, D), each chunk of 77 encoded alone; `weights`: A1111's emphasis
        (`prompt_weighting`); `clip_skip`: diffusers' (1: the pre-final layer, through the final layer norm)."""
        check_clip_skip(clip_skip, self.text_encoder)

        def encode(ids):
            out = self.text_encoder.apply(params["text_encoder"], ids, output_hidden_states=clip_skip is not None)
            if clip_skip is None:
                return (out.last_hidden_state,)
            return (final_layer_norm(self.text_encoder, params["text_encoder"], out.hidden_states[-(clip_skip + 1)]),)

        return encode_chunks(encode, prompt_ids, weights, np.shape(self.empty_ids)[-1])[0]

    def encode(self, params, inputs, settings) -> Cond:
        neg_ids = jnp.asarray(self.empty_ids) if inputs.neg_prompt_ids is None else inputs.neg_prompt_ids
        weights, neg_weights = inputs.prompt_weights, inputs.neg_prompt_weights
        clip_skip = settings.clip_skip
        if settings.classifier_free_guidance and inputs.prompt_embeds is None and inputs.neg_prompt_embeds is None:
            # One text-encoder call on [negative; prompt] ids, 2B rows for any B: a batch of one compiles to other
            # kernels (XLA drops the unit dimension), and an image must not change with the batch it is made in.
            ids = inputs.prompt_ids
            both = jnp.concatenate([jnp.broadcast_to(neg_ids, ids.shape), ids])
            return Cond(self.encode_prompt(params, both, both_weights(neg_weights, weights, ids.shape),
                                           clip_skip).astype(self.dtype), {})
        embeds = inputs.prompt_embeds
        if embeds is None:
            embeds = self.encode_prompt(params, inputs.prompt_ids, weights, clip_skip)
        neg = inputs.neg_prompt_embeds
        if neg is None:
            neg = jnp.broadcast_to(self.encode_prompt(params, neg_ids, neg_weights, clip_skip), embeds.shape)
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
    prompt_arguments = SDText.prompt_arguments
    call_arguments = SDText.call_arguments

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
    def prepare_ids(parts, prompts, prompts_2=None, weighting=None):
        """Token ids (B, 2, 77) int32: `prompts` by the first tokenizer, `prompts_2` (diffusers' prompt_2; default,
        or empty: `prompts`) by the second (which pads with its own pad token, "!" in SDXL). A refiner's
        (B, 1, 77): `prompts` by its one tokenizer, the second. With weighting="a1111", A1111's prompt syntax:
        (ids, weights) (B, 2, 77 k), both rows of k chunks."""
        if parts.tokenizer is None:
            if prompts_2:
                raise ValueError("this checkpoint has one text encoder (a refiner): give prompts alone, not prompts_2")
            rows = [(parts.tokenizer_2, prompts)]
        else:
            prompts_2 = prompts_2 or prompts  # as diffusers: an empty prompt_2 is prompt
            if len(prompts_2) != len(prompts):
                raise ValueError(f"{len(prompts_2)} prompts_2 for {len(prompts)} prompts: give one per prompt")
            rows = [(parts.tokenizer, prompts), (parts.tokenizer_2, prompts_2)]
        if a1111_weighting(weighting):
            made = [weighted_ids(tokenizer, texts, parts.max_length) for tokenizer, texts in rows]
            count = max(ids.shape[-1] for ids, _ in made) // parts.max_length
            made = [weighted_ids(tokenizer, texts, parts.max_length, count) for tokenizer, texts in rows]
            return tuple(np.stack(arrays, axis=1) for arrays in zip(*made))
        return np.stack([tokenize(tokenizer, texts, parts.max_length) for tokenizer, texts in rows], axis=1)

    def ids_tail(self, ids) -> tuple:
        """(2, 77), a refiner's (1, 77): the empty prompt's, or k chunks of it."""
        return chunked_tail(self.empty_ids, ids)

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
        check_weights(inputs)

    match_chunks = SDText.match_chunks

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

    def encode_prompt(self, params, prompt_ids, weights=None, clip_skip=None):
        """(B, 2, 77 k) ids -> (text states (B, 77 k, D1 + D2), pooled (B, P)): both encoders' penultimate layer
        (diffusers' `clip_skip` layers before it), concatenated, and the second's projected pooled output of the
        first chunk, as diffusers' SDXL does and A1111's; each chunk of 77 encoded alone, each encoder's states
        weighted by A1111's emphasis where `weights` (as the ids) are given. A refiner's (B, 1, 77 k) ids: the
        second encoder's alone."""
        length, layer = np.shape(self.empty_ids)[-1], -2 - (clip_skip or 0)

        def encoded(name, row):
            encoder = getattr(self, name)
            check_clip_skip(clip_skip, encoder, 1)

            def encode(ids):
                out = encoder.apply(params[name], ids, output_hidden_states=True)
                return out.hidden_states[layer], *([] if out.text_embeds is None else [out.text_embeds])

            return encode_chunks(encode, prompt_ids[:, row], None if weights is None else weights[:, row], length)

        second, pooled = encoded("text_encoder_2", -1)
        if self.text_encoder is None:
            return second, pooled
        first, = encoded("text_encoder", 0)
        return jnp.concatenate([first, second], axis=-1), pooled

    def encode(self, params, inputs, settings) -> Cond:
        """Text states and pooled embeddings from ids, or given (`prompt_embeds` with `pooled_prompt_embeds`, as
        `encode_prompt` returns them). Without a negative prompt the unconditional embeddings are zeros if the
        checkpoint says `force_zeros_for_empty_prompt`, else those of the empty prompt."""
        negatives_from_ids = inputs.neg_prompt_embeds is None and inputs.neg_prompt_ids is not None
        weights, neg_weights, clip_skip = inputs.prompt_weights, inputs.neg_prompt_weights, settings.clip_skip
        if negatives_from_ids and inputs.prompt_embeds is None:
            # One call of each encoder on [negative; prompt] ids, 2B rows for any B, as SD's: the encoders are in
            # the program once, and a batch of one runs the kernels of any other
            ids = inputs.prompt_ids
            states, pooled = self.encode_prompt(params, jnp.concatenate([jnp.broadcast_to(inputs.neg_prompt_ids,
                                                                                          ids.shape), ids]),
                                                both_weights(neg_weights, weights, ids.shape), clip_skip)
            (neg_context, context), (neg_pooled, pooled) = jnp.split(states, 2), jnp.split(pooled, 2)
        else:
            context, pooled = (self.encode_prompt(params, inputs.prompt_ids, weights, clip_skip)
                               if inputs.prompt_embeds is None
                               else (inputs.prompt_embeds, inputs.pooled_prompt_embeds))
            if negatives_from_ids:
                neg_context, neg_pooled = self.encode_prompt(params, inputs.neg_prompt_ids, neg_weights, clip_skip)
            elif inputs.neg_prompt_embeds is not None:
                neg_context, neg_pooled = inputs.neg_prompt_embeds, inputs.neg_pooled_prompt_embeds
            else:
                neg_context, neg_pooled = self.default_negative(params, context, pooled, clip_skip)
        if negatives_from_ids and inputs.no_negative_prompt is not None:  # chosen in the program: one for both calls
            default_context, default_pooled = self.default_negative(params, context, pooled, clip_skip)
            absent = inputs.no_negative_prompt
            neg_context = jnp.where(absent[:, None, None], default_context, neg_context)
            neg_pooled = jnp.where(absent[:, None], default_pooled, neg_pooled)
        ids, neg_ids = self.time_ids(inputs)
        batch = context.shape[0]
        unet_kwargs = {"text_embeds": jnp.concatenate([neg_pooled, pooled]),
                       "time_ids": jnp.concatenate([jnp.broadcast_to(neg_ids, (batch, neg_ids.shape[0])),
                                                    jnp.broadcast_to(ids, (batch, ids.shape[0]))])}
        return Cond(jnp.concatenate([neg_context, context]).astype(self.dtype), unet_kwargs)

    def default_negative(self, params, context, pooled, clip_skip=None):
        """The negative (states, pooled) of rows given no negative prompt: zeros if the checkpoint says
        `force_zeros_for_empty_prompt`, else the empty prompt's (as many chunks as `context`)."""
        if self.force_zeros_for_empty_prompt:
            return jnp.zeros_like(context), jnp.zeros_like(pooled)
        empty = np.asarray(self.empty_ids)
        chunks = context.shape[1] // empty.shape[-1]
        neg_context, neg_pooled = self.encode_prompt(params, jnp.asarray(np.tile(empty, chunks)), None, clip_skip)
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


def a1111_weighting(weighting) -> bool:
    """prepare_inputs' `weighting`: None (diffusers' prompts, cut at 77 tokens) or "a1111"."""
    if weighting not in (None, "a1111"):
        raise ValueError(f"weighting={weighting!r}: None (the prompts as diffusers reads them, cut at 77 tokens) or "
                         "'a1111' (A1111's (word:1.2) syntax, prompts past 77 tokens in chunks)")
    return weighting is not None


def chunked_tail(empty_ids, ids) -> tuple:
    """The shape after the batch of ids of k chunks (k as `ids` have it: a multiple of the empty prompt's length)."""
    tail = np.shape(empty_ids)[1:]
    given = np.shape(ids)[-1] if ids is not None and np.ndim(ids) else 0
    return (*tail[:-1], given) if given and given % tail[-1] == 0 else tail


def check_weights(inputs):
    """A1111's token weights come with ids of their shape (prepare_inputs(prompts, weighting="a1111"))."""
    for name, ids_name in (("prompt_weights", "prompt_ids"), ("neg_prompt_weights", "neg_prompt_ids")):
        weights, ids = getattr(inputs, name), getattr(inputs, ids_name)
        if weights is None:
            continue
        if ids is None or np.shape(weights) != np.shape(ids):
            given = "no ids" if ids is None else f"{ids_name} of {np.shape(ids)}"
            raise ValueError(f"{name} has shape {np.shape(weights)} for {given}: give the ids and weights of "
                             "pipeline.prepare_inputs(prompts, weighting='a1111') together")


def matched_chunks(inputs, empty_ids):
    """Prompt and negative ids (and weights) of one chunk count: the shorter padded with empty chunks, as A1111's
    "pad prompt/negative prompt to be same length" pads the shorter with the empty prompt's states."""
    ids, neg = inputs.prompt_ids, inputs.neg_prompt_ids
    length = np.shape(empty_ids)[-1]
    if ids is None or neg is None or np.ndim(ids) != np.ndim(neg) or ids.shape[-1] == neg.shape[-1] or \
            ids.shape[-1] % length or neg.shape[-1] % length:
        return inputs
    empty, count = np.asarray(empty_ids, np.int32)[0], max(ids.shape[-1], neg.shape[-1]) // length
    ids, weights = padded_chunks(ids, inputs.prompt_weights, empty, count)
    neg, neg_weights = padded_chunks(neg, inputs.neg_prompt_weights, empty, count)
    return inputs.replace(prompt_ids=ids, prompt_weights=weights, neg_prompt_ids=neg, neg_prompt_weights=neg_weights)


def both_weights(neg_weights, weights, shape):
    """The weights of [negative; prompt] ids of `shape` each: None where neither has any, else ones for the one
    without."""
    if neg_weights is None and weights is None:
        return None
    ones = jnp.ones(shape, jnp.float32)
    return jnp.concatenate([jnp.broadcast_to(w if w is not None else ones, shape) for w in (neg_weights, weights)])


def check_clip_skip(clip_skip, encoder, extra=0):
    """diffusers' clip_skip: None, or a number of layers the encoder has (`extra`: before SDXL's penultimate; the
    most skips all, leaving the token embeddings)."""
    most = encoder.config.num_hidden_layers - extra
    if clip_skip is not None and (isinstance(clip_skip, bool) or not isinstance(clip_skip, numbers.Integral) or
                                  not 0 <= clip_skip <= most):
        raise ValueError(f"clip_skip={clip_skip!r}: a whole number from 0 to {most}, the layers skipped at the end "
                         f"of this {encoder.config.num_hidden_layers}-layer text encoder (A1111's Clip skip 2 is 1)")


def final_layer_norm(encoder, params, states):
    """The text encoder's final layer norm on a layer's states (diffusers' clip_skip for SD 1.x / 2.x)."""
    tree = params.get("params", params)
    return LayerNorm(encoder.config.layer_norm_eps, dtype=encoder.dtype).apply(
        {"params": tree["final_layer_norm"]}, states)


def fill_negative(inputs, empty_ids):
    """(inputs, filled): `neg_prompt_ids` the empty prompt's ids where prompt ids came without a negative prompt
    (filled True), so that calls with and without one share a program; else as given (filled False)."""
    ids = inputs.prompt_ids
    if ids is None or inputs.prompt_embeds is not None or inputs.neg_prompt_ids is not None or \
            inputs.neg_prompt_embeds is not None:
        return inputs, False
    empty = np.asarray(empty_ids, np.int32)[0]  # (77,), SDXL (2, 77)
    empty = np.tile(empty, ids.shape[-1] // empty.shape[-1])  # as many empty chunks as the prompts have
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
