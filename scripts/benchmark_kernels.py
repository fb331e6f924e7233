"""Time the kernels behind sdflax's CPU paths against their alternatives and PyTorch, at SD 1.5's shapes.

    python scripts/benchmark_kernels.py                  # attention and convolutions (about a minute on 2 cores)
    python scripts/benchmark_kernels.py --unet 32        # also one guided UNet evaluation on 32x32 latents (256 px)

Milliseconds, median of --repeats calls each, as one JSON object:
- attention: sdflax's `dot_product_attention` (one (image, head) pair at a time, in blocks of queries, where an
  image's logits exceed CPU_ATTENTION_BLOCK_BYTES), its XLA path in one piece, jax.nn.dot_product_attention, and
  torch's scaled_dot_product_attention;
- conv: sdflax's 3x3 conv (a patch matmul up to CPU_PATCH_MATMUL_PIXELS output pixels an image from
  CPU_PATCH_MATMUL_MIN_CHANNELS input channels), XLA's
  convolution, the patch matmul at every size, and torch's conv2d;
- unet (with --unet N): sdflax's and diffusers' SD 1.5 UNet on a guidance batch of 2, random weights.
Each row has `ratio`: sdflax over torch. Every JAX kernel is compiled with the pipelines' XLA options
(`runner.compiler_options`).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sdflax.models import layers  # noqa: E402
from sdflax.pipeline.runner import compiler_options  # noqa: E402

ATTENTION_SHAPES = [(2, 1024, 1024, 8, 40), (2, 1024, 77, 8, 40), (2, 4096, 4096, 8, 40)]  # B, T, S, heads, dim
CONV_SHAPES = [(2, 4, 4, 2560, 1280), (2, 8, 8, 2560, 1280), (2, 8, 8, 128, 128), (2, 16, 16, 640, 640),
               (8, 16, 16, 640, 640), (2, 32, 32, 320, 320), (1, 64, 64, 512, 512)]  # B, H, W, in, out


def require_torch():
    """PyTorch, the comparison's other side; without it one line and status 2 (--help needs none)."""
    try:
        import torch
    except ImportError as e:
        print(f"benchmark_kernels: error: the comparison needs PyTorch ({e}): pip install torch==2.13.0",
              file=sys.stderr)
        raise SystemExit(2) from None
    return torch


def milliseconds(fn, repeats):
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 4)


def jax_ms(fn, args, repeats):
    compiled = jax.jit(fn, compiler_options=compiler_options()).lower(*args).compile()  # as the pipelines do
    return milliseconds(lambda: jax.block_until_ready(compiled(*args)), repeats)


def attention_rows(shapes, repeats):
    import torch

    rows = []
    for b, t, s, h, d in shapes:
        rng = np.random.default_rng(0)
        q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in [(b, t, h, d), (b, s, h, d),
                                                                                      (b, s, h, d)])
        attend = functools.partial(layers._attention, causal=False, dtype=jnp.float32)
        row = {"shape": [b, t, s, h, d],
               "sdflax": jax_ms(layers.dot_product_attention, (q, k, v), repeats),
               "sdflax_one_piece": jax_ms(lambda q, k, v: attend(q / np.float32(np.sqrt(d)), k, v), (q, k, v),
                                          repeats),
               "jax_nn_dot_product_attention": jax_ms(jax.nn.dot_product_attention, (q, k, v), repeats)}
        tq, tk, tv = (torch.from_numpy(np.array(x)).transpose(1, 2) for x in (q, k, v))
        with torch.no_grad():
            row["torch_sdpa"] = milliseconds(lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv),
                                             repeats)
        rows.append({**row, "loops": h * t * s * 4 > layers.CPU_ATTENTION_BLOCK_BYTES,
                     "ratio": round(row["sdflax"] / row["torch_sdpa"], 3)})
    return rows


def patch_matmul_conv(module, params, x):
    """sdflax's conv forced onto its patch-matmul path, whatever the size (the rule is read when tracing)."""
    saved = layers.CPU_PATCH_MATMUL_PIXELS, layers.CPU_PATCH_MATMUL_MIN_CHANNELS
    layers.CPU_PATCH_MATMUL_PIXELS, layers.CPU_PATCH_MATMUL_MIN_CHANNELS = float("inf"), 0
    try:
        return module.apply(params, x)
    finally:
        layers.CPU_PATCH_MATMUL_PIXELS, layers.CPU_PATCH_MATMUL_MIN_CHANNELS = saved


def conv_rows(shapes, repeats):
    import torch

    rows = []
    for b, hgt, wid, c_in, c_out in shapes:
        x = jnp.asarray(np.random.default_rng(0).standard_normal((b, hgt, wid, c_in), np.float32))
        module = layers.conv(c_out)
        params = module.init(jax.random.key(0), x[:1])
        kernel, bias = params["params"]["kernel"], params["params"]["bias"]

        def xla_conv(x, kernel, bias):
            return jax.lax.conv_general_dilated(x, kernel, (1, 1), ((1, 1), (1, 1)),
                                                dimension_numbers=("NHWC", "HWIO", "NHWC")) + bias

        row = {"shape": [b, hgt, wid, c_in, c_out], "sdflax": jax_ms(module.apply, (params, x), repeats),
               "xla_conv": jax_ms(xla_conv, (x, kernel, bias), repeats),
               "patch_matmul_ms": jax_ms(functools.partial(patch_matmul_conv, module), (params, x), repeats)}
        tx = torch.from_numpy(np.array(x)).permute(0, 3, 1, 2).contiguous()
        tw = torch.from_numpy(np.array(kernel)).permute(3, 2, 0, 1).contiguous()
        tb = torch.from_numpy(np.array(bias))
        with torch.no_grad():
            row["torch_conv2d"] = milliseconds(lambda: torch.nn.functional.conv2d(tx, tw, tb, padding=1), repeats)
        rows.append({**row, "patch_matmul": layers.patch_matmul_pays(hgt * wid, c_in, 3),
                     "ratio": round(row["sdflax"] / row["torch_conv2d"], 3)})
    return rows


def unet_row(latent_size, repeats):
    import diffusers
    import torch
    from benchmark import SD15, random_params

    from sdflax.models import UNet2DConditionModel

    module = UNet2DConditionModel.from_config(SD15["unet"], jnp.float32)
    params = random_params(module, 0, jnp.float32)
    sample = np.ones((2, 4, latent_size, latent_size), np.float32)
    timesteps, context = np.array([500, 500]), np.ones((2, 77, 768), np.float32)
    row = {"latents": [2, 4, latent_size, latent_size],
           "sdflax": jax_ms(module.apply, (params, sample, timesteps, context), repeats)}
    del params
    theirs = diffusers.UNet2DConditionModel(**SD15["unet"]).eval()
    with torch.no_grad():
        row["diffusers"] = milliseconds(lambda: theirs(*map(torch.from_numpy, (sample, timesteps, context))),
                                        repeats)
    return {**row, "ratio": round(row["sdflax"] / row["diffusers"], 3)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per kernel (default: 5)")
    parser.add_argument("--unet", type=int, metavar="N", help="also time the SD 1.5 UNet on NxN latents")
    parser.add_argument("--small", action="store_true", help="tiny shapes only: a quick check that it runs")
    args = parser.parse_args(argv)
    torch = require_torch()
    attention, convs = ATTENTION_SHAPES, CONV_SHAPES
    if args.small:
        attention, convs = [(1, 1100, 1100, 2, 8), (1, 64, 77, 2, 8)], [(1, 8, 8, 256, 8), (2, 32, 32, 8, 8)]
    report = {"device": str(jax.devices()[0]), "torch_threads": torch.get_num_threads(),
              "compiler_options": compiler_options(),
              "cpu_attention_block_bytes": layers.CPU_ATTENTION_BLOCK_BYTES,
              "cpu_patch_matmul_pixels": layers.CPU_PATCH_MATMUL_PIXELS,
              "cpu_patch_matmul_min_channels": layers.CPU_PATCH_MATMUL_MIN_CHANNELS,
              "attention": attention_rows(attention, args.repeats), "conv": conv_rows(convs, args.repeats)}
    if args.unet:
        report["unet"] = unet_row(args.unet, args.repeats)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
