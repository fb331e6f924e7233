"""The model sampling runs, behind one calling convention: `denoiser(params, x, t, context, **extra)` -> the
prediction (B, C, h, w). A family's text piece names its denoiser (`text.SDText.denoiser`); the loop, the starts and
the checks ask it for what they need (its params' key, input channels, default size, text width).

- `UNetDenoiser`: SD 1.x / 2.x / SDXL's UNet (ε or v); `extra` are its keyword inputs (SDXL's time ids, ControlNet
  residuals).
- `MMDiTDenoiser`: SD 3.x's transformer (velocity); `extra` carries `pooled_projections`, for skip-layer
  guidance `skip_layers`, ControlNets' `block_controlnet_hidden_states` and an IP-Adapter's `image_prompts`.
- Flux.1's transformer: `sdflax.families.flux_text.FluxDenoiser`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Denoiser:
    model: Any

    patch = 1  # the latent side must be a multiple of this (a transformer's patch)
    probe_rank = 4  # the rank of `replication_probe`'s kernel, one more when replicated for pmap

    @property
    def in_channels(self) -> int:
        return self.model.config.in_channels

    @property
    def sample_size(self) -> int:
        """The default latent side."""
        return self.model.config.sample_size


@dataclasses.dataclass(frozen=True)
class UNetDenoiser(Denoiser):
    model: Any  # models.UNet2DConditionModel

    component = "unet"  # the pipeline attribute and params key
    flow = False  # predicts ε or v (a flow-matching scheduler is refused)

    def __call__(self, params, x, t, context, **extra):
        return self.model.apply(params[self.component], x, t, context, **extra)

    @property
    def context_width(self) -> int:
        return self.model.config.cross_attention_dim

    def image_seq_len(self, latent_height, latent_width) -> None:
        return None  # a UNet's schedule does not depend on the image's size

    def replication_probe(self, params):
        """A 4-D kernel of its params (5-D when replicated for pmap), or None."""
        own = params[self.component]
        return own.get("conv_in", {}).get("kernel") if isinstance(own, Mapping) else None


@dataclasses.dataclass(frozen=True)
class MMDiTDenoiser(Denoiser):
    model: Any  # models.SD3Transformer2DModel

    component = "transformer"
    flow = True  # predicts a flow's velocity (only a flow-matching scheduler fits)

    def __call__(self, params, x, t, context, pooled_projections, skip_layers=(), block_controlnet_hidden_states=None,
                 image_prompts=None):
        return self.model.apply(params[self.component], x, context, pooled_projections, t, skip_layers=skip_layers,
                                block_controlnet_hidden_states=block_controlnet_hidden_states,
                                image_prompts=image_prompts)

    @property
    def context_width(self) -> int:
        return self.model.config.joint_attention_dim

    @property
    def patch(self) -> int:
        return self.model.config.patch_size

    def image_seq_len(self, latent_height, latent_width) -> int:
        """The image's tokens, from which a dynamically shifting schedule takes its shift (diffusers' SD 3)."""
        p = self.model.config.patch_size
        return (latent_height // p) * (latent_width // p)

    def replication_probe(self, params):
        own = params[self.component]
        return own.get("pos_embed", {}).get("proj", {}).get("kernel") if isinstance(own, Mapping) else None
