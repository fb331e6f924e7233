"""CLIPVisionModelWithProjection: CLIP's image tower (Radford et al. 2021) as transformers builds it, a pre-LN ViT
whose class token, normed and projected, is the image embedding. IP-Adapter's image encoders (ViT-H/14, ViT-bigG/14)
are this model; its penultimate layer's states feed the IP-Adapter Plus resamplers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from .clip import ACTIVATIONS, EncoderLayer
from .config import ConfigError, config_from_dict, config_source
from .layers import Dense, Embed, Kernels, LayerNorm, ReadsParams, resolve_kernels
from .pretrained import Pretrained


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    projection_dim: int = 512

    @classmethod
    def from_dict(cls, config):
        nested = config.get("vision_config") if isinstance(config, Mapping) else None
        config = nested if isinstance(nested, Mapping) else config  # a full CLIPConfig nests the vision tower's
        cfg = config_from_dict(cls, config)
        where = f"{config_source(config)}CLIPVisionConfig: "
        if cfg.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"{where}hidden_act={cfg.hidden_act!r:.100}; sdflax knows {sorted(ACTIVATIONS)}")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ConfigError(f"{where}hidden_size={cfg.hidden_size} is not a multiple of num_attention_heads="
                              f"{cfg.num_attention_heads}")
        if cfg.patch_size > cfg.image_size:
            raise ConfigError(f"{where}patch_size={cfg.patch_size} is larger than image_size={cfg.image_size}")
        return cfg

    @property
    def grid(self) -> int:
        """Patches along a side (a convolution with stride patch_size drops the pixels left over)."""
        return self.image_size // self.patch_size


@flax.struct.dataclass
class CLIPVisionOutput:
    image_embeds: jax.Array  # (B, projection_dim): visual_projection(post_layernorm(the class token's last state))
    last_hidden_state: jax.Array  # (B, 1 + patches, D), the last layer's output (no LayerNorm after it)
    hidden_states: tuple | None = None  # the embeddings after pre_layrnorm, then every layer's output: L + 1 items


class PatchEmbedding(ReadsParams, nn.Module):
    """transformers' patch_embedding, a Conv2d whose stride is its kernel (CLIP's without bias, SigLIP's with):
    one matmul over the patches. Pixels (B, C, H, W) -> (B, grid², features), patches in row-major order."""

    features: int
    patch: int
    dtype: jnp.dtype = jnp.float32
    use_bias: bool = False

    @nn.compact
    def __call__(self, pixels):
        b, c, h, w = pixels.shape
        p = self.patch
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (p, p, c, self.features))  # HWIO
        gh, gw = h // p, w // p  # a stride-p convolution leaves out the pixels past the last whole patch
        patches = pixels[:, :, :gh * p, :gw * p].reshape(b, c, gh, p, gw, p).transpose(0, 2, 4, 3, 5, 1)
        patches = patches.reshape(b, gh * gw, p * p * c).astype(self.dtype)  # each patch in the kernel's (kh, kw, I)
        out = patches @ kernel.reshape(p * p * c, self.features).astype(self.dtype)
        if self.use_bias:
            out = out + self.param("bias", nn.initializers.zeros, (self.features,)).astype(self.dtype)
        return out


class VisionEmbeddings(ReadsParams, nn.Module):
    """The class token then the patches, each with its learned position embedding: (B, 1 + grid², D)."""

    config: CLIPVisionConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, pixels):
        cfg = self.config
        init = nn.initializers.normal(cfg.hidden_size ** -0.5)
        class_embedding = self.param("class_embedding", init, (cfg.hidden_size,))
        patches = PatchEmbedding(cfg.hidden_size, cfg.patch_size, self.dtype, name="patch_embedding")(pixels)
        tokens = jnp.broadcast_to(class_embedding.astype(self.dtype), (patches.shape[0], 1, cfg.hidden_size))
        x = jnp.concatenate([tokens, patches], axis=1)
        positions = Embed(cfg.grid ** 2 + 1, cfg.hidden_size, dtype=self.dtype, name="position_embedding")
        return x + positions(jnp.arange(x.shape[1]))[None]


class CLIPVisionModelWithProjection(Pretrained, nn.Module):
    """Pixels (B, C, H, W) at the config's image_size, normalised as CLIP's image processor does
    (`sdflax.pipeline.clip_image.clip_image_inputs`) -> CLIPVisionOutput."""

    config: CLIPVisionConfig
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(default_factory=resolve_kernels)
    config_class = CLIPVisionConfig
    # a two-tower checkpoint's (CLIPModel's: openai/clip-vit-large-patch14) tensors of the text tower, which this
    # model skips, as transformers' CLIPVisionModelWithProjection.from_pretrained does
    other_tower = ("text_model.", "text_projection.", "logit_scale")

    def dummy_inputs(self):
        cfg = self.config
        return (jnp.zeros((1, cfg.num_channels, cfg.image_size, cfg.image_size), self.dtype),)

    @nn.compact
    def __call__(self, pixel_values, output_hidden_states=False):
        cfg = self.config
        pixel_values = jnp.asarray(pixel_values)
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)}: this CLIP vision model takes "
                             f"(B, {', '.join(map(str, expected))}) (clip_image_inputs(images, size={cfg.image_size}, "
                             f"crop_size={cfg.image_size}) makes them)")
        norm = lambda name: LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, name=name)  # noqa: E731
        x = norm("pre_layrnorm")(VisionEmbeddings(cfg, self.dtype, name="embeddings")(pixel_values))

        hidden_states = [x]
        for i in range(cfg.num_hidden_layers):
            x = EncoderLayer(cfg, self.dtype, self.kernels, causal=False, name=f"encoder_layers_{i}")(x)
            hidden_states.append(x)
        pooled = norm("post_layernorm")(x[:, 0])
        image_embeds = Dense(cfg.projection_dim, use_bias=False, dtype=self.dtype, name="visual_projection")(pooled)
        return CLIPVisionOutput(image_embeds, x, tuple(hidden_states) if output_hidden_states else None)
