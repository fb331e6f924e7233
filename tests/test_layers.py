"""CPU-specific attention and convolution paths give PyTorch's numbers; the Kernels value picks the paths."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

import jax.numpy as jnp

from sdflax.models import layers
from sdflax.models.layers import conv, dot_product_attention

RTOL, ATOL = 1e-4, 1e-5  # float32


def compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.parametrize("tokens, keys, causal, block_bytes, loops", [
    (800, 800, False, None, 1),                # 10 MB of logits an image: one (image, head) pair at a time
    (700, 700, False, 660_000, 2),             # 1.96 MB a pair: three blocks of 234 queries, the last one padded
    (1024, 77, False, None, 0),                # an image's logits fit at once: one piece
    (77, 77, True, None, 0),                   # causal (CLIP): one piece
])
def test_attention_matches_sdpa(tokens, keys, causal, block_bytes, loops, monkeypatch):
    """The CPU's attention in one piece, by (image, head) pair, and in blocks of queries, against PyTorch."""
    if block_bytes:
        monkeypatch.setattr(layers, "CPU_ATTENTION_BLOCK_BYTES", block_bytes)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, tokens, 4, 40), dtype=np.float32)
    k, v = (rng.standard_normal((2, keys, 4, 40), dtype=np.float32) for _ in range(2))
    ours = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, causal=causal))(q, k, v)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(t).transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)
    np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=RTOL, atol=ATOL)
    assert compiled_text(functools.partial(dot_product_attention, causal=causal), q, k, v).count(" while(") == loops


@pytest.mark.parametrize("tokens, keys", [(800, 800), (1024, 77)])
def test_attention_of_an_image_does_not_depend_on_its_batch(tokens, keys):
    """Whether the CPU's attention loops is decided by one image's logits, and each image's numbers are the same
    bits alone and in a batch, on both paths."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, tokens, 4, 40), dtype=np.float32)
    k, v = (rng.standard_normal((3, keys, 4, 40), dtype=np.float32) for _ in range(2))
    attend = jax.jit(dot_product_attention)
    batch = np.asarray(attend(q, k, v))
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(attend(q[i:i + 1], k[i:i + 1], v[i:i + 1]))[0], batch[i])


@pytest.mark.parametrize("size, channels, kernel, stride, padding", [
    (8, 256, 3, 1, 1),   # 8 x 8 = 64 output pixels an image, 256 channels: one patch matmul on the CPU
    (8, 48, 3, 1, 1),    # 64 output pixels, 48 channels: XLA's convolution
    (32, 16, 3, 1, 1),   # 1024 output pixels an image: XLA's convolution
    (9, 24, 3, 2, 1),    # odd side, stride 2
    (10, 24, 3, 2, 0),   # the VAE's downsampling (its (0, 1) pad happens before the conv)
    (8, 48, 1, 1, 0),    # 1x1: XLA's convolution
    (32, 4, 1, 1, 0),    # 1x1 over 4 channels, the VAE's post_quant_conv: a matmul on the CPU
])
def test_conv_matches_torch(size, channels, kernel, stride, padding):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, size, size, channels), dtype=np.float32)
    module = conv(32, kernel=kernel, stride=stride, padding=padding)
    params = module.init(jax.random.key(0), x)
    params = jax.tree.map(lambda p: p + 0.1 * rng.standard_normal(p.shape, dtype=np.float32), params)  # bias != 0
    ours = jax.jit(module.apply)(params, x)

    weight = torch.from_numpy(np.array(params["params"]["kernel"])).permute(3, 2, 0, 1)
    bias = torch.from_numpy(np.array(params["params"]["bias"]))
    theirs = torch.nn.functional.conv2d(torch.from_numpy(x).permute(0, 3, 1, 2), weight, bias, stride, padding)
    np.testing.assert_allclose(np.asarray(ours), theirs.permute(0, 2, 3, 1).numpy(), rtol=RTOL, atol=ATOL)

    out_pixels = ours.shape[1] * ours.shape[2]  # per image: the batch does not change the path
    as_matmul = "convolution(" not in compiled_text(module.apply, params, x)
    if kernel == 1:
        assert as_matmul == (channels <= layers.CPU_NARROW_1X1_CHANNELS)
    else:
        assert as_matmul == (out_pixels <= layers.CPU_PATCH_MATMUL_PIXELS
                             and channels >= layers.CPU_PATCH_MATMUL_MIN_CHANNELS)


def test_bfloat16_conv_and_attention_stay_in_bfloat16():
    x = jnp.ones((1, 8, 8, 16), jnp.bfloat16)
    module = conv(8, dtype=jnp.bfloat16)
    params = module.init(jax.random.key(0), x)
    assert module.apply(params, x).dtype == jnp.bfloat16
    q = jnp.ones((1, 300, 2, 8), jnp.bfloat16)
    assert dot_product_attention(q, q, q).dtype == jnp.bfloat16


def test_auto_attention_picks_cudnn_only_where_it_runs():
    from types import SimpleNamespace as Device

    hopper, ampere = Device(platform="gpu", compute_capability="9.0"), Device(platform="gpu", compute_capability="8.0")
    choose = layers.attention_for
    assert [choose(d, jnp.bfloat16, hopper) for d in (40, 80, 160)] == ["cudnn"] * 3  # SD 1.5 on an H100
    assert [choose(d, jnp.float16, ampere) for d in (40, 80, 160)] == ["cudnn", "cudnn", "xla"]
    assert choose(64, jnp.float32, hopper) == "xla"  # flash attention is half precision only
    assert choose(512, jnp.bfloat16, hopper) == "xla"  # the VAE's single 512-wide head
    assert choose(36, jnp.bfloat16, hopper) == "xla"  # not a multiple of 8
    assert choose(64, jnp.bfloat16, Device(platform="gpu")) == "xla"  # a GPU without a compute capability: ROCm
    assert choose(64, jnp.bfloat16, Device(platform="cpu")) == "xla"


def test_attention_implementation_is_checked():
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"one of \('auto', 'xla', 'cudnn', 'pallas'\), got 'flash'"):
        dot_product_attention(q, q, q, kernels=layers.resolve_kernels("flash"))
    with pytest.raises(ValueError, match="cuDNN flash attention does not run on .* with float32 and head dim 8"):
        dot_product_attention(q, q, q, kernels=layers.resolve_kernels("cudnn"))


def test_kernels_are_resolved_once_into_one_hashable_value():
    from types import SimpleNamespace as Device

    hopper = layers.resolve_kernels(device=Device(platform="gpu", compute_capability="9.0"))
    assert hopper == layers.Kernels("gpu", "9.0", "auto") and hash(hopper) == hash(layers.Kernels("gpu", "9.0"))
    assert layers.resolve_kernels("xla") == layers.Kernels(jax.devices()[0].platform, None, "xla")
    assert hopper.attention_kernel(80, jnp.bfloat16) == "cudnn"
    assert dataclasses.replace(hopper, attention="xla").attention_kernel(80, jnp.bfloat16) == "xla"
    with pytest.raises(ValueError, match="attention='cudnn': cuDNN flash attention does not run on gpu with float32"):
        dataclasses.replace(hopper, attention="cudnn").attention_kernel(80, jnp.float32)
    with pytest.raises(ValueError, match=r"one of \('auto', 'xla', 'cudnn', 'pallas'\), got 'flash'"):
        layers.Kernels("cpu", attention="flash")


def test_the_kernels_platform_picks_the_paths():
    """The CPU's attention loop and patch matmul follow the Kernels value, not the compiling device: a GPU's choice
    compiled here has neither, and gives the same numbers."""
    gpu = layers.Kernels("gpu", "9.0")  # float32: XLA's attention, in one piece
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1100, 2, 16), dtype=np.float32) for _ in range(3))  # 9.7 MB of logits
    on_gpu = functools.partial(dot_product_attention, kernels=gpu)
    assert "while" not in compiled_text(on_gpu, q, k, v) and "while" in compiled_text(dot_product_attention, q, k, v)
    np.testing.assert_allclose(jax.jit(on_gpu)(q, k, v), jax.jit(dot_product_attention)(q, k, v), rtol=RTOL, atol=ATOL)

    x = rng.standard_normal((2, 8, 8, 256), dtype=np.float32)  # small and wide: a patch matmul on the CPU
    here, there = conv(32), conv(32, kernels=gpu)
    params = here.init(jax.random.key(0), x)
    assert "convolution(" not in compiled_text(here.apply, params, x)
    assert "convolution(" in compiled_text(there.apply, params, x)
    np.testing.assert_allclose(jax.jit(there.apply)(params, x), jax.jit(here.apply)(params, x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("leaf", [("conv_in", "kernel"), ("time_embedding_linear_1", "kernel"),
                                  ("conv_norm_out", "scale")])
def test_a_parameter_of_the_wrong_shape_is_refused_at_apply(leaf):
    """Layers check existing params against a shape-only initializer (`ReadsParams`): still Flax's shape error."""
    import flax
    from builders import REPO

    from sdflax.models import UNet2DConditionModel
    from sdflax.models.config import read_config_file

    unet = UNet2DConditionModel.from_config(read_config_file(REPO / "weights" / "tiny-sd" / "unet" / "config.json"))
    params = jax.tree.map(jnp.zeros_like, unet.param_shapes())
    args = (jnp.ones((1, 4, 32, 32)), jnp.float32(1), jnp.ones((1, 77, 32)))
    assert unet.apply(params, *args).shape == (1, 4, 32, 32)
    module, name = leaf
    wrong = params[module][name]
    params[module][name] = jnp.zeros((*wrong.shape[:-1], wrong.shape[-1] + 1))
    with pytest.raises(flax.errors.ScopeParamShapeError, match=f'"{name}" in "/{module}"'):
        unet.apply(params, *args)


def test_pipeline_programs_leave_cpu_convolutions_to_xla():
    """`runner.compiler_options` keeps the CPU's convolutions out of YNNPACK (docs/performance.md): compiled with
    them a convolution is XLA's own, without them this jaxlib hands it to YNNPACK."""
    from sdflax.pipeline.runner import compiler_options

    x = np.random.default_rng(0).standard_normal((2, 32, 32, 32), dtype=np.float32)
    layer = conv(32)
    params = layer.init(jax.random.key(0), x)
    ours, default = (jax.jit(layer.apply, compiler_options=options).lower(params, x).compile().as_text()
                     for options in (compiler_options(), None))
    assert "ynn_fusion" in default and "ynn_fusion" not in ours and " convolution(" in ours


@pytest.mark.parametrize("xla_flags, expected", [
    ("", {"xla_backend_optimization_level": 1, "xla_cpu_experimental_ynn_fusion_type":
          "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"}),
    ("--xla_cpu_experimental_ynn_fusion_type=individual_dot,individual_convolution",
     {"xla_backend_optimization_level": 1}),
])
def test_compiler_options_leave_what_xla_flags_set_to_the_user(xla_flags, expected):
    """An option named in XLA_FLAGS is the user's (docs/batch.md, "One image, any batch"), fresh process each."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags}
    out = subprocess.run([sys.executable, "-c", "import json; from sdflax.pipeline.runner import compiler_options; "
                          "print(json.dumps(compiler_options()))"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == expected


def test_on_a_tpu_the_pallas_kernel_takes_the_layers_its_blocks_fit():
    """TPU: Pallas flash attention where the query and key token counts are multiples of its 128-token blocks (SD's
    self-attention at 4096, 1024 and 256 tokens), XLA for the 77-token cross-attention, the 64-token mid block and
    the causal text encoder; a forced 'pallas' off a TPU, or in float16, is an error."""
    tpu = layers.Kernels("tpu")
    kernel = tpu.attention_kernel
    assert [kernel(d, jnp.bfloat16, t, t) for d, t in ((40, 4096), (80, 1024), (160, 256))] == ["pallas"] * 3
    assert kernel(40, jnp.bfloat16, 4096, 77) == "xla" and kernel(160, jnp.bfloat16, 64, 64) == "xla"
    assert kernel(64, jnp.bfloat16) == "xla"  # no token counts: the causal text encoder
    assert kernel(40, jnp.float32, 4096, 4096) == "pallas" and kernel(40, jnp.float16, 4096, 4096) == "xla"
    assert dataclasses.replace(tpu, attention="xla").attention_kernel(40, jnp.bfloat16, 4096, 4096) == "xla"
    forced = dataclasses.replace(tpu, attention="pallas")
    assert forced.attention_kernel(40, jnp.bfloat16, 4096, 77) == "xla"  # forced: where its blocks fit
    with pytest.raises(ValueError, match="attention='pallas': the Pallas flash attention kernel does not run on tpu "
                                         "with float16"):
        forced.attention_kernel(40, jnp.float16, 4096, 4096)
    with pytest.raises(ValueError, match="does not run on gpu with bfloat16; it needs a TPU"):
        layers.Kernels("gpu", "9.0", "pallas").attention_kernel(40, jnp.bfloat16, 4096, 4096)
    assert layers.Kernels("gpu", "9.0").attention_kernel(40, jnp.bfloat16, 4096, 4096) == "cudnn"


def test_the_pallas_path_pads_the_head_dim_and_equals_attention(monkeypatch):
    """The Pallas path's own arithmetic (layout, the head dim zero-padded to 128 lanes, the scale of the true head
    dim), with a plain attention in place of the TPU kernel, which runs only on a TPU."""
    calls = []

    def reference_kernel(q, k, v, sm_scale):  # (B, heads, T, d), as the Pallas kernel takes them
        calls.append((q.shape, sm_scale))
        weights = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k) * sm_scale, axis=-1)
        return jnp.einsum("bhqk,bhkd->bhqd", weights, v)

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 256, 3, 40), dtype=np.float32)) for _ in range(3))
    out = layers.pallas_attention(q, k, v, kernel=reference_kernel)
    expected = dot_product_attention(q, k, v, kernels=layers.Kernels("gpu"))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert calls == [((2, 3, 256, 128), 1 / np.sqrt(40))]
    pallas_attention = layers.pallas_attention
    monkeypatch.setattr(layers, "pallas_attention", lambda q, k, v: pallas_attention(q, k, v, reference_kernel))
    np.testing.assert_allclose(dot_product_attention(q, k, v, kernels=layers.Kernels("tpu")), expected, rtol=1e-5,
                               atol=1e-6)
    assert len(calls) == 2  # dot_product_attention took the Pallas path on a TPU's Kernels


def test_the_pallas_kernel_lowers_for_a_tpu_here():
    """The real kernel, lowered for a TPU on this machine (XLA's cross-platform lowering): SD 1.5's first
    self-attention (4096 tokens, head dim 40, padded to 128) becomes the TPU kernel's custom call; its
    cross-attention stays XLA's."""
    tpu = layers.Kernels("tpu")

    def lowered(t, s):
        q, kv = jax.ShapeDtypeStruct((2, t, 8, 40), jnp.bfloat16), jax.ShapeDtypeStruct((2, s, 8, 40), jnp.bfloat16)
        f = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, kernels=tpu))
        return f.trace(q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()

    assert "tpu_custom_call" in lowered(4096, 4096)
    assert "tpu_custom_call" not in lowered(4096, 77)
