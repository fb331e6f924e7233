"""SD 3.x's text conditioning (Esser et al. 2024): CLIP-L and CLIP-G (their penultimate states side by side,
zero-padded to T5's width) followed along the sequence by T5's states; the pooled conditioning is both CLIP
projections side by side. Without T5 (`text_encoder_3=None`, as diffusers allows) its states are zeros.

Ids are one int32 row per prompt, (B, 77 + 77 + T): CLIP-L's tokens, CLIP-G's, then T5's (T = the
`max_sequence_length`), so that the pipelines batch, shard and pmap them as one array.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..models import (AutoencoderKL, CLIPTextModelWithProjection, SD3Transformer2DModel, SiglipVisionModel,
                      T5EncoderModel)
from ..loading.ip_adapter import read_sd3_ip_adapter
from ..loading.tokenizers import T5Tokenizer
from .transformer_ip_adapter import SD3_ARGUMENTS, load_sd3_ip_adapter
from .denoisers import MMDiTDenoiser
from .text import SDText, check_pooled_with_states, frozen_ids, tokenize
from .types import Cond

MAX_SEQUENCE_LENGTH = 512  # T5's longest, as diffusers' SD 3 pipelines allow


def prepare_sd3_ids(tokenizer, tokenizer_2, tokenizer_3, prompts, prompts_2=None, prompts_3=None,
                    max_sequence_length=256, clip_length=77) -> np.ndarray:
    """Token ids (B, 2 · clip_length + max_sequence_length) int32, as diffusers' SD 3 pipelines tokenize:
    `prompts_2` and `prompts_3` default to `prompts`; CLIP's padded to 77, T5's to `max_sequence_length`."""
    prompts_2, prompts_3 = prompts_2 or prompts, prompts_3 or prompts
    for name, given in (("prompts_2", prompts_2), ("prompts_3", prompts_3)):
        if len(given) != len(prompts):
            raise ValueError(f"{len(given)} {name} for {len(prompts)} prompts: give one per prompt")
    t5 = (tokenizer_3(list(prompts_3), max_sequence_length) if tokenizer_3 is not None
          else np.zeros((len(prompts), max_sequence_length), np.int32))  # unused: T5's states are zeros then
    return np.concatenate([tokenize(tokenizer, prompts, clip_length), tokenize(tokenizer_2, prompts_2, clip_length),
                           t5.astype(np.int32)], axis=1)


@dataclasses.dataclass(frozen=True)
class SD3Text:
    """SD 3.x: ids (B, 77 + 77 + T), states (B, 77 + T, joint width), pooled (B, P_L + P_G) as the transformer's
    `pooled_projections`. A prompt given no negative prompt gets the empty prompt's encoding, as diffusers'."""

    text_encoder: Any  # CLIPTextModelWithProjection (CLIP-L)
    text_encoder_2: Any  # CLIPTextModelWithProjection (CLIP-G)
    text_encoder_3: Any  # T5EncoderModel, or None
    joint_width: int  # the transformer's joint_attention_dim: T5's width, and the zeros' without it
    clip_length: int = 77
    dtype: Any = jnp.float32
    empty_ids: tuple = ()  # the empty prompt's ids (1, 77 + 77 + MAX_SEQUENCE_LENGTH), as nested tuples

    models = {"text_encoder": CLIPTextModelWithProjection, "text_encoder_2": CLIPTextModelWithProjection,
              "text_encoder_3": T5EncoderModel, "transformer": SD3Transformer2DModel, "vae": AutoencoderKL}
    tokenizers = ("tokenizer", "tokenizer_2", "tokenizer_3")
    tokenizer_loaders = {"tokenizer_3": T5Tokenizer.from_folder}
    ays_family = "sd1"  # unused: no flow schedule takes Align Your Steps levels
    sigma_spacing = "trained"  # the flow scheduler's own σ (diffusers' SD 3 pipelines give it none)
    optional = ("text_encoder_3", "tokenizer_3")  # T5 may be left out (its states are then zeros)
    index_options = ()
    denoiser = MMDiTDenoiser
    prompt_arguments = {"prompts_2": None, "prompts_3": None, "max_sequence_length": 256}
    # InstantX's SD 3.5 Large IP-Adapter (`load_ip_adapter`): its call arguments, file reader, piece and encoder
    ip_adapter_arguments = SD3_ARGUMENTS
    ip_adapter_reader = staticmethod(read_sd3_ip_adapter)
    ip_adapter_piece = staticmethod(load_sd3_ip_adapter)
    ip_adapter_encoder = SiglipVisionModel

    @property
    def t5(self):
        return self.text_encoder_3

    @property
    def clip_columns(self) -> int:
        """Where T5's ids begin: after both CLIPs'."""
        return 2 * self.clip_length

    def joint_text(self, ids) -> tuple:
        """The text tokens of the joint attention, in its order, as (tokenizer name, their ids (B, n)): CLIP's (L's
        and G's states side by side on the features: L's ids), then T5's."""
        return ("tokenizer", ids[:, :self.clip_length]), ("tokenizer_3", ids[:, self.clip_columns:])

    @staticmethod
    def check_components(parts):
        for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
            if getattr(parts, name) is None:
                raise ValueError(f"SD 3 pipelines need {name} (only text_encoder_3, T5, may be left out)")
        if parts.text_encoder_3 is not None and parts.tokenizer_3 is None:
            raise ValueError("text_encoder_3 (T5) needs tokenizer_3: give both, or text_encoder_3=None")
        config = parts.transformer.config
        pooled = parts.text_encoder.config.projection_dim + parts.text_encoder_2.config.projection_dim
        if pooled != config.pooled_projection_dim:
            raise ValueError(f"the transformer takes a pooled text embedding of {config.pooled_projection_dim}, the "
                             f"text encoders' projections give {pooled}: use the text encoders of this checkpoint")
        clip = parts.text_encoder.config.hidden_size + parts.text_encoder_2.config.hidden_size
        if clip > config.joint_attention_dim:
            raise ValueError(f"the CLIP states are {clip} wide, wider than the transformer's text states "
                             f"({config.joint_attention_dim}): use the text encoders of this checkpoint")
        if parts.text_encoder_3 is not None and parts.text_encoder_3.config.d_model != config.joint_attention_dim:
            raise ValueError(f"the transformer takes text states {config.joint_attention_dim} wide, T5's are "
                             f"{parts.text_encoder_3.config.d_model}: use the T5 of this checkpoint")

    @staticmethod
    def prepare_ids(parts, prompts, prompts_2=None, prompts_3=None, max_sequence_length=256) -> np.ndarray:
        """Token ids (B, 77 + 77 + max_sequence_length) int32."""
        if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, numbers.Integral) or \
                not 0 < max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length={max_sequence_length!r} must be a whole number in 1 .. "
                             f"{MAX_SEQUENCE_LENGTH} (T5's tokens; diffusers' default 256)")
        tokenizer_3 = parts.tokenizer_3 if parts.text_encoder_3 is not None else None
        return prepare_sd3_ids(parts.tokenizer, parts.tokenizer_2, tokenizer_3, prompts, prompts_2, prompts_3,
                               int(max_sequence_length), parts.max_length)

    def ids_tail(self, ids) -> tuple:
        """(77 + 77 + T,): T as the given ids have it, where it is a valid length."""
        clip = 2 * self.clip_length
        if ids is not None and ids.ndim and clip < ids.shape[-1] <= clip + MAX_SEQUENCE_LENGTH:
            return (ids.shape[-1],)
        return (clip + 256,)

    @classmethod
    def build(cls, parts, empty_ids) -> "SD3Text":
        empty = cls.prepare_ids(parts, [""], max_sequence_length=MAX_SEQUENCE_LENGTH)
        return cls(parts.text_encoder, parts.text_encoder_2, parts.text_encoder_3, parts.transformer.config.joint_attention_dim,
                   parts.max_length, parts.dtype, frozen_ids(empty))

    @staticmethod
    def upcast_vae(vae) -> bool:
        return False  # diffusers' SD 3 pipelines decode in the VAE's dtype

    @staticmethod
    def check_inputs(inputs):
        check_pooled_with_states(inputs, "SD 3")

    can_guide = staticmethod(SDText.can_guide)

    def fill_inputs(self, inputs, height, width):
        """The empty prompt's ids as `neg_prompt_ids` where none are given (one program for calls with and without
        a negative prompt), T5's part as long as the prompt's."""
        ids = inputs.prompt_ids
        if ids is None or inputs.prompt_embeds is not None or inputs.neg_prompt_ids is not None or \
                inputs.neg_prompt_embeds is not None:
            return inputs
        empty = np.asarray(self.empty_ids, np.int32)[0, :ids.shape[-1]]
        xp = np if isinstance(ids, np.ndarray) else jnp
        return inputs.replace(neg_prompt_ids=xp.broadcast_to(empty.astype(ids.dtype), ids.shape))

    def encode(self, params, inputs, settings) -> Cond:
        """Text states and pooled embeddings for [negative; prompt] from ids (one encoder call on 2B rows, as
        SDText, so that an image does not depend on its batch), or given."""
        if inputs.prompt_embeds is None and inputs.neg_prompt_embeds is None:
            ids = inputs.prompt_ids
            neg_ids = jnp.broadcast_to(inputs.neg_prompt_ids, ids.shape) if inputs.neg_prompt_ids is not None \
                else jnp.broadcast_to(jnp.asarray(self.empty_ids, ids.dtype)[:, :ids.shape[-1]], ids.shape)
            states, pooled = self.encode_prompt(params, jnp.concatenate([neg_ids, ids]))
            return Cond(states, {"pooled_projections": pooled})
        if inputs.prompt_embeds is None:
            states, pooled = self.encode_prompt(params, inputs.prompt_ids)
        else:
            states, pooled = inputs.prompt_embeds.astype(self.dtype), inputs.pooled_prompt_embeds.astype(self.dtype)
        if inputs.neg_prompt_embeds is not None:
            neg_states, neg_pooled = inputs.neg_prompt_embeds, inputs.neg_pooled_prompt_embeds
        else:
            neg_ids = inputs.neg_prompt_ids if inputs.neg_prompt_ids is not None else \
                jnp.asarray(self.empty_ids, jnp.int32)[:, :self.clip_length * 2 + states.shape[1] - self.clip_length]
            neg_states, neg_pooled = self.encode_prompt(params, neg_ids)
            neg_states = jnp.broadcast_to(neg_states, states.shape)
            neg_pooled = jnp.broadcast_to(neg_pooled, pooled.shape)
        return Cond(jnp.concatenate([neg_states.astype(self.dtype), states]),
                    {"pooled_projections": jnp.concatenate([neg_pooled.astype(self.dtype), pooled])})

    def encode_prompt(self, params, ids):
        """(B, 2 · 77 + T) ids -> (states (B, 77 + T, joint_width), pooled (B, P_L + P_G)), as diffusers'
        `StableDiffusion3Pipeline.encode_prompt` (clip_skip None: each CLIP's penultimate layer)."""
        n = self.clip_length
        first = self.text_encoder.apply(params["text_encoder"], ids[:, :n], output_hidden_states=True)
        second = self.text_encoder_2.apply(params["text_encoder_2"], ids[:, n:2 * n], output_hidden_states=True)
        clip = jnp.concatenate([first.hidden_states[-2], second.hidden_states[-2]], axis=-1)
        t5_ids = ids[:, 2 * n:]
        if self.text_encoder_3 is None:
            t5 = jnp.zeros((ids.shape[0], t5_ids.shape[1], self.joint_width), clip.dtype)
        else:
            t5 = self.text_encoder_3.apply(params["text_encoder_3"], t5_ids)
        if clip.shape[-1] > t5.shape[-1]:
            raise ValueError(f"the CLIP states are {clip.shape[-1]} wide, wider than T5's {t5.shape[-1]}: the text "
                             "encoders are not one SD 3 checkpoint's")
        clip = jnp.pad(clip, ((0, 0), (0, 0), (0, t5.shape[-1] - clip.shape[-1])))
        states = jnp.concatenate([clip.astype(self.dtype), t5.astype(self.dtype)], axis=1)
        return states, jnp.concatenate([first.text_embeds, second.text_embeds], axis=-1).astype(self.dtype)
