"""What the CLIP text encoder, the UNet and the VAE share: attention, GroupNorm, ResNet blocks, up/downsampling.

Everything is NHWC. Module and parameter names follow the diffusers checkpoints (`to_q`, `norm1`, `conv_shortcut`,
...) so that loading is a rename table, not code. Normalisation statistics and softmax run in float32.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# How attention is computed. "xla": sdflax's einsum-softmax-einsum (fastest on the CPU); "cudnn": cuDNN's fused
# flash attention through jax.nn.dot_product_attention (NVIDIA GPUs, half precision); "pallas": JAX's Pallas flash
# attention kernel for TPUs; "auto": cuDNN or Pallas where they run for the call's shapes and dtype
# (`Kernels.cudnn_runs`, `Kernels.pallas_runs`), XLA elsewhere.
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas")
# The Pallas TPU kernel's blocks: query and key lengths must be multiples of it, and head dims are zero-padded to it.
PALLAS_BLOCK = 128
# On the CPU, attention runs one (image, head) pair at a time, in blocks of queries whose float32 logits take at
# most this many bytes, so that they stay near the caches while exp, the row sums and the product with v read them
# (docs/performance.md: blocks of queries over every head at once wrote their logits to memory).
CPU_ATTENTION_BLOCK_BYTES = 8 << 20
# On the CPU, a convolution with at most this many output pixels per image and at least this many input channels is
# faster as one matmul over its 3x3 patches than through XLA's convolution (SD 1.5's 8x8x2560 -> 1280); narrower
# ones are not, and their patches double the program's compile time (docs/performance.md). Per image, not per
# batch: the two paths sum in different orders, and an image must not change with the batch it is made in.
CPU_PATCH_MATMUL_PIXELS = 64
CPU_PATCH_MATMUL_MIN_CHANNELS = 256
# Up to this many input channels a 1x1 convolution is a matmul on the CPU (`patch_matmul_pays`); wider ones are
# faster as XLA's convolution (SD 1.5's 320 -> 640 shortcuts).
CPU_NARROW_1X1_CHANNELS = 16


@dataclasses.dataclass(frozen=True)
class Kernels:
    """How attention and convolutions are computed: the facts of the target device that decide it, and the user's
    attention choice. Frozen and hashable; resolved once (`resolve_kernels`) and handed to every layer.

    The CPU's attention loop and patch matmuls are chosen from `platform` here, not by `lax.platform_dependent` at
    lowering: one value decides every kernel, a program holds only the path it runs, and the choice for another
    device can be compiled and checked on this one.
    """

    platform: str  # jax's: "cpu", "gpu", "tpu"
    compute_capability: str | None = None  # NVIDIA GPUs only, e.g. "9.0"
    attention: str = "auto"  # one of ATTENTION_IMPLEMENTATIONS

    def __post_init__(self):
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention implementation must be one of {ATTENTION_IMPLEMENTATIONS}, "
                             f"got {self.attention!r}")

    def cudnn_runs(self, head_dim: int, dtype) -> bool:
        """Whether cuDNN flash attention runs. Its rule (jax's `check_is_flash_attention`): an NVIDIA GPU,
        float16/bfloat16, head dim a multiple of 8 and at most 128, or 256 from Hopper (compute capability 9.0)
        on. SD 1.5's 40/80/160 all qualify on Hopper; 160 falls back to XLA on Ampere."""
        if self.platform != "gpu" or self.compute_capability is None:
            return False
        if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
            return False
        major = int(self.compute_capability.split(".")[0])
        return head_dim % 8 == 0 and head_dim <= (256 if major >= 9 else 128)

    def pallas_runs(self, query_tokens: int | None, key_tokens: int | None, dtype) -> bool:
        """Whether JAX's Pallas flash attention kernel runs on a TPU: bfloat16 or float32, query and key lengths
        multiples of its 128-token blocks (SD's self-attention at 4096, 1024 and 256 tokens; not the 77-token
        cross-attention, nor 64 tokens, where XLA's fused attention is as good). Any head dim: it is zero-padded."""
        return (self.platform == "tpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float32)
                and query_tokens is not None and key_tokens is not None
                and query_tokens % PALLAS_BLOCK == 0 and key_tokens % PALLAS_BLOCK == 0)

    def attention_kernel(self, head_dim: int, dtype, query_tokens: int | None = None,
                         key_tokens: int | None = None) -> str:
        """"cudnn", "pallas" or "xla" for one attention call; a forced kernel where it cannot run is an error."""
        cudnn, pallas = self.cudnn_runs(head_dim, dtype), self.pallas_runs(query_tokens, key_tokens, dtype)
        if self.attention == "cudnn" and not cudnn:
            raise ValueError(f"attention='cudnn': cuDNN flash attention does not run on {self.platform} with "
                             f"{jnp.dtype(dtype)} and head dim {head_dim}; it needs an NVIDIA GPU, bfloat16 or float16 "
                             "and a head dim that is a multiple of 8, at most 128 (256 from Hopper on): use 'auto'")
        if self.attention == "pallas" and not self.pallas_runs(PALLAS_BLOCK, PALLAS_BLOCK, dtype):
            raise ValueError(f"attention='pallas': the Pallas flash attention kernel does not run on {self.platform} "
                             f"with {jnp.dtype(dtype)}; it needs a TPU and bfloat16 or float32 (and takes the layers "
                             f"whose token counts are multiples of {PALLAS_BLOCK}, XLA the others): use 'auto'")
        if self.attention in ("auto", "cudnn") and cudnn:
            return "cudnn"
        return "pallas" if self.attention in ("auto", "pallas") and pallas else "xla"


def resolve_kernels(attention: str = "auto", device=None) -> Kernels:
    """The Kernels for `device` (default: jax's first device) and the attention choice ("auto", "xla", "cudnn")."""
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)  # NVIDIA devices only
    return Kernels(device.platform, None if capability is None else str(capability), attention)


def attention_for(head_dim: int, dtype, device=None) -> str:
    """"cudnn" where cuDNN flash attention runs on `device` (default: jax's first) for this head dim and dtype,
    else "xla" (`Kernels.cudnn_runs`)."""
    return "cudnn" if resolve_kernels(device=device).cudnn_runs(head_dim, dtype) else "xla"


def dot_product_attention(q, k, v, *, causal=False, upcast=True, kernels: Kernels | None = None):
    """softmax(q kᵀ / √d) v over (B, T, heads, head_dim) arrays; logits and softmax in float32 when `upcast`.
    `kernels` defaults to `resolve_kernels()` for calls outside the models, which always pass theirs."""
    kernels = kernels or resolve_kernels()
    dtype = v.dtype
    kernel = kernels.attention_kernel(q.shape[-1], q.dtype, *((None, None) if causal else (q.shape[1], k.shape[1])))
    if kernel == "cudnn":  # its softmax accumulates in float32 always
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn").astype(dtype)
    if kernel == "pallas":
        return pallas_attention(q, k, v)
    if upcast:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    q = q * jnp.asarray(1 / math.sqrt(q.shape[-1]), q.dtype)  # on q, not on the (T, S) logits: T·S/d fewer products
    if kernels.platform == "cpu" and not causal:
        return _cpu_attention(q, k, v, dtype)
    return _attention(q, k, v, causal=causal, dtype=dtype)


def _attention(q, k, v, *, causal, dtype):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if causal:
        t_q, t_k = logits.shape[-2:]
        logits = jnp.where(jnp.tril(jnp.ones((t_q, t_k), bool)), logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def pallas_attention(q, k, v, kernel=None):
    """Non-causal attention through JAX's Pallas flash attention kernel for TPUs (`kernel(q, k, v, sm_scale=)` on
    (B, heads, T, d) arrays; its softmax in float32). The head dim is zero-padded to the kernel's 128 lanes: zero
    columns of q and k add nothing to q kᵀ, and those of v give output columns that are dropped."""
    if kernel is None:
        from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention as kernel
    d = q.shape[-1]
    pad = ((0, 0), (0, 0), (0, 0), (0, -d % PALLAS_BLOCK))
    q, k, v = (jnp.pad(x, pad).transpose(0, 2, 1, 3) for x in (q, k, v))
    return kernel(q, k, v, sm_scale=1 / math.sqrt(d)).transpose(0, 2, 1, 3)[..., :d].astype(v.dtype)


def _cpu_attention(q, k, v, dtype):
    """Attention in one piece if an image's float32 logits fit in `CPU_ATTENTION_BLOCK_BYTES` (an image's, not the
    batch's: the two paths round differently, and an image must not change with its batch), else for each (image,
    head) pair in turn over blocks of queries that fit (queries padded to whole blocks). Each block is normalised
    after its product with v: T·d divisions, not T·S."""
    b, t, h, d = q.shape
    s = k.shape[1]
    q, k, v = (jnp.moveaxis(x, 2, 1) for x in (q, k, v))  # (B, heads, tokens, d)
    if h * t * s * 4 <= CPU_ATTENTION_BLOCK_BYTES:
        return jnp.moveaxis(_attend_normalising_late(q, k, v, dtype), 1, 2)
    n = -(-t * s * 4 // CPU_ATTENTION_BLOCK_BYTES)  # blocks of queries per pair
    block = -(-t // n)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, n * block - t), (0, 0))).reshape(b * h, n, block, d)
    k, v = (x.reshape(b * h, *x.shape[2:]) for x in (k, v))

    def pair(q, k, v):  # q (n, block, d); k, v (S, d)
        return jax.lax.map(lambda q: _attend_normalising_late(q, k, v, dtype), q) if n > 1 else \
            _attend_normalising_late(q, k, v, dtype)

    out = jax.lax.map(lambda qkv: pair(*qkv), (q, k, v))  # (B·heads, n, block, dv)
    return jnp.moveaxis(out.reshape(b, h, n * block, -1), 1, 2)[:, :t]


def _attend_normalising_late(q, k, v, dtype):
    """softmax(q kᵀ) v over (..., T, d), (..., S, d), (..., S, dv), divided by the softmax's sums after the
    product with v."""
    logits = jnp.einsum("...qd,...kd->...qk", q, k).astype(jnp.float32)
    weights = jnp.exp(logits - logits.max(-1, keepdims=True))
    return (jnp.einsum("...qk,...kd->...qd", weights.astype(dtype), v) / weights.sum(-1, keepdims=True)).astype(dtype)


class ReadsParams:
    """Mixed into every layer with parameters. On every apply Flax checks each parameter against an `eval_shape` of
    its initializer, which was a large part of tracing a pipeline. Outside `init` an existing parameter is read
    directly and its shape compared with the one the layer asks for: the same ScopeParamShapeError, without a trace
    per parameter. Inside `shapes_only()` (parameter shapes, never values) new parameters are made by `jnp.empty`."""

    @nn.nowrap
    def param(self, name, init_fn, *init_args, unbox=True, **init_kwargs):
        shape = init_args[0] if init_args else None
        if isinstance(shape, tuple) and not self.is_initializing() and self.has_variable("params", name):
            value = self.get_variable("params", name)
            if np.shape(value) != shape:
                raise flax.errors.ScopeParamShapeError(name, self.scope.path_text, np.shape(value), shape)
            return flax.core.meta.unbox(value) if unbox else value
        if _SHAPES_ONLY.get():
            init_fn = _shape_only
        return super().param(name, init_fn, *init_args, unbox=unbox, **init_kwargs)


_SHAPES_ONLY = contextvars.ContextVar("sdflax_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
    """Within, layers make parameters with `jnp.empty`: for `jax.eval_shape` of an init, where values are unused."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def _shape_only(key, shape, dtype=jnp.float32):
    return jnp.empty(shape, dtype)


class Dense(ReadsParams, nn.Dense):
    """nn.Dense, `ReadsParams`."""


class LayerNorm(ReadsParams, nn.LayerNorm):
    """nn.LayerNorm, `ReadsParams`."""


class Embed(ReadsParams, nn.Embed):
    """nn.Embed, `ReadsParams`."""


class GroupNorm(ReadsParams, nn.Module):
    """torch.nn.GroupNorm on NHWC, statistics in float32."""

    num_groups: int
    epsilon: float = 1e-5
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        channels = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (channels,))
        bias = self.param("bias", nn.initializers.zeros, (channels,))
        grouped = x.astype(jnp.float32).reshape(*x.shape[:-1], self.num_groups, channels // self.num_groups)
        axes = tuple(range(1, grouped.ndim - 2)) + (grouped.ndim - 1,)  # spatial and within-group channels
        mean = grouped.mean(axes, keepdims=True)
        var = jnp.square(grouped - mean).mean(axes, keepdims=True)
        normed = ((grouped - mean) * jax.lax.rsqrt(var + self.epsilon)).reshape(x.shape)
        return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


def conv(features, kernel=3, stride=1, padding=None, name=None, dtype=jnp.float32, kernels: Kernels | None = None):
    """torch.nn.Conv2d with 'same'-style symmetric padding (k // 2), as every conv in SD uses."""
    return Conv2d(features, kernel, stride, kernel // 2 if padding is None else padding, dtype=dtype,
                  kernels=kernels or resolve_kernels(), name=name)


class Conv2d(ReadsParams, nn.Module):
    """torch.nn.Conv2d on NHWC with symmetric zero padding; params as flax's nn.Conv (kernel HWIO, bias)."""

    features: int
    kernel: int = 3
    stride: int = 1
    padding: int = 1
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x):
        k, s, p = self.kernel, self.stride, self.padding
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (k, k, x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
        h_out, w_out = ((side + 2 * p - k) // s + 1 for side in x.shape[1:3])

        def convolve(x, kernel):
            return jax.lax.conv_general_dilated(x, kernel, (s, s), ((p, p), (p, p)),
                                                dimension_numbers=("NHWC", "HWIO", "NHWC"))

        def patch_matmul(x, kernel):  # im2col: the k*k shifted views side by side, then one matmul
            x = jnp.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
            patches = jnp.concatenate([x[:, i:i + (h_out - 1) * s + 1:s, j:j + (w_out - 1) * s + 1:s]
                                       for i in range(k) for j in range(k)], axis=-1)
            return patches @ kernel.reshape(-1, self.features)

        as_matmul = self.kernels.platform == "cpu" and patch_matmul_pays(h_out * w_out, x.shape[-1], k)
        y = (patch_matmul if as_matmul else convolve)(x, kernel)
        return y + bias.astype(self.dtype)


def patch_matmul_pays(out_pixels: int, in_channels: int, kernel: int) -> bool:
    """Whether a CPU convolution runs as one matmul over its patches: small images (per image) with wide channels,
    and the 1x1 convolutions over the latents' few channels (the VAE's quant convs), which YNNPACK's convolution
    sums in an order that depends on the batch (docs/batch.md, "One image, any batch")."""
    if kernel == 1:
        return in_channels <= CPU_NARROW_1X1_CHANNELS
    return out_pixels <= CPU_PATCH_MATMUL_PIXELS and in_channels >= CPU_PATCH_MATMUL_MIN_CHANNELS


class Attention(nn.Module):
    """Multi-head attention as diffusers' `Attention`: to_q/to_k/to_v (+bias), to_out_0."""

    heads: int
    head_dim: int
    qkv_bias: bool = False
    upcast: bool = True
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x, context=None):  # x: (B, T, C); context: (B, S, D), x itself when None
        return multi_head_attention(x, x if context is None else context, self.heads, self.head_dim,
                                    qkv_bias=self.qkv_bias, upcast=self.upcast, dtype=self.dtype, kernels=self.kernels,
                                    attend=self.attend, queries=self.queries)

    def queries(self, q):
        """The queries as to_q gives them, (B, T, heads, head_dim): a hook point (SEG smooths them here)."""
        return q

    def attend(self, q, k, v):
        """softmax(q kᵀ / √d) v over (B, T, heads, head_dim): the hook point of `sdflax.hooks`, which intercept this
        method (`nn.intercept_methods`) to read or replace the attention of any layer by its checkpoint name."""
        return dot_product_attention(q, k, v, upcast=self.upcast, kernels=self.kernels)


def attention_probs(q, k, upcast=True):
    """softmax(q kᵀ / √d) over (B, T, heads, head_dim) q and (B, S, heads, head_dim) k: (B, heads, T, S) float32,
    the probabilities `dot_product_attention` multiplies v with (diffusers' `get_attention_scores`)."""
    if upcast:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    q = q * jnp.asarray(1 / math.sqrt(q.shape[-1]), q.dtype)
    return jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32), axis=-1)


def apply_probs(probs, v):
    """(B, heads, T, S) probabilities times (B, S, heads, head_dim) values -> (B, T, heads, head_dim)."""
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


def multi_head_attention(x, context, heads, head_dim, *, qkv_bias, upcast, dtype, kernels, attend=None,
                         queries=None):
    """to_out_0(attention(to_q(x), to_k(context), to_v(context))) split into heads; (B, T, C) -> (B, T, C).
    Called inside a compact method: the four projections become the caller's submodules, named as in diffusers.
    `attend(q, k, v)` replaces `dot_product_attention` and `queries(q)` sees the queries (the UNet's Attention
    passes its hook points)."""
    inner = heads * head_dim
    dense = lambda n, features, bias: Dense(features, use_bias=bias, name=n, dtype=dtype)  # noqa: E731
    split = lambda t: t.reshape(*t.shape[:2], heads, head_dim)  # noqa: E731
    q = split(dense("to_q", inner, qkv_bias)(x))
    q = queries(q) if queries is not None else q
    k = split(dense("to_k", inner, qkv_bias)(context))
    v = split(dense("to_v", inner, qkv_bias)(context))
    out = (attend or functools.partial(dot_product_attention, upcast=upcast, kernels=kernels))(q, k, v)
    return dense("to_out_0", x.shape[-1], True)(out.reshape(*out.shape[:2], inner))


class ResnetBlock2D(nn.Module):
    """GroupNorm-SiLU-conv twice, plus the (projected) timestep embedding in the middle; 1x1 conv shortcut."""

    out_channels: int
    groups: int = 32
    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x, temb=None):
        convolution = functools.partial(conv, dtype=self.dtype, kernels=self.kernels)
        h = nn.silu(GroupNorm(self.groups, self.eps, self.dtype, name="norm1")(x))
        h = convolution(self.out_channels, name="conv1")(h)
        if temb is not None:
            h = h + Dense(self.out_channels, name="time_emb_proj", dtype=self.dtype)(nn.silu(temb))[:, None, None, :]
        h = nn.silu(GroupNorm(self.groups, self.eps, self.dtype, name="norm2")(h))
        h = convolution(self.out_channels, name="conv2")(h)
        if x.shape[-1] != self.out_channels:
            x = convolution(self.out_channels, kernel=1, name="conv_shortcut")(x)
        return x + h


class Downsample2D(nn.Module):
    """Stride-2 3x3 conv. padding=0 is the VAE's asymmetric (0, 1) pad, padding=1 the UNet's symmetric one."""

    channels: int
    padding: int = 1
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x):
        if self.padding == 0:
            x = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))
        return conv(self.channels, stride=2, padding=self.padding, name="conv", dtype=self.dtype,
                    kernels=self.kernels)(x)


def nearest_indices(in_size: int, out_size: int) -> np.ndarray:
    """Source rows of torch's `F.interpolate(size=out_size, mode="nearest")`: floor(i * in / out), in float32."""
    scale = np.float32(in_size) / np.float32(out_size)
    return np.minimum(np.floor(np.arange(out_size, dtype=np.float32) * scale).astype(np.int64), in_size - 1)


class Upsample2D(nn.Module):
    """Nearest-neighbour 2x (or to `size`, the skip connection's (h, w), when a side is odd), then a 3x3 conv."""

    channels: int
    dtype: jnp.dtype = jnp.float32
    kernels: Kernels = dataclasses.field(kw_only=True)

    @nn.compact
    def __call__(self, x, size=None):
        h, w = x.shape[1:3]
        if size is None or tuple(size) == (2 * h, 2 * w):
            x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        else:  # as diffusers' UNet does for latents whose sides are not multiples of its total downsampling
            x = x[:, nearest_indices(h, size[0])][:, :, nearest_indices(w, size[1])]
        return conv(self.channels, name="conv", dtype=self.dtype, kernels=self.kernels)(x)


def timestep_embedding(timesteps, dim, flip_sin_to_cos=False, freq_shift=1.0, max_period=10000):
    """Sinusoidal embedding of (B,) timesteps (DDPM), as diffusers' `get_timestep_embedding`. float32."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift))
    args = timesteps.astype(jnp.float32)[:, None] * freqs[None]
    emb = jnp.concatenate([jnp.cos(args), jnp.sin(args)] if flip_sin_to_cos else [jnp.sin(args), jnp.cos(args)], -1)
    return jnp.pad(emb, ((0, 0), (0, dim % 2)))
