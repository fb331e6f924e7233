"""Text conditioning of a model family: which models and tokenizers it loads, how prompts become ids, how ids
become what the UNet sees (`generate.Cond`), and how latents are decoded.

- `SDText`: SD 1.x / 2.x, one CLIP text encoder (its last hidden state).
- `SDXLText`: SDXL (Podell et al. 2023): two text encoders (the penultimate layer of each, concatenated; the
  second's projected pooled output conditions the UNet too), size and crop micro-conditioning (`time_ids`), zero
  negative embeddings when no negative prompt is given (`force_zeros_for_empty_prompt`), and a VAE that decodes
  in float32 (`force_upcast`). The refiner has the second encoder alone and an aesthetic score in its time ids
  (`requires_aesthetics_score`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .generate import Cond
from .models import AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, UNet2DConditionModel
from .textual_inversion import expand_prompts


class SDText:
    """SD 1.x / 2.x: ids (B, 77), text states (B, 77, D) from one CLIP text encoder."""

    models = {"text_encoder": CLIPTextModel, "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    tokenizers = ("tokenizer",)
    optional = ()  # components that may be null in model_index.json
    index_options = ()  # model_index.json entries the pipeline takes
    default_guidance = 7.5

    @staticmethod
    def check_components(pipeline):
        if pipeline.text_encoder is None or pipeline.tokenizer is None:
            raise ValueError("SD pipelines need text_encoder and tokenizer (this checkpoint has none: an SDXL "
                             "refiner? use StableDiffusionXLImg2Img)")
        if pipeline.unet.config.addition_embed_type is not None:
            raise ValueError("this UNet is an SDXL UNet (addition_embed_type='text_time'): use StableDiffusionXL")

    @staticmethod
    def check_inputs(inputs):
        pass

    @staticmethod
    def fill_inputs(inputs, height, width):
        return inputs

    @staticmethod
    def prepare_ids(pipeline, prompts) -> np.ndarray:
        """Token ids (B, 77) int32, padded and truncated as diffusers does."""
        prompts = expand_prompts(prompts, pipeline.tokenizer)  # multi-vector textual-inversion tokens
        ids = pipeline.tokenizer(prompts, padding="max_length", max_length=pipeline.max_length, truncation=True,
                                 return_tensors="np").input_ids
        return ids.astype(np.int32)

    @staticmethod
    def ids_tail(pipeline) -> tuple:
        return (pipeline.max_length,)

    @staticmethod
    def encode_prompt(pipeline, params, prompt_ids):
        return pipeline.text_encoder.apply(params["text_encoder"], prompt_ids).last_hidden_state

    @classmethod
    def encode(cls, pipeline, params, inputs, settings) -> Cond:
        neg_ids = pipeline.empty_prompt_ids if inputs.neg_prompt_ids is None else inputs.neg_prompt_ids
        if settings.classifier_free_guidance and inputs.prompt_embeds is None and inputs.neg_prompt_embeds is None:
            # One text-encoder call on [negative; prompt] ids, 2B rows for any B: a batch of one compiles to other
            # kernels (XLA drops the unit dimension), and an image must not change with the batch it is made in.
            ids = inputs.prompt_ids
            both = jnp.concatenate([jnp.broadcast_to(neg_ids, ids.shape), ids])
            return Cond(cls.encode_prompt(pipeline, params, both).astype(pipeline.dtype), {})
        embeds = inputs.prompt_embeds
        if embeds is None:
            embeds = cls.encode_prompt(pipeline, params, inputs.prompt_ids)
        neg = inputs.neg_prompt_embeds
        if neg is None:
            neg = jnp.broadcast_to(cls.encode_prompt(pipeline, params, neg_ids), embeds.shape)
        return Cond(jnp.concatenate([neg, embeds]).astype(pipeline.dtype), {})

    @staticmethod
    def decode_in_float32(pipeline) -> bool:
        return False


class SDXLText:
    """SDXL: ids (B, 2, 77) (one row per tokenizer), states (B, 77, D1 + D2), pooled (B, P), time ids (B, 6).
    The refiner (no first encoder): ids (B, 1, 77), states (B, 77, D2), time ids (B, 5) with the aesthetic score."""

    models = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection,
              "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    tokenizers = ("tokenizer", "tokenizer_2")
    optional = ("text_encoder", "tokenizer")  # null in a refiner's model_index.json
    index_options = ("force_zeros_for_empty_prompt", "requires_aesthetics_score")
    default_guidance = 5.0

    @staticmethod
    def check_components(pipeline):
        if pipeline.unet.config.addition_embed_type != "text_time":
            raise ValueError("StableDiffusionXL needs an SDXL UNet (addition_embed_type='text_time'); this one has "
                             f"{pipeline.unet.config.addition_embed_type!r}: use StableDiffusion")
        if pipeline.text_encoder_2 is None or pipeline.tokenizer_2 is None:
            raise ValueError("SDXL pipelines need text_encoder_2 and tokenizer_2")
        if (pipeline.text_encoder is None) != (pipeline.tokenizer is None):
            raise ValueError("give text_encoder and tokenizer together (or neither, for a refiner)")
        unet, projection = pipeline.unet.config, pipeline.text_encoder_2.config.projection_dim
        ids = 5 if pipeline.requires_aesthetics_score else 6  # a refiner's aesthetic score replaces the target size
        given, expected = unet.addition_time_embed_dim * ids + projection, unet.projection_class_embeddings_input_dim
        if given != expected:
            other = unet.addition_time_embed_dim * {5: 6, 6: 5}[ids] + projection  # with the other layout
            hint = f"requires_aesthetics_score={ids == 6}" if other == expected else "the text_encoder_2 of this UNet"
            raise ValueError(f"the UNet takes {expected} pooled + time-id features, not {given} ({ids} time ids and "
                             f"a pooled embedding of {projection}): use {hint}")

    @staticmethod
    def fill_inputs(inputs, height, width):
        """The size ids and aesthetic scores filled in before the compiled call, so that other values reuse the
        same program."""
        sizes = size_conditioning(height, width, inputs.original_size, inputs.crops_coords_top_left,
                                  inputs.target_size)
        scores = [jnp.asarray(default if given is None else given, jnp.float32) for given, default in
                  ((inputs.aesthetic_score, 6.0), (inputs.negative_aesthetic_score, 2.5))]  # diffusers' defaults
        return inputs.replace(**dict(zip(("original_size", "crops_coords_top_left", "target_size"), sizes)),
                              **dict(zip(("aesthetic_score", "negative_aesthetic_score"), scores)))

    @staticmethod
    def check_inputs(inputs):
        for states, pooled in (("prompt_embeds", "pooled_prompt_embeds"),
                               ("neg_prompt_embeds", "neg_pooled_prompt_embeds")):
            if (getattr(inputs, states) is None) != (getattr(inputs, pooled) is None):
                raise ValueError(f"SDXL takes {states} and {pooled} together: (states, pooled) = "
                                 "pipeline.encode_prompt(params, ids)")

    @staticmethod
    def prepare_ids(pipeline, prompts, prompts_2=None) -> np.ndarray:
        """Token ids (B, 2, 77) int32: `prompts` by the first tokenizer, `prompts_2` (diffusers' prompt_2; default,
        or empty: `prompts`) by the second, padded and truncated as diffusers does (the second pads with its own
        pad token, "!" in SDXL). A refiner's (B, 1, 77): `prompts` by its one tokenizer, the second."""
        if pipeline.tokenizer is None:
            if prompts_2:
                raise ValueError("this checkpoint has one text encoder (a refiner): give prompts alone, not prompts_2")
            rows = [(pipeline.tokenizer_2, prompts)]
        else:
            prompts_2 = prompts_2 or prompts  # as diffusers: an empty prompt_2 is prompt
            if len(prompts_2) != len(prompts):
                raise ValueError(f"{len(prompts_2)} prompts_2 for {len(prompts)} prompts: give one per prompt")
            rows = [(pipeline.tokenizer, prompts), (pipeline.tokenizer_2, prompts_2)]
        ids = [tokenizer(expand_prompts(texts, tokenizer), padding="max_length", max_length=pipeline.max_length,
                         truncation=True, return_tensors="np").input_ids for tokenizer, texts in rows]
        return np.stack(ids, axis=1).astype(np.int32)

    @staticmethod
    def ids_tail(pipeline) -> tuple:
        return (1 if pipeline.text_encoder is None else 2, pipeline.max_length)

    @staticmethod
    def encode_prompt(pipeline, params, prompt_ids):
        """(B, 2, 77) ids -> (text states (B, 77, D1 + D2), pooled (B, P)): both encoders' penultimate layer,
        concatenated, and the second's projected pooled output, as diffusers' SDXL does (clip_skip None). A
        refiner's (B, 1, 77) ids: the second encoder's alone."""
        second = pipeline.text_encoder_2.apply(params["text_encoder_2"], prompt_ids[:, -1], output_hidden_states=True)
        if pipeline.text_encoder is None:
            return second.hidden_states[-2], second.text_embeds
        first = pipeline.text_encoder.apply(params["text_encoder"], prompt_ids[:, 0], output_hidden_states=True)
        return jnp.concatenate([first.hidden_states[-2], second.hidden_states[-2]], axis=-1), second.text_embeds

    @classmethod
    def encode(cls, pipeline, params, inputs, settings) -> Cond:
        """Text states and pooled embeddings from ids, or given (`prompt_embeds` with `pooled_prompt_embeds`, as
        `encode_prompt` returns them). Without a negative prompt the unconditional embeddings are zeros if the
        checkpoint says `force_zeros_for_empty_prompt`, else those of the empty prompt."""
        if inputs.prompt_embeds is None:
            context, pooled = cls.encode_prompt(pipeline, params, inputs.prompt_ids)
        else:
            context, pooled = inputs.prompt_embeds, inputs.pooled_prompt_embeds
        if inputs.neg_prompt_embeds is not None:
            neg_context, neg_pooled = inputs.neg_prompt_embeds, inputs.neg_pooled_prompt_embeds
        elif inputs.neg_prompt_ids is None and pipeline.force_zeros_for_empty_prompt:
            neg_context, neg_pooled = jnp.zeros_like(context), jnp.zeros_like(pooled)
        else:
            neg = pipeline.empty_prompt_ids if inputs.neg_prompt_ids is None else inputs.neg_prompt_ids
            neg_context, neg_pooled = cls.encode_prompt(pipeline, params, neg)
            neg_context = jnp.broadcast_to(neg_context, context.shape)
            neg_pooled = jnp.broadcast_to(neg_pooled, pooled.shape)
        ids, neg_ids = cls.time_ids(pipeline, inputs)
        batch = context.shape[0]
        unet_kwargs = {"text_embeds": jnp.concatenate([neg_pooled, pooled]),
                       "time_ids": jnp.concatenate([jnp.broadcast_to(neg_ids, (batch, neg_ids.shape[0])),
                                                    jnp.broadcast_to(ids, (batch, ids.shape[0]))])}
        return Cond(jnp.concatenate([neg_context, context]).astype(pipeline.dtype), unet_kwargs)

    @staticmethod
    def time_ids(pipeline, inputs):
        """(time ids, the unconditional rows' time ids), from filled inputs (`fill_inputs`). Base: original size,
        crop, target size, the same for both (diffusers' negative_original_size is not taken). Refiner
        (requires_aesthetics_score): original size, crop, aesthetic score; the unconditional rows get crop (0, 0)
        (diffusers' default negative_crops_coords_top_left) and the negative aesthetic score."""
        original, crop = inputs.original_size.reshape(-1), inputs.crops_coords_top_left.reshape(-1)
        if not pipeline.requires_aesthetics_score:
            ids = jnp.concatenate([original, crop, inputs.target_size.reshape(-1)])
            return ids, ids
        return (jnp.concatenate([original, crop, inputs.aesthetic_score.reshape(1)]),
                jnp.concatenate([original, jnp.zeros_like(crop), inputs.negative_aesthetic_score.reshape(1)]))

    @staticmethod
    def decode_in_float32(pipeline) -> bool:
        """SDXL's VAE overflows in half precision: diffusers decodes in float32 when its config says force_upcast."""
        return bool(pipeline.vae.config.force_upcast)


def size_conditioning(height, width, original_size=None, crops_coords_top_left=None, target_size=None):
    """original (h, w), crop (top, left), target (h, w) as float32 arrays, sizes defaulting to (height, width)."""
    sizes = ((height, width) if original_size is None else original_size,
             (0, 0) if crops_coords_top_left is None else crops_coords_top_left,
             (height, width) if target_size is None else target_size)
    return [jnp.asarray(v, jnp.float32) for v in sizes]


def vae_for(pipeline, params):
    """(vae, its params): in float32 where the family says so (SDXL's force_upcast, as diffusers encodes and decodes),
    the params cast inside the program; else as loaded."""
    vae, vae_params = pipeline.vae, params["vae"]
    if pipeline.conditioning.decode_in_float32(pipeline) and jnp.dtype(vae.dtype) != jnp.float32:
        vae, vae_params = vae.clone(dtype=jnp.float32), jax.tree.map(lambda p: p.astype(jnp.float32), vae_params)
    return vae, vae_params


def decode(pipeline, params, latents):
    """Latents as the UNet sees them -> images (B, H, W, 3) in [0, 1]; in float32 where the family says so
    (the params and the latents are cast inside the program)."""
    vae, vae_params = vae_for(pipeline, params)
    latents = latents.astype(jnp.float32)  # as the scan leaves them; a bfloat16 VAE casts its input
    images = vae.apply(vae_params, latents / vae.config.scaling_factor, method="decode")
    images = jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0, 1)
    return jnp.transpose(images, (0, 2, 3, 1))
