"""The MMDiT's joint transformer block (Esser et al. 2024) as diffusers builds it (`JointTransformerBlock`): two
token streams, image and text, each with its own adaLN-Zero modulation, projections and feed-forward, meeting in one
attention over their concatenated tokens. SD 3.5 adds RMSNorm on queries and keys, and SD 3.5 Medium (MMDiT-X) a
second, image-only attention in some blocks."""

from __future__ import annotations

import dataclasses

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from .layers import Attention, Dense, Kernels, LayerNorm, ReadsParams, dot_product_attention

QK_NORMS = (None, "rms_norm")  # the qk_norm values sdflax builds (SD 3: None, SD 3.5: "rms_norm")
EPS = 1e-6  # every norm of the MMDiT


class RMSNorm(ReadsParams, nn.Module):
    """diffusers' RMSNorm over the last axis with a learned scale; statistics in float32."""

    epsilon: float = EPS
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        return rms_norm(x, self.param("scale", nn.initializers.ones, (x.shape[-1],)), self.epsilon, self.dtype)


def rms_norm(x, scale, epsilon=EPS, dtype=None):
    """x / RMS(x) * scale over the last axis, in float32."""
    y = x.astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.square(y).mean(-1, keepdims=True) + epsilon)
    return (y * scale.astype(jnp.float32)).astype(dtype or x.dtype)


@flax.struct.dataclass
class JointImagePrompt:
    """SD 3.5 Large's IP-Adapter in one block (diffusers' SD3IPAdapterJointAttnProcessor2_0): the processor's own
    RMSNorm scales of the image tokens' queries and keys (head_dim,), the image prompt's keys (normed) and values
    (B, T, heads, head_dim), and the scale."""

    norm_q: jax.Array
    norm_k: jax.Array
    keys: jax.Array
    values: jax.Array
    scale: jax.Array


class JointAttention(Attention):
    """diffusers' Attention with JointAttnProcessor2_0. With a context: the image tokens' to_q/to_k/to_v and the
    context's add_q_proj/add_k_proj/add_v_proj attend as one sequence [image; context], and the outputs split back
    through to_out_0 and to_add_out (none for a `context_pre_only` block, whose context output is unused). Without
    one (the dual attention, attn2): self-attention of the image tokens. `attend` is the hook point, as in the
    UNet's attention: it sees the joint sequence, whose first `image_tokens` are the image's; `queries` sees the
    image tokens' queries as to_q gives them, before the RMSNorm (where diffusers' SEG smooths them). Flux passes
    `rope`, the rotary (cos, sin) of the joint sequence's tokens (`rotate`), applied to queries and keys after the
    RMSNorm."""

    qk_norm: str | None = None
    context_pre_only: bool = False

    @nn.compact
    def __call__(self, x, context=None, rope=None, image_prompt=None):  # x: (B, N, D); context: (B, T, D) or None
        inner = self.heads * self.head_dim
        dense = lambda name, features=inner: Dense(features, dtype=self.dtype, name=name)  # noqa: E731
        split = lambda t: t.reshape(*t.shape[:2], self.heads, self.head_dim)  # noqa: E731

        def normed(name, t):
            return RMSNorm(EPS, self.dtype, name=name)(t) if self.qk_norm else t

        q_image, k_image = self.queries(split(dense("to_q")(x))), split(dense("to_k")(x))
        v_image = v = split(dense("to_v")(x))
        q, k = normed("norm_q", q_image), normed("norm_k", k_image)
        joint_prompt = image_prompt if isinstance(image_prompt, JointImagePrompt) else None
        prompted = None if image_prompt is None or joint_prompt else self.image_prompt_attention(q, image_prompt)
        if context is not None:
            q = jnp.concatenate([q, normed("norm_added_q", split(dense("add_q_proj")(context)))], axis=1)
            k = jnp.concatenate([k, normed("norm_added_k", split(dense("add_k_proj")(context)))], axis=1)
            v = jnp.concatenate([v, split(dense("add_v_proj")(context))], axis=1)
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        n = x.shape[1]
        out = self.attend(q, k, v, image_tokens=n)
        out = out.reshape(*out.shape[:2], inner)
        image = out[:, :n]
        if joint_prompt is not None:  # SD 3.5's IP-Adapter: before to_out
            image = image + joint_prompt.scale.astype(image.dtype) * self.joint_prompt_attention(
                q_image, k_image, v_image, joint_prompt)
        image = dense("to_out_0", x.shape[-1])(image)
        if context is None:
            return image
        context_out = None if self.context_pre_only else dense("to_add_out", context.shape[-1])(out[:, n:])
        return (image, context_out) if prompted is None else (image, context_out, prompted)

    def joint_prompt_attention(self, q, k, v, prompt: JointImagePrompt):
        """SD 3.5's IP-Adapter: the image tokens' queries (normed by the processor's own norm_q) attend to their
        keys (its norm_k) and the image prompt's, and to their values and the prompt's: (B, N, heads * head_dim)."""
        q, k = rms_norm(q, prompt.norm_q), rms_norm(k, prompt.norm_k)
        keys, values = (jnp.concatenate([a, b.astype(a.dtype)], axis=1) for a, b in ((k, prompt.keys),
                                                                                   (v, prompt.values)))
        out = dot_product_attention(q, keys, values, upcast=self.upcast, kernels=self.kernels)
        return out.reshape(*q.shape[:2], -1)

    def image_prompt_attention(self, q, image_prompt):
        """Flux's IP-Adapter (diffusers' FluxIPAdapterAttnProcessor): the image tokens' normed queries, before
        their rotary positions, attend to each adapter's image-prompt keys and values, times its scale; summed:
        (B, N, heads * head_dim), which the block adds after its feed-forward. `image_prompt`: per adapter
        (keys, values, scale), keys and values a tuple of (rows, T, heads, head_dim) arrays, one per chunk of the
        batch's rows (the negative image's, then the image's, under true CFG)."""
        out = 0
        for keys, values, scale in image_prompt:
            chunks = zip(jnp.split(q, len(keys)), keys, values)
            attended = [dot_product_attention(part, k.astype(q.dtype), v.astype(q.dtype), upcast=self.upcast,
                                              kernels=self.kernels) for part, k, v in chunks]
            out = out + scale.astype(q.dtype) * jnp.concatenate(attended)
        return out.reshape(*q.shape[:2], -1)

    def attend(self, q, k, v, image_tokens=None):
        """The attention of the joint sequence; `image_tokens` tells the hooks where the text's tokens begin."""
        return dot_product_attention(q, k, v, upcast=self.upcast, kernels=self.kernels)  # (not super's: a hook point)


def rotate(x, rope):
    """Rotary position embedding (Su et al. 2021) as diffusers' `apply_rotary_emb` on interleaved pairs: each pair
    (x₂ⱼ, x₂ⱼ₊₁) of (B, L, heads, head_dim) x turned by its token's angle, whose cos and sin `rope` holds, each
    (L, head_dim / 2) float32; in float32."""
    cos, sin = (r[None, :, None] for r in rope)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    real, imaginary = pairs[..., 0], pairs[..., 1]
    turned = jnp.stack([real * cos - imaginary * sin, imaginary * cos + real * sin], axis=-1)
    return turned.reshape(x.shape).astype(x.dtype)


def modulate(x, shift, scale):
    """adaLN: x * (1 + scale) + shift, with (B, D) shift and scale over (B, N, D) tokens."""
    return x * (1 + scale[:, None]) + shift[:, None]


class JointTransformerBlock(nn.Module):
    """(image (B, N, D), context (B, T, D), temb (B, D)) -> (context or None, image), as diffusers'
    JointTransformerBlock. norm1 is AdaLayerNormZero (SD35AdaLayerNormZeroX with `dual_attention`: three more
    chunks, the shift, scale and gate of attn2); norm1_context AdaLayerNormZero, or AdaLayerNormContinuous
    (scale, then shift) in the last block, which keeps no context stream after its attention. Flux's double-stream
    block (diffusers' FluxTransformerBlock) is this block with qk RMSNorm and `rope` given to its attention."""

    heads: int
    head_dim: int
    context_pre_only: bool = False
    qk_norm: str | None = None
    dual_attention: bool = False
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x, context, temb, rope=None, image_prompt=None):
        dim = x.shape[-1]
        emb = nn.silu(temb)

        def chunks(name, n):  # the adaLN modulation: n (B, D) chunks
            return jnp.split(Dense(n * dim, dtype=self.dtype, name=name)(emb), n, axis=-1)

        def attention(name, context_pre_only=False):
            return JointAttention(self.heads, self.head_dim, qkv_bias=True, dtype=self.dtype, kernels=self.kernels,
                                  qk_norm=self.qk_norm, context_pre_only=context_pre_only, name=name)

        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, *dual = chunks(
            "norm1_linear", 9 if self.dual_attention else 6)
        normed = layer_norm(x, self.dtype)
        if self.context_pre_only:
            scale, shift = chunks("norm1_context_linear", 2)
            context_in = modulate(layer_norm(context, self.dtype), shift, scale)
        else:
            c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = chunks(
                "norm1_context_linear", 6)
            context_in = modulate(layer_norm(context, self.dtype), c_shift_msa, c_scale_msa)

        image_out, context_out, *prompted = attention("attn", self.context_pre_only)(
            modulate(normed, shift_msa, scale_msa), context_in, rope, image_prompt)
        x = x + gate_msa[:, None] * image_out
        if self.dual_attention:
            shift_msa2, scale_msa2, gate_msa2 = dual
            x = x + gate_msa2[:, None] * attention("attn2")(modulate(normed, shift_msa2, scale_msa2))
        x = x + gate_mlp[:, None] * feed_forward("ff", modulate(layer_norm(x, self.dtype), shift_mlp, scale_mlp),
                                                 self.dtype)
        if prompted:  # Flux's IP-Adapter: after the feed-forward, ungated (diffusers' FluxTransformerBlock)
            x = x + prompted[0].astype(x.dtype)
        if self.context_pre_only:
            return None, x

        context = context + c_gate_msa[:, None] * context_out
        context_in = modulate(layer_norm(context, self.dtype), c_shift_mlp, c_scale_mlp)
        return context + c_gate_mlp[:, None] * feed_forward("ff_context", context_in, self.dtype), x


def feed_forward(name, x, dtype):
    """diffusers' FeedForward with "gelu-approximate": Dense(4D), tanh GELU, Dense(D)."""
    h = Dense(4 * x.shape[-1], dtype=dtype, name=f"{name}_net_0_proj")(x)
    return Dense(x.shape[-1], dtype=dtype, name=f"{name}_net_2")(nn.gelu(h, approximate=True))


def layer_norm(x, dtype):
    """LayerNorm without scale or bias (elementwise_affine=False), eps 1e-6."""
    return LayerNorm(EPS, use_bias=False, use_scale=False, dtype=dtype)(x)
