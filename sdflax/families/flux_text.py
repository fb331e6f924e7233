"""Flux.1's text conditioning and denoiser (Black Forest Labs 2024), as diffusers' Flux pipelines run them.

The prompt is read twice: CLIP-L's pooled output conditions the transformer's modulation (with the timestep and,
in guidance-distilled models such as dev, the guidance scale), T5-XXL's states are the text tokens of its joint
attention. There is no unconditional batch by default: dev was distilled to take its guidance as an input. True
classifier-free guidance (`true_cfg_scale` > 1 with a negative prompt, as diffusers) runs the [negative; prompt]
batch as the other families do.

Ids are one int32 row per prompt, (B, 77 + T): CLIP's tokens, then T5's (T = `max_sequence_length`).

The transformer sees the latents as tokens: each 2x2 patch of the (C, h, w) latents packed into one 4C feature
vector, with (0, row, column) position ids for its 3-axis RoPE; the text tokens' ids are zeros. The denoiser packs
and unpacks, so that the starts, the samplers and the hooks see (B, C, h, w) latents as for every other family.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..loading.tokenizers import T5Tokenizer
from ..models import AutoencoderKL, CLIPTextModel, T5EncoderModel
from ..models.flux import FluxTransformer2DModel
from ..pipeline.denoisers import Denoiser
from ..loading.ip_adapter import read_flux_ip_adapter
from ..pipeline.text import check_pooled_with_states, frozen_ids, tokenize
from ..pipeline.transformer_ip_adapter import ARGUMENTS as IP_ADAPTER_ARGUMENTS
from ..pipeline.transformer_ip_adapter import load_flux_ip_adapter
from ..pipeline.types import Cond

MAX_SEQUENCE_LENGTH = 512  # T5's longest, diffusers' default for Flux
DEFAULT_SAMPLE_SIZE = 128  # latent side of diffusers' default 1024x1024 (`default_sample_size`)


def pack(latents):
    """(B, C, h, w) -> (B, h/2 · w/2, 4C): diffusers' `_pack_latents`, the 2x2 patches row by row, each patch's
    features channel-major."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack(tokens, h: int, w: int):
    """(B, h/2 · w/2, 4C) -> (B, C, h, w): the inverse of `pack` (diffusers' `_unpack_latents`)."""
    b, _, features = tokens.shape
    x = tokens.reshape(b, h // 2, w // 2, features // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(b, features // 4, h, w)


def image_ids(h: int, w: int, index: int = 0) -> np.ndarray:
    """(h/2 · w/2, 3) float32 position ids of packed latents (h, w): (index, row, column), as diffusers'
    `_prepare_latent_image_ids`; Kontext's reference image has index 1."""
    rows, columns = np.meshgrid(np.arange(h // 2), np.arange(w // 2), indexing="ij")
    return np.stack([np.full_like(rows, index), rows, columns], -1).reshape(-1, 3).astype(np.float32)


def text_ids(tokens: int) -> np.ndarray:
    """(T, 3) position ids of the text tokens: zeros, as diffusers'."""
    return np.zeros((tokens, 3), np.float32)


@dataclasses.dataclass(frozen=True)
class FluxDenoiser(Denoiser):
    """Flux's transformer behind the (B, C, h, w) calling convention: `extra` carries `pooled_projections`, the
    distilled `guidance` (B,), for Kontext the reference image's latents (`reference`, (B, C, h', w')), with an
    IP-Adapter its keys and values per double-stream block (`image_prompts`), and ControlNet residuals
    (`flux_control.FluxControlNets`: the transformer's controlnet_* inputs)."""

    model: Any  # models.flux.FluxTransformer2DModel

    component = "transformer"
    flow = True
    probe_rank = 2  # its first kernel is a Dense's (x_embedder)

    def __call__(self, params, x, t, context, pooled_projections, guidance=None, reference=None, image_prompts=None,
                 **controlnet):
        b, _, h, w = x.shape
        tokens, ids = pack(x), image_ids(h, w)
        if reference is not None:  # Kontext: the reference's tokens after the image's, told apart by their ids
            tokens = jnp.concatenate([tokens, pack(reference.astype(x.dtype))], axis=1)
            ids = np.concatenate([ids, image_ids(*reference.shape[2:], index=1)])
        timestep = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (b,)) / 1000  # the model takes σ, diffusers' t / 1000
        guidance = guidance if self.model.config.guidance_embeds else None  # schnell has no guidance input
        out = self.model.apply(params[self.component], tokens, context, pooled_projections, timestep, ids,
                               text_ids(context.shape[1]), guidance, image_prompts=image_prompts, **controlnet)
        return unpack(out[:, :(h // 2) * (w // 2)], h, w)

    @property
    def in_channels(self) -> int:
        """Input channels of the unpacked latents (Fill: latents, masked image latents and the 8x8 mask)."""
        return self.model.config.in_channels // 4

    @property
    def sample_size(self) -> int:
        return DEFAULT_SAMPLE_SIZE

    @property
    def context_width(self) -> int:
        return self.model.config.joint_attention_dim

    patch = 2  # the image side must be a multiple of the VAE factor times this

    def image_seq_len(self, latent_height, latent_width) -> int:
        """The image's tokens, from which the schedule's dynamic shift `mu` is taken (diffusers' `calculate_shift`)."""
        return (latent_height // 2) * (latent_width // 2)

    def replication_probe(self, params):
        own = params[self.component]
        return own.get("x_embedder", {}).get("kernel") if isinstance(own, Mapping) else None


def prepare_flux_ids(tokenizer, tokenizer_2, prompts, prompts_2=None, max_sequence_length=512,
                     clip_length=77) -> np.ndarray:
    """Token ids (B, clip_length + max_sequence_length) int32, as diffusers' Flux pipelines tokenize: `prompts`
    for CLIP, `prompts_2` (default: `prompts`) for T5, each padded and truncated."""
    prompts_2 = prompts_2 or prompts
    if len(prompts_2) != len(prompts):
        raise ValueError(f"{len(prompts_2)} prompts_2 for {len(prompts)} prompts: give one per prompt")
    t5 = (tokenizer_2(list(prompts_2), max_sequence_length) if tokenizer_2 is not None
          else np.zeros((len(prompts), max_sequence_length), np.int32))  # unused: prompt_embeds are given then
    return np.concatenate([tokenize(tokenizer, prompts, clip_length), t5.astype(np.int32)], axis=1)


@dataclasses.dataclass(frozen=True)
class FluxText:
    """Flux.1: ids (B, 77 + T), states (B, T, 4096) from T5, pooled (B, 768) from CLIP-L. Without T5
    (`text_encoder_2=None`, to spare its memory) the call takes `prompt_embeds` and `pooled_prompt_embeds`."""

    text_encoder: Any  # CLIPTextModel (CLIP-L: its pooled output)
    text_encoder_2: Any  # T5EncoderModel, or None
    clip_length: int = 77
    dtype: Any = jnp.float32
    empty_ids: tuple = ()  # the empty prompt's ids (1, 77 + MAX_SEQUENCE_LENGTH), as nested tuples

    models = {"text_encoder": CLIPTextModel, "text_encoder_2": T5EncoderModel, "transformer": FluxTransformer2DModel,
              "vae": AutoencoderKL}
    tokenizers = ("tokenizer", "tokenizer_2")
    tokenizer_loaders = {"tokenizer_2": T5Tokenizer.from_folder}
    ays_family = "sd1"  # unused: no flow schedule takes Align Your Steps levels
    sigma_spacing = "flux"  # σ = linspace(1, 1/n, n), as diffusers' Flux pipelines hand the scheduler
    optional = ("text_encoder_2", "tokenizer_2")  # T5 may be left out: the call then takes prompt_embeds
    index_options = ()
    denoiser = FluxDenoiser
    prompt_arguments = {"prompts_2": None, "max_sequence_length": MAX_SEQUENCE_LENGTH}
    # XLabs' IP-Adapter (`load_ip_adapter`): its call arguments, its file reader and its piece
    ip_adapter_arguments = IP_ADAPTER_ARGUMENTS
    ip_adapter_reader = staticmethod(read_flux_ip_adapter)
    ip_adapter_piece = staticmethod(load_flux_ip_adapter)

    @property
    def t5(self):
        return self.text_encoder_2

    @property
    def clip_columns(self) -> int:
        """Where T5's ids begin: after CLIP's."""
        return self.clip_length

    def joint_text(self, ids) -> tuple:
        """The text tokens of the joint attention, as (tokenizer name, their ids (B, n)): T5's alone (CLIP gives
        the pooled embedding only)."""
        return (("tokenizer_2", ids[:, self.clip_columns:]),)

    @staticmethod
    def check_components(parts):
        if parts.text_encoder is None or parts.tokenizer is None:
            raise ValueError("Flux pipelines need text_encoder and tokenizer (CLIP-L; only text_encoder_2, T5, may "
                             "be left out)")
        if parts.text_encoder_2 is not None and parts.tokenizer_2 is None:
            raise ValueError("text_encoder_2 (T5) needs tokenizer_2: give both, or text_encoder_2=None")
        config = parts.transformer.config
        if parts.text_encoder.config.hidden_size != config.pooled_projection_dim:
            raise ValueError(f"the transformer takes a pooled text embedding of {config.pooled_projection_dim}, "
                             f"CLIP's is {parts.text_encoder.config.hidden_size}: use the text encoder of this "
                             "checkpoint")
        if parts.text_encoder_2 is not None and parts.text_encoder_2.config.d_model != config.joint_attention_dim:
            raise ValueError(f"the transformer takes text states {config.joint_attention_dim} wide, T5's are "
                             f"{parts.text_encoder_2.config.d_model}: use the T5 of this checkpoint")
        if parts.vae.config.latent_channels * 4 > config.in_channels:
            raise ValueError(f"the transformer takes {config.in_channels} features per token, fewer than 4 x the "
                             f"VAE's {parts.vae.config.latent_channels} latent channels: use the VAE of this checkpoint")

    @staticmethod
    def prepare_ids(parts, prompts, prompts_2=None, max_sequence_length=MAX_SEQUENCE_LENGTH) -> np.ndarray:
        """Token ids (B, 77 + max_sequence_length) int32."""
        if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, numbers.Integral) or \
                not 0 < max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length={max_sequence_length!r} must be a whole number in 1 .. "
                             f"{MAX_SEQUENCE_LENGTH} (T5's tokens; diffusers' default 512)")
        tokenizer_2 = parts.tokenizer_2 if parts.text_encoder_2 is not None else None
        return prepare_flux_ids(parts.tokenizer, tokenizer_2, prompts, prompts_2, int(max_sequence_length),
                                parts.max_length)

    def ids_tail(self, ids) -> tuple:
        """(77 + T,): T as the given ids have it, where it is a valid length."""
        n = self.clip_length
        if ids is not None and ids.ndim and n < ids.shape[-1] <= n + MAX_SEQUENCE_LENGTH:
            return (ids.shape[-1],)
        return (n + MAX_SEQUENCE_LENGTH,)

    @classmethod
    def build(cls, parts, empty_ids) -> "FluxText":
        empty = cls.prepare_ids(parts, [""], max_sequence_length=MAX_SEQUENCE_LENGTH)
        return cls(parts.text_encoder, parts.text_encoder_2, parts.max_length, parts.dtype, frozen_ids(empty))

    @staticmethod
    def upcast_vae(vae) -> bool:
        return False  # diffusers' Flux pipelines decode in the VAE's dtype

    def check_inputs(self, inputs):
        check_pooled_with_states(inputs, "Flux")
        if self.text_encoder_2 is None and inputs.prompt_embeds is None:
            raise ValueError("this Flux pipeline has no T5 (text_encoder_2=None): give prompt_embeds and "
                             "pooled_prompt_embeds (pipeline.encode_prompt on a pipeline with T5)")
        if inputs.embedded_guidance is not None and np.ndim(inputs.embedded_guidance):
            raise ValueError(f"guidance_scale must be one number, got an array of shape "
                             f"{np.shape(inputs.embedded_guidance)}")

    @staticmethod
    def can_guide(inputs) -> bool:
        """True classifier-free guidance needs a negative prompt, as diffusers' `do_true_cfg`."""
        return inputs.neg_prompt_ids is not None or inputs.neg_prompt_embeds is not None

    def fill_inputs(self, inputs, height, width):
        """Packed latents (B, h/2 · w/2, 4C), as diffusers takes them, unpacked to (B, C, h, w)."""
        latents, prompts = inputs.latents, inputs.prompts()
        leading = prompts.ndim - (1 if inputs.prompt_ids is not None else 2)  # 2 under pmap
        if latents is None or latents.ndim != leading + 2:
            return inputs
        h, w = height // 8, width // 8  # `sizes` checked height and width against the VAE factor (8) times 2
        flat = latents.reshape(-1, *latents.shape[-2:])
        if flat.shape[1] != (h // 2) * (w // 2):
            raise ValueError(f"latents have shape {latents.shape}: packed latents of a {height}x{width} image hold "
                             f"{(h // 2) * (w // 2)} tokens (or give them unpacked, (B, C, {h}, {w}))")
        xp = np if isinstance(latents, np.ndarray) else jnp
        return inputs.replace(latents=xp.reshape(unpack(flat, h, w), (*latents.shape[:leading], -1, h, w)))

    def encode(self, params, inputs, settings) -> Cond:
        """T5 states, pooled CLIP embeddings and the distilled guidance for [negative; prompt] (2B rows, as the
        other families: `Cond.conditional` keeps the prompt's half when no true CFG runs, and the negative's
        encoding, unused, is then left out of the program)."""
        guided = settings.classifier_free_guidance
        if guided and inputs.prompt_embeds is None and inputs.neg_prompt_embeds is None:
            ids = inputs.prompt_ids  # one encoder call on 2B rows, as SDText
            states, pooled = self.encode_prompt(params, jnp.concatenate([self.negative_ids(inputs.neg_prompt_ids,
                                                                                           ids.shape), ids]))
        else:
            if inputs.prompt_embeds is None:
                states, pooled = self.encode_prompt(params, inputs.prompt_ids)
            else:
                states, pooled = inputs.prompt_embeds, inputs.pooled_prompt_embeds
            if inputs.neg_prompt_embeds is not None:
                neg_states, neg_pooled = inputs.neg_prompt_embeds, inputs.neg_pooled_prompt_embeds
            elif not guided:
                neg_states, neg_pooled = states, pooled  # unused: only the prompt's half runs
            else:
                shape = (states.shape[0], self.clip_length + states.shape[1])
                neg_states, neg_pooled = self.encode_prompt(params, self.negative_ids(inputs.neg_prompt_ids, shape))
            states = jnp.concatenate([neg_states.astype(self.dtype), states.astype(self.dtype)])
            pooled = jnp.concatenate([neg_pooled.astype(self.dtype), pooled.astype(self.dtype)])
        extra = {"pooled_projections": pooled}
        if inputs.embedded_guidance is not None:
            extra["guidance"] = jnp.full((states.shape[0],), inputs.embedded_guidance, jnp.float32)
        return Cond(states, extra)

    def negative_ids(self, neg_ids, shape):
        """The negative prompt's ids, or the empty prompt's (unused unless a guider combines without one)."""
        if neg_ids is not None:
            return jnp.broadcast_to(neg_ids, shape)
        return jnp.broadcast_to(jnp.asarray(self.empty_ids, jnp.int32)[:, :shape[-1]], shape)

    def encode_prompt(self, params, ids):
        """(B, 77 + T) ids -> (states (B, T, D), pooled (B, P)), as diffusers' `FluxPipeline.encode_prompt`: T5's
        last hidden state, CLIP's pooled output."""
        n = self.clip_length
        pooled = self.text_encoder.apply(params["text_encoder"], ids[:, :n]).pooler_output
        if self.text_encoder_2 is None:
            raise ValueError("this Flux pipeline has no T5 (text_encoder_2=None): give prompt_embeds and "
                             "pooled_prompt_embeds, and neg_prompt_embeds with neg_pooled_prompt_embeds for true CFG")
        states = self.text_encoder_2.apply(params["text_encoder_2"], ids[:, n:])
        return states.astype(self.dtype), pooled.astype(self.dtype)
