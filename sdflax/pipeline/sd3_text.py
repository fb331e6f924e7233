"""SD 3.x's text conditioning (Esser et al. 2024): CLIP-L and CLIP-G (their penultimate states side by side,
zero-padded to T5's width) followed along the sequence by T5's states; the pooled conditioning is both CLIP
projections side by side. Without T5 (`text_encoder_3=None`, as diffusers allows) its states are zeros.

Ids are one int32 row per prompt, (B, 77 + 77 + T): CLIP-L's tokens, CLIP-G's, then T5's (T = the
`max_sequence_length`), so that the pipelines batch, shard and pmap them as one array.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from .text import tokenize


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
    text_encoder: Any  # CLIPTextModelWithProjection (CLIP-L)
    text_encoder_2: Any  # CLIPTextModelWithProjection (CLIP-G)
    text_encoder_3: Any  # T5EncoderModel, or None
    joint_width: int  # the transformer's joint_attention_dim: T5's width, and the zeros' without it
    clip_length: int = 77
    dtype: Any = jnp.float32

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
