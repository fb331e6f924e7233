"""SD3Transformer2DModel: the MMDiT denoiser of Stable Diffusion 3 and 3.5 (Esser et al. 2024), as diffusers builds
it. Latents are cut into patches, given a sin-cos position embedding cropped from a larger table, and run with the
projected text states through joint transformer blocks (`mmdit_blocks.py`) conditioned on the timestep and the
pooled text embedding; the image tokens are then modulated, projected and put back together."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from .config import ConfigError, config_from_dict, config_source
from .layers import Conv2d, Dense, Kernels, ReadsParams, resolve_kernels, timestep_embedding
from .mmdit_blocks import QK_NORMS, JointTransformerBlock, layer_norm
from .pretrained import Pretrained

TIMESTEP_CHANNELS = 256  # the sinusoidal timestep features before the timestep embedder's MLP


@dataclasses.dataclass(frozen=True)
class MMDiTConfig:
    """The fields the transformer and its ControlNets (`sd3_controlnet.SD3ControlNetConfig`) share."""

    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1152
    pooled_projection_dim: int = 2048
    pos_embed_max_size: int = 96  # the side of the position table, in patches
    dual_attention_layers: tuple = ()  # the blocks with a second, image-only attention (SD 3.5 Medium)
    qk_norm: str | None = None  # "rms_norm" in SD 3.5

    def check_blocks(self, name):
        """The blocks' settings sdflax builds: a supported qk_norm, a joint attention as wide as the image's
        (where there is text), dual attention in existing layers."""
        if self.qk_norm not in QK_NORMS:
            raise ConfigError(f"{name}: qk_norm={self.qk_norm!r:.100}; sdflax supports None and 'rms_norm'")
        if self.joint_attention_dim is not None and self.caption_projection_dim != self.inner_dim:
            raise ConfigError(f"{name}: caption_projection_dim={self.caption_projection_dim} must equal "
                              f"num_attention_heads * attention_head_dim = {self.inner_dim}, the width of the joint "
                              "attention")
        bad = [i for i in self.dual_attention_layers if not isinstance(i, int) or not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"{name}: dual_attention_layers has {bad[0]!r:.100}; give layer indices from 0 to "
                              f"num_layers - 1 = {self.num_layers - 1}")

    @property
    def inner_dim(self):
        return self.num_attention_heads * self.attention_head_dim


@dataclasses.dataclass(frozen=True)
class SD3TransformerConfig(MMDiTConfig):
    out_channels: int = 16

    @classmethod
    def from_dict(cls, config):
        cfg = config_from_dict(cls, config)
        name = config_source(config) + cls.__name__
        if config.get("out_channels", 0) is None:  # diffusers: as many as come in
            cfg = dataclasses.replace(cfg, out_channels=cfg.in_channels)
        if "pos_embed_max_size" in config and config["pos_embed_max_size"] is None:
            raise ConfigError(f"{name}: pos_embed_max_size=None (an uncropped position embedding) is not supported; "
                              "SD 3 and 3.5 set it")
        cfg.check_blocks(name)
        return cfg


def sincos_position_table(dim: int, grid: int, base_size: int) -> np.ndarray:
    """diffusers' `get_2d_sincos_pos_embed(dim, grid, base_size)`: (grid * grid, dim) float32, row-major over the
    (row, column) patches; positions scaled by base_size / grid; the first half of the channels encodes the
    column, the second the row, each as [sin, cos] of dim / 4 frequencies."""
    positions = np.arange(grid, dtype=np.float32) / np.float32(grid / base_size)  # float32, as diffusers
    omega = 1.0 / 10000 ** (np.arange(dim // 4, dtype=np.float64) / (dim / 4))

    def embed(pos):  # (M,) -> (M, dim / 2), in float64
        out = np.outer(pos.astype(np.float64), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    rows, columns = np.meshgrid(positions, positions, indexing="ij")
    return np.concatenate([embed(columns.reshape(-1)), embed(rows.reshape(-1))], axis=1).astype(np.float32)


class PatchEmbed(ReadsParams, nn.Module):
    """diffusers' PatchEmbed for SD 3: a stride-`patch_size` conv (proj), then the position table (`pos_embed`,
    stored in the checkpoints) cropped to the latent's patches around its centre. NHWC (B, H, W, C) -> (B, N, D)."""

    patch_size: int
    embed_dim: int
    max_size: int | None  # None: no position table (the conv alone, diffusers' pos_embed_type=None)
    base_size: int
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x):
        p, m = self.patch_size, self.max_size
        x = Conv2d(self.embed_dim, p, p, 0, dtype=self.dtype, kernels=self.kernels, name="proj")(x)
        b, h, w, d = x.shape
        if m is None:
            return x.reshape(b, h * w, d)
        table = self.param("pos_embed", lambda key, shape: jnp.asarray(sincos_position_table(d, m, self.base_size))[
            None], (1, m * m, d))
        top, left = (m - h) // 2, (m - w) // 2
        table = table.reshape(m, m, d)[top:top + h, left:left + w].reshape(1, h * w, d)
        return (x.reshape(b, h * w, d).astype(jnp.float32) + table.astype(jnp.float32)).astype(self.dtype)


class SD3Transformer2DModel(Pretrained, nn.Module):
    """The velocity prediction from latents (B, C, H, W), text states (B, T, joint_attention_dim), the pooled text
    embedding (B, pooled_projection_dim) and timesteps (B,) or () -> (B, out_channels, H, W).

    `skip_layers` (static, block indices) skips whole blocks, as diffusers' `skip_layers` (skip-layer guidance).
    `block_controlnet_hidden_states`: SD 3 ControlNets' block samples (each (B, N, D)), added to the image tokens
    after every block but the last, block i taking sample int(i / (num_layers / count)) (diffusers' interval rule).
    `image_prompts`: SD 3.5's IP-Adapter, a `mmdit_blocks.JointImagePrompt` per block, or None.
    Attention layers are `mmdit_blocks.JointAttention`, whose `attend` the hooks intercept by checkpoint name
    (`transformer_blocks.0.attn`, `transformer_blocks.0.attn2`).
    """

    config: SD3TransformerConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)
    config_class = SD3TransformerConfig

    def dummy_inputs(self):
        cfg = self.config
        return (jnp.zeros((1, cfg.in_channels, cfg.patch_size, cfg.patch_size)),
                jnp.zeros((1, 1, cfg.joint_attention_dim)), jnp.zeros((1, cfg.pooled_projection_dim)), jnp.zeros((1,)))

    def __call__(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, skip_layers=(),
                 block_controlnet_hidden_states=None, image_prompts=None):
        return self.run_blocks(hidden_states, encoder_hidden_states, pooled_projections, timestep, skip_layers,
                               block_controlnet_hidden_states, image_prompts)[0]

    @nn.compact
    def run_blocks(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, skip_layers=(),
                   block_controlnet_hidden_states=None, image_prompts=None, blocks=None, start=None):
        """`__call__` -> (prediction, (the image's tokens entering the blocks run, the image's and the text's
        tokens they give)); `blocks` (first, stop or None: to the last), static, runs only those, from `start`
        (image, text tokens) in place of the embedded inputs: the first-block cache's halves
        (`sdflax.hooks.first_block_cache`)."""
        cfg, dtype, p = self.config, self.dtype, self.config.patch_size
        b, _, height, width = hidden_states.shape
        if height % p or width % p:
            raise ValueError(f"latents of {height}x{width}: both sides must be multiples of patch_size={p}")
        if max(height, width) // p > cfg.pos_embed_max_size:
            raise ValueError(f"latents of {height}x{width} are {height // p}x{width // p} patches; this model's "
                             f"position table has {cfg.pos_embed_max_size} a side (pos_embed_max_size): use smaller "
                             "images")
        dense = lambda features, name: Dense(features, dtype=dtype, name=name)  # noqa: E731

        x = jnp.transpose(hidden_states, (0, 2, 3, 1)).astype(dtype)  # NCHW -> NHWC
        x = self.patch_embed(name="pos_embed")(x)
        temb = self.embed_time_and_text(timestep, pooled_projections, b)
        context = dense(cfg.caption_projection_dim, "context_embedder")(encoder_hidden_states.astype(dtype))

        if start is not None:
            x, context = start
        entering = x
        first, stop = blocks or (0, None)
        for i in range(first, cfg.num_layers if stop is None else stop):
            if i not in skip_layers:
                context, x = JointTransformerBlock(
                    cfg.num_attention_heads, cfg.attention_head_dim, context_pre_only=i == cfg.num_layers - 1,
                    qk_norm=cfg.qk_norm, dual_attention=i in cfg.dual_attention_layers, dtype=dtype,
                    kernels=self.kernels, name=f"transformer_blocks_{i}")(
                    x, context, temb, None, None if image_prompts is None else image_prompts[i])
            if block_controlnet_hidden_states is not None and i < cfg.num_layers - 1:  # a skipped block's too
                samples = block_controlnet_hidden_states
                x = x + samples[int(i / (cfg.num_layers / len(samples)))].astype(x.dtype)

        # norm_out: AdaLayerNormContinuous, scale then shift
        scale, shift = jnp.split(dense(2 * cfg.inner_dim, "norm_out_linear")(nn.silu(temb)), 2, axis=-1)
        out = layer_norm(x, dtype) * (1 + scale[:, None]) + shift[:, None]
        out = dense(p * p * cfg.out_channels, "proj_out")(out)
        out = out.reshape(b, height // p, width // p, p, p, cfg.out_channels)
        return jnp.einsum("nhwpqc->nchpwq", out).reshape(b, cfg.out_channels, height, width), (entering, (x, context))

    def embed_time_and_text(self, timestep, pooled_projections, batch):
        return embed_time_and_text(timestep, pooled_projections, batch, self.config.inner_dim, self.dtype)

    @nn.nowrap
    def patch_embed(self, name=None) -> PatchEmbed:
        """Its patch embedding (`pos_embed`), which SD 3.5 Large's ControlNets share (`use_pos_embed=False`)."""
        cfg = self.config
        return PatchEmbed(cfg.patch_size, cfg.inner_dim, cfg.pos_embed_max_size, cfg.sample_size // cfg.patch_size,
                          self.dtype, kernels=self.kernels, name=name)


def embed_time_and_text(timestep, pooled_projections, batch, dim, dtype):
    """diffusers' CombinedTimestepTextProjEmbeddings: MLP(sinusoidal(t)) + MLP(pooled text) -> (B, dim)."""
    dense = lambda name: Dense(dim, dtype=dtype, name=f"time_text_embed_{name}")  # noqa: E731
    timestep = jnp.broadcast_to(jnp.asarray(timestep), (batch,))
    t = timestep_embedding(timestep, TIMESTEP_CHANNELS, flip_sin_to_cos=True, freq_shift=0).astype(dtype)
    t = dense("timestep_embedder_linear_2")(nn.silu(dense("timestep_embedder_linear_1")(t)))
    text = dense("text_embedder_linear_1")(pooled_projections.astype(dtype))
    return t + dense("text_embedder_linear_2")(nn.silu(text))
