"""FluxControlNetModel: a ControlNet for FLUX.1 (InstantX's, Shakker-Labs' Union nets, XLabs'), as diffusers builds it.

A copy of the transformer's first blocks reads the packed latents plus the control picture's tokens (its VAE latents,
packed, through a zero-initialised `controlnet_x_embedder`; XLabs' nets encode the picture with a small conv encoder,
`input_hint_block`, instead). After every double- and single-stream block a zero-initialised linear layer turns the
image tokens into a residual that the transformer adds after its own blocks (`FluxTransformer2DModel`'s
`controlnet_block_samples`). A Union net (`num_mode`) is told which kind of picture it reads (canny, depth, pose,
...) by an embedded mode, one extra text token before the prompt's.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from .controlnet import ControlNetConditioningEmbedding
from .flux import FluxTransformer2DModel, FluxTransformerConfig
from .layers import Dense, Embed

HINT_CHANNELS = (16, 16, 16, 16)  # XLabs' input_hint_block: three stride-2 levels, the VAE's 8x


@dataclasses.dataclass(frozen=True)
class FluxControlNetConfig(FluxTransformerConfig):
    num_mode: int | None = None  # a Union net: its control modes, embedded as a text token
    conditioning_embedding_channels: int | None = None  # XLabs' nets: the picture through input_hint_block

    @classmethod
    def from_dict(cls, config):
        # a net may copy no blocks of a kind (XLabs' have no single-stream ones): counts the config rules keep positive
        none = {key: 0 for key in ("num_layers", "num_single_layers") if config.get(key) == 0}
        return dataclasses.replace(super().from_dict({k: v for k, v in config.items() if k not in none}), **none)

    def check(self, name, patch_sizes=(1,)):
        # XLabs' nets pack their hint encoder's features in patch_size x patch_size patches, as the pipeline packs
        # the latents in 2x2 ones
        super().check(name, (1, 2) if self.conditioning_embedding_channels else patch_sizes)

    @property
    def union(self) -> bool:
        return self.num_mode is not None


class FluxControlNetModel(FluxTransformer2DModel):
    """(packed latents (B, L, in_channels), the control picture `controlnet_cond`, `controlnet_mode` (B,) or (B, 1)
    int (Union nets; None otherwise), `conditioning_scale` (traced), then the transformer's inputs) ->
    (block samples, single block samples): a tuple of (B, L, D) per block, times the scale (None for no blocks), as
    diffusers' `FluxControlNetModel.forward`. `controlnet_cond` is the picture's packed VAE latents (B, L,
    in_channels), or for XLabs' nets (`input_hint_block`) the picture itself (B, 3, H, W) in [-1, 1]."""

    config: FluxControlNetConfig
    config_class = FluxControlNetConfig

    def dummy_inputs(self):
        cfg = self.config
        latents, context, pooled, timestep, img_ids, txt_ids, guidance = super().dummy_inputs()
        side = 8 * cfg.patch_size  # one token of XLabs' hint features
        cond = jnp.zeros((1, 3, side, side)) if cfg.conditioning_embedding_channels else latents
        mode = jnp.zeros((1,), jnp.int32) if cfg.union else None
        return latents, cond, mode, 1.0, context, pooled, timestep, img_ids, txt_ids, guidance

    @nn.compact
    def __call__(self, hidden_states, controlnet_cond, controlnet_mode=None, conditioning_scale=1.0,
                 encoder_hidden_states=None, pooled_projections=None, timestep=None, img_ids=None, txt_ids=None,
                 guidance=None):
        cfg, dtype = self.config, self.dtype
        mode = None
        if cfg.union:
            if controlnet_mode is None:
                raise ValueError(f"controlnet_mode=None: this is a Union ControlNet (num_mode={cfg.num_mode}); give "
                                 f"the kind of its control picture, a mode in 0 .. {cfg.num_mode - 1}")
            modes = jnp.reshape(jnp.asarray(controlnet_mode, jnp.int32), (-1, 1))
            mode = Embed(cfg.num_mode, cfg.inner_dim, dtype=dtype, name="controlnet_mode_embedder")(modes)
            mode = jnp.broadcast_to(mode, (hidden_states.shape[0], 1, cfg.inner_dim))
        x, context, temb, rope = self.embed(hidden_states, encoder_hidden_states, pooled_projections, timestep,
                                            img_ids, txt_ids, guidance, text_prefix=mode)
        cond = self.condition_tokens(controlnet_cond)
        if cond.shape[1:] != hidden_states.shape[1:]:
            raise ValueError(f"controlnet_cond gives tokens {tuple(cond.shape)}; the latents are "
                             f"{tuple(hidden_states.shape)}: give the control picture at the image's size")
        x = x + Dense(cfg.inner_dim, dtype=dtype, name="controlnet_x_embedder")(cond.astype(dtype))

        states = {"double": [], "single": []}

        def record(kind, i, x):
            states[kind].append(x)
            return x

        self.blocks(x, context, temb, rope, record)
        scale = jnp.reshape(jnp.asarray(conditioning_scale, dtype), jnp.shape(conditioning_scale) + (1, 1))
        outputs = []
        for kind, prefix in (("double", "controlnet_blocks"), ("single", "controlnet_single_blocks")):
            samples = tuple(Dense(cfg.inner_dim, dtype=dtype, name=f"{prefix}_{i}")(state) * scale
                            for i, state in enumerate(states[kind]))
            outputs.append(samples or None)
        return tuple(outputs)

    def condition_tokens(self, controlnet_cond):
        """The control picture's tokens: its packed latents as given, or XLabs' hint features, packed."""
        cfg = self.config
        if not cfg.conditioning_embedding_channels:
            return controlnet_cond
        hint = ControlNetConditioningEmbedding(HINT_CHANNELS, cfg.conditioning_embedding_channels, self.dtype,
                                               kernels=self.kernels, name="input_hint_block")(
            jnp.transpose(controlnet_cond, (0, 2, 3, 1)).astype(self.dtype))  # (B, H/8, W/8, C)
        b, h, w, c = hint.shape
        p = cfg.patch_size  # diffusers' packing: each patch's features channel-major
        hint = hint.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 2, 4)
        return hint.reshape(b, (h // p) * (w // p), c * p * p)
