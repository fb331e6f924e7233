"""The accelerator run in one command: sdflax against diffusers (PyTorch) on the device it finds, as one JSON.

On a GPU machine without internet access, from the repository root, with the two wheels such machines' images
lack in `.whl/` (downloaded where pip works: `pip download --no-deps --only-binary=:all: --python-version 3.12
--implementation cp --platform manylinux2014_x86_64 -d .whl diffusers==0.39.0 importlib_metadata==10.2.0`):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/sdflax .
    PYTHONPATH=/tmp/site:/tmp/sdflax python3 scripts/accelerator_report.py --out report.json --deadline-s 525

It needs jax (CUDA), flax, tokenizers, huggingface_hub, torch (CUDA) and transformers there; sdflax comes from the
working tree, installed with its dependencies left alone. The whole run (`--part all`) takes about 15 minutes of
an H200's time before SD 3.5 Medium's two jobs, which come last (a deadline may drop them: `--part sd35` runs them
alone); each part (`--part correctness|sd15|sdxl|sd35|compile|flags|train`) fits a 10-minute command, `--family
sd15|sdxl|sd35` keeps one family's jobs of a part, `--batch N` its speed jobs at batch N, and `--deadline-s` stops
launching jobs once that many seconds have passed (and stops a running one there), so a run never outlasts its
time limit. The report is rewritten after every job: a run cut short keeps what it finished.

On a TPU VM (`pip install "jax[tpu]" flax tokenizers huggingface_hub ml_dtypes pillow tqdm diffusers==0.39.0
transformers torch --extra-index-url https://download.pytorch.org/whl/cpu`, then the command above without
PYTHONPATH's /tmp/site): sdflax runs in bfloat16 with the Pallas flash attention kernel where its 128-token
blocks fit (`Kernels.pallas_runs`), correctness compares it with PyTorch on the host's CPU, and the diffusers speed
jobs are skipped (PyTorch has no TPU without torch_xla), so the speed rows are sdflax's alone.

On the CPU (`--size tiny`, the default there) the same code runs on small models of the same architectures, one
job per code path; tests/test_accelerator_report.py does that daily, so the GPU path's code runs up to the device
calls. There the jobs that do not time their own start-up are forked from the parent, which imports the libraries
once (the tiny models cost less than importing torch and diffusers in every job), and two jobs run at once, each
after the jobs whose files it reads; an accelerator's jobs run one at a time, in order, so that none times another.

What it measures. Random weights everywhere: the compute of the real checkpoints, no download.
- `correctness`, for the SD 1.5 and SDXL architectures (one fresh process each): the UNet, the VAE decoder and the
  text encoder(s) against diffusers/transformers on the same device and inputs. float32 with
  `jax_default_matmul_precision="highest"` and PyTorch's TF32 off; bfloat16 against diffusers' bfloat16 and both
  against float32; the relative L2 error ‖ours − theirs‖ / ‖theirs‖ of each, against a stated bound (`ok`), and
  whether the output is finite and not constant. `attention`: each attention shape of the UNet at bfloat16, which
  kernel sdflax picks on this device (`Kernels.attention_kernel`) and XLA's, cuDNN's (NVIDIA) and Pallas's (TPU)
  results against float64.
- `speed`, each job in its own fresh process: sdflax (`auto`: cuDNN attention where it runs, or `xla`) and diffusers
  (SDPA, float16; `+compile`: its UNet through `torch.compile`) at the issue's settings (SD 1.5 512x512 50 PNDM
  steps, SDXL 1024x1024 30 Euler steps, the MLPerf setting: SDXL 1024x1024, 20 Euler steps, guidance 8, batch 8;
  SD 3.5 Medium 1024x1024, 28 flow-matching Euler steps, guidance 7.0, T5-XXL's 256 tokens, batch 1).
  Per batch size: the first call (compiling included), the median of `--repeats` timed calls with their range,
  seconds per image, images per second, peak device memory, FLOPs per image from XLA's cost analysis (UNet
  evaluations (SD 3.5: its transformer's, under the same keys) and the VAE decode; the same count is used for
  diffusers) and the achieved TFLOP/s; the flops job also traces and lowers the setting's whole program from
  the param shapes (`program`: the host's seconds of a cold compile, the size of the StableHLO module).
  Per process: `ready_s`, from the process's start to the first program compiled and run once (a cold compile
  cache, then a warm one); `import_s`, `build_s`. The cold- and warm-cache jobs load their weights as a user does
  (`from_pretrained`) from an SD 1.5 checkpoint that the run writes first with diffusers' `save_pretrained`
  (float32 safetensors, as on the hub: 4.3 GB, read from the page cache); the other jobs draw random weights.
  Each sdflax job ends with one more call of its last batch under JAX's profiler (`profile`): its kernels' device
  seconds in all, by category (attention, convolution, matmul, memory, XLA's other fusions) and the top kernels.
  `--part flags` times SD 1.5 at batch 1 and the MLPerf setting under XLA's defaults and each of `XLA_FLAG_SETS`,
  the measurement behind sdflax setting no XLA flags; each run's `compile_s` is a cold compile (no cache), so
  `--part flags --family sdxl` (the MLPerf setting alone, the compile-time sets first; about 2 minutes a job on an
  H100) says what the autotuning and Triton GEMM flags save of SDXL's compile and cost of its speed.
- `compile_split` (`--part compile --family sdxl` alone): the MLPerf setting's models (the UNet's one evaluation on
  the guidance batch, the VAE decode, each text encoder) each lowered and compiled cold on the device from the
  param shapes: which model's compile the speed job's `compile_s` is made of. Then what scanning over the repeated
  layers (one loop body instead of SDXL's stacks of ten, CLIP-G's 32 layers) would save of it: the UNet and the
  text encoders with each stack cut to one layer (`one_layer`, a bound), the UNet with each stack one `lax.scan`
  over its layers' stacked params (`scanned`), and both UNets run on the same random weights (`unet_runs`): what
  scanning would cost of the speed, and the scanned output against the plain one.
- `training` (`--part train`; last in `all`): a LoRA update (rank 4 on the UNet's attention projections, cached
  latents, the text encoders run in the step, bfloat16 compute with the LoRA and Adam in float32) of
  `sdflax.train` against diffusers' LoRA scripts' update with PEFT (`train_text_to_image_lora.py`, its SDXL twin),
  each in its own process: SD 1.5 at 512² batch 8 and SDXL at 1024² batch 2. The first step (compiling included),
  the median of `--repeats` steps with their range, steps and images per second, peak device memory, and both
  against diffusers'. diffusers' side needs peft: add `peft==0.21.2 accelerate==1.15.0 psutil pyyaml` to the
  wheels downloaded above where the image lacks them.
- `provenance`: the devices, the driver, package versions, the command, the commit (`--commit`, else git's).
- `table`: the speed rows as Markdown, for the README's GPU table.

JSON schema (version 1): {"schema": 1, "provenance": {...}, "correctness": {family: {"float32": {model: check},
"bfloat16": {model: check}, "attention": [layer, ...], "unet_attention": {"auto": check, "xla": check}}}, "speed":
{"runs": [run, ...], "flops": [count, ...], "compile_split": [split, ...], "checkpoint": {"family", "bytes",
"wall_s"}}, "training": [run, ...], "table": str, "errors": [str, ...]} ("checkpoint" where a job loads one); a
check is {"rel_l2", "max_abs", "bound", "ok", "finite", "constant"}; a run is the job's settings and {"wall_s",
"ready_s", "results": [{"batch", "seconds_per_call", ..., "tflops_per_s"}]} (an sdflax run also {"profile":
{"batch", "wall_s", "device_busy_s", "kernel_launches", "categories_s": {...}, "top": [{"name", "hlo_op", "count",
"seconds"}, ...]}}, or {"profile": {"batch", "error"}}); a count is a setting and {"flops_per_image", ...,
"program": {"batch", "trace_s", "lower_s", "stablehlo_bytes", "stablehlo_lines"}}; a split is a setting and
{"batch", "dtype", "device", "models": {model: times}, "one_layer": {model: times}, "scanned": {"unet": times},
"unet_runs": {"plain": run, "scanned": run, "scanned_rel_l2", "output_std"}}, times being {"lower_s", "compile_s",
"stablehlo_lines"} and a UNet run {"first_call_s", "seconds_per_call", "seconds_per_call_min",
"seconds_per_call_max"}. A training run is the job ({"framework", "family", "batches", "rank", "mixed_precision"})
and {"import_s", "build_s", "dtype", "device", "wall_s", "results": [{"batch", "first_step_s", "seconds_per_step",
"seconds_per_step_min", "seconds_per_step_max", "steps_per_s", "images_per_s", "peak_memory_bytes",
"speedup_vs_diffusers", "memory_vs_diffusers"}]}.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_START = time.perf_counter()
_JOB_START = _START  # what a job's `import_s` and `ready_s` count from: its process's start, or its fork's
REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "weights" / "tiny-sd" / "tokenizer"  # the real CLIP BPE vocabulary
PROMPT = "a photo of an astronaut riding a horse on mars"
SCHEMA = 1

# stable-diffusion-v1-5 and stable-diffusion-xl-base-1.0's config.json files, as published (the keys that matter).
SCHEDULER = {"beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
             "num_train_timesteps": 1000, "set_alpha_to_one": False, "steps_offset": 1}
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "hidden_act": "quick_gelu", "projection_dim": 768, "vocab_size": 49408, "max_position_embeddings": 77,
          "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1, "layer_norm_eps": 1e-5}
VAE = {"act_fn": "silu", "block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
       "in_channels": 3, "latent_channels": 4, "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 3,
       "up_block_types": ["UpDecoderBlock2D"] * 4}
FULL = {
    "sd15": {
        "unet": {"attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280], "cross_attention_dim": 768,
                 "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"], "layers_per_block": 2,
                 "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, "norm_num_groups": 32,
                 "sample_size": 64},
        "vae": {**VAE, "sample_size": 512},
        "text_encoder": CLIP_L,
        "scheduler": {**SCHEDULER, "_class_name": "PNDMScheduler", "skip_prk_steps": True},
        "size": 512,
    },
    "sdxl": {
        "unet": {"addition_embed_type": "text_time", "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20],
                 "block_out_channels": [320, 640, 1280], "cross_attention_dim": 2048,
                 "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                 "layers_per_block": 2, "norm_num_groups": 32, "projection_class_embeddings_input_dim": 2816,
                 "sample_size": 128, "transformer_layers_per_block": [1, 2, 10],
                 "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                 "use_linear_projection": True},
        "vae": {**VAE, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True},
        "text_encoder": CLIP_L,
        "text_encoder_2": {**CLIP_L, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                           "num_attention_heads": 20, "hidden_act": "gelu", "projection_dim": 1280},
        "scheduler": {**SCHEDULER, "_class_name": "EulerDiscreteScheduler", "timestep_spacing": "leading",
                      "interpolation_type": "linear"},
        "size": 1024,
    },
    # stable-diffusion-3.5-medium: MMDiT-X (dual attention in its first 13 blocks), CLIP-L, CLIP-G and T5-XXL
    "sd35": {
        "transformer": {"attention_head_dim": 64, "caption_projection_dim": 1536,
                        "dual_attention_layers": list(range(13)), "in_channels": 16, "joint_attention_dim": 4096,
                        "num_attention_heads": 24, "num_layers": 24, "out_channels": 16, "patch_size": 2,
                        "pooled_projection_dim": 2048, "pos_embed_max_size": 384, "qk_norm": "rms_norm",
                        "sample_size": 128},
        "vae": {**VAE, "latent_channels": 16, "sample_size": 1024, "scaling_factor": 1.5305, "shift_factor": 0.0609,
                "force_upcast": True, "use_quant_conv": False, "use_post_quant_conv": False},
        "text_encoder": CLIP_L,
        "text_encoder_2": {**CLIP_L, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                           "num_attention_heads": 20, "hidden_act": "gelu", "projection_dim": 1280},
        "text_encoder_3": {"d_ff": 10240, "d_kv": 64, "d_model": 4096, "feed_forward_proj": "gated-gelu",
                           "num_heads": 64, "num_layers": 24, "vocab_size": 32128},
        "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0},
        "size": 1024,
    },
}
# The same block structure with few channels and layers, for the CPU run.
TINY_CLIP = {**CLIP_L, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
             "projection_dim": 32}
TINY_VAE = {**VAE, "block_out_channels": [8, 8, 16, 16], "layers_per_block": 1, "norm_num_groups": 4}
TINY = {
    "sd15": {**FULL["sd15"], "unet": {**FULL["sd15"]["unet"], "block_out_channels": [16, 16, 32, 32],
                                      "cross_attention_dim": 32, "layers_per_block": 1, "norm_num_groups": 8,
                                      "sample_size": 8},
             "vae": {**TINY_VAE, "sample_size": 64}, "text_encoder": TINY_CLIP, "size": 64},
    "sdxl": {**FULL["sdxl"], "unet": {**FULL["sdxl"]["unet"], "block_out_channels": [16, 32, 32],
                                      "attention_head_dim": [1, 2, 4], "transformer_layers_per_block": [1, 1, 2],
                                      "cross_attention_dim": 64, "addition_time_embed_dim": 8,
                                      "projection_class_embeddings_input_dim": 32 + 6 * 8, "norm_num_groups": 8,
                                      "layers_per_block": 1, "sample_size": 8},
             "vae": {**TINY_VAE, "sample_size": 64, "scaling_factor": 0.13025, "force_upcast": True},
             "text_encoder": TINY_CLIP, "text_encoder_2": {**TINY_CLIP, "hidden_act": "gelu"}, "size": 64},
    "sd35": {**FULL["sd35"], "transformer": {**FULL["sd35"]["transformer"], "attention_head_dim": 8,
                                             "caption_projection_dim": 32, "dual_attention_layers": [0],
                                             "joint_attention_dim": 64, "num_attention_heads": 4, "num_layers": 2,
                                             "pooled_projection_dim": 32 + 32, "pos_embed_max_size": 16,
                                             "sample_size": 8},
             "vae": {**TINY_VAE, **{k: FULL["sd35"]["vae"][k] for k in ("latent_channels", "scaling_factor",
                                                                          "shift_factor", "use_quant_conv",
                                                                          "use_post_quant_conv")},
                     "sample_size": 64},
             "text_encoder": TINY_CLIP, "text_encoder_2": {**TINY_CLIP, "hidden_act": "gelu"},
             "text_encoder_3": {**FULL["sd35"]["text_encoder_3"], "d_ff": 48, "d_kv": 8, "d_model": 64,
                                "num_heads": 4, "num_layers": 2, "vocab_size": 64},
             "size": 64},
}
SIZES = {"full": FULL, "tiny": TINY}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")

# Bounds of the relative L2 error. float32: the modules' test tolerance. bfloat16: ours against float32 may be
# off by at most twice diffusers' own bfloat16 error against float32, or 1e-2, whichever is larger.
FLOAT32_BOUND = 1e-4
# XLA GPU flag sets measured against XLA's defaults (part "flags"), to choose which the runner should set: for
# speed, and for the cold compile (no autotuning, which bounds what autotuning costs; cuBLAS for every GEMM instead
# of a search over Triton tilings, which splits that cost between GEMMs and the rest; autotuning without its buffer
# re-initialisation and result checks), most telling first.
XLA_FLAG_SETS = {
    "latency_hiding": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "no_command_buffer": "--xla_gpu_enable_command_buffer=",
    "command_buffer_while": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,"
                            "CONDITIONAL",
    "autotune_0": "--xla_gpu_autotune_level=0",
    "autotune_1": "--xla_gpu_autotune_level=1",
    "no_triton_gemm": "--xla_gpu_enable_triton_gemm=false",
}
COMPILE_FLAG_SETS = ("autotune_0", "no_triton_gemm", "autotune_1")
BFLOAT16_FLOOR = 1e-2
TRAIN_RANK = 4  # diffusers' LoRA scripts' default --rank


def log(message):
    print(f"[{time.perf_counter() - _START:6.1f} s] {message}", file=sys.stderr, flush=True)


# ---- the jobs ---------------------------------------------------------------------------------------------------

def settings(family, size):
    """The issue's settings for `family`: steps, guidance and the scheduler, (fewer steps for the tiny models)."""
    steps = {"sd15": 50, "sdxl": 30, "sd35": 28}[family] if size == "full" else 2
    return {"family": family, "steps": steps, "guidance": {"sd15": 7.5, "sdxl": 5.0, "sd35": 7.0}[family],
            "scheduler": None}


def jobs(part: str, size: str, family: str | None = None, batch: int | None = None) -> list[dict]:
    """The jobs of a part (of one family's models where `family` is given; of the speed jobs timing that batch
    size where `batch` is), most wanted first (a deadline drops the last)."""
    full = size == "full"
    big = [1, 8] if full else [1, 2]
    sd15, sdxl, sd35 = settings("sd15", size), settings("sdxl", size), settings("sd35", size)
    mlperf = {**sdxl, "steps": 20 if full else 2, "guidance": 8.0, "scheduler": "euler", "setting": "mlperf"}
    speed = lambda framework, s, batches, **extra: {"kind": "speed", "framework": framework, **s,  # noqa: E731
                                                    "batches": batches, **extra}
    train = lambda framework, family: {"kind": "train", "framework": framework, "family": family,  # noqa: E731
                                       "batches": [{"sd15": 8, "sdxl": 2}[family] if full else 2],
                                       "rank": TRAIN_RANK, "mixed_precision": "bf16"}
    table = {
        "correctness": [{"kind": "correctness", "family": "sd15"}, {"kind": "correctness", "family": "sdxl"}],
        "sd15": [speed("sdflax", sd15, big, attention="auto", cache="cold", weights="checkpoint"),
                 speed("diffusers", sd15, big),
                 speed("sdflax", sd15, [1], attention="auto", cache="warm", weights="checkpoint"),
                 speed("diffusers+compile", sd15, [1]),
                 speed("sdflax", sd15, [1], attention="xla", cache="none"),
                 speed("sdflax", sd15, [4], attention="auto", cache="none"),
                 speed("diffusers", sd15, [4])],
        # the second half of sd15's: a warm cache after a cold one, torch.compile and XLA's attention
        "compile": [speed("sdflax", sd15, [1], attention="auto", cache="cold", weights="checkpoint"),
                    speed("sdflax", sd15, [1], attention="auto", cache="warm", weights="checkpoint"),
                    speed("diffusers+compile", sd15, [1]),
                    speed("sdflax", sd15, [1], attention="xla", cache="none"),
                    # the longest cold compile, model by model
                    {"kind": "compile_split", **mlperf, "batches": [8] if full else [2]}],
        # XLA's defaults, then each flag set: where launches weigh most (SD 1.5, batch 1), and at MLPerf's setting,
        # whose compile is the longest (the compile-time sets first)
        "flags": [speed("sdflax", sd15, [1], attention="auto", cache="none"),
                  *(speed("sdflax", sd15, [1], attention="auto", cache="none", xla_flags=name)
                    for name in XLA_FLAG_SETS),
                  speed("sdflax", mlperf, [8] if full else [2], attention="auto", cache="none"),
                  *(speed("sdflax", mlperf, [8] if full else [2], attention="auto", cache="none", xla_flags=name)
                    for name in (*COMPILE_FLAG_SETS, *(n for n in XLA_FLAG_SETS if n not in COMPILE_FLAG_SETS)))],
        "sdxl": [speed("sdflax", sdxl, [1], attention="auto", cache="none"),
                 speed("sdflax", mlperf, [8] if full else [2], attention="auto", cache="none"),
                 speed("diffusers", sdxl, [1]),
                 speed("diffusers", mlperf, [8] if full else [2])],
        "sd35": [speed("sdflax", sd35, [1], attention="auto", cache="none"),
                 speed("diffusers", sd35, [1])],
        # a LoRA update of sdflax.train against diffusers' LoRA scripts' step, bf16: SD 1.5 512² batch 8, SDXL 1024²
        # batch 2
        "train": [train(framework, family) for family in ("sd15", "sdxl") for framework in ("sdflax", "diffusers")],
    }
    if part == "all":  # the most wanted of each part first
        order = [("sd15", 0), ("sd15", 1), ("correctness", 0), ("sdxl", 0), ("sdxl", 1), ("sdxl", 2), ("sdxl", 3),
                 ("compile", 4), ("sd15", 2), ("sd15", 3), ("sd15", 4), ("correctness", 1), ("sd15", 5), ("sd15", 6),
                 ("sd35", 0), ("sd35", 1), ("train", 0), ("train", 1), ("train", 2), ("train", 3)]
        chosen = [table[p][i] for p, i in order]
    else:
        chosen = table[part]
    chosen = [job for job in chosen if family in (None, job["family"])]
    if batch is not None:
        chosen = [{**job, "batches": [batch]} for job in chosen if batch in job.get("batches", ())]
    if full:
        return chosen
    # the tiny models: the first job of each code path, which the full run's other jobs repeat with other numbers
    seen = set()
    return [job for job in chosen if code_path(job) not in seen and not seen.add(code_path(job))]


def code_path(job) -> tuple:
    """What decides which of this script's code a job runs."""
    return job["kind"], job.get("framework"), job["family"], job.get("cache")


# ---- models with random weights ---------------------------------------------------------------------------------

def configs_for(family, size):
    return copy.deepcopy(SIZES[size][family])


def random_params(module, dtype, seed=0):
    """Random params for `module`, fast for billions of them: slices of one pool of normal draws. Kernels scaled
    by 1/sqrt(fan_in) (flax's default init), norm scales 1, biases 0, embeddings unscaled. The compute of the real
    weights, not their values (the speed runs)."""
    import jax
    import numpy as np

    from sdflax.cache import param_shapes

    pool = np.random.default_rng(seed).standard_normal(1 << 22, np.float32)
    offset = [0]

    def draw(path, leaf):
        name, shape = path[-1].key, leaf.shape
        if name in ("bias", "scale"):
            return jax.device_put(np.full(shape, float(name == "scale"), dtype))
        n = math.prod(shape)
        start = offset[0] % pool.size
        offset[0] += 7919  # each tensor starts elsewhere in the pool
        value = np.resize(pool[start:], n).reshape(shape)
        std = 1 / math.sqrt(math.prod(shape[:-1])) if name == "kernel" else 1.0
        return jax.device_put((value * np.float32(std)).astype(dtype))

    return jax.tree_util.tree_map_with_path(draw, param_shapes(module))


def model_classes(family) -> dict:
    """{name: sdflax class} of a family's pipeline."""
    from sdflax.models import (AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, SD3Transformer2DModel,
                               T5EncoderModel, UNet2DConditionModel)

    if family == "sd35":
        return {"transformer": SD3Transformer2DModel, "vae": AutoencoderKL,
                "text_encoder": CLIPTextModelWithProjection, "text_encoder_2": CLIPTextModelWithProjection,
                "text_encoder_3": T5EncoderModel}
    classes = {"text_encoder": CLIPTextModel, "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    if family == "sdxl":
        classes["text_encoder_2"] = CLIPTextModelWithProjection
    return classes


def model_calls(modules, configs, batch) -> dict:
    """The models of a setting's program, each as {name: (function of its params and inputs, input shapes, keyword
    input shapes)}: the denoiser's one evaluation (the sampling loop's body) on the guidance batch of 2·`batch` rows
    (SD 3.5's transformer under "transformer", its text states CLIP's 77 tokens and T5's 256, diffusers'
    max_sequence_length), the VAE decode of `batch` latents, and each text encoder on 2·`batch` prompts (negatives
    and prompts in one call, as the pipelines encode them)."""
    import jax
    import jax.numpy as jnp

    sds = jax.ShapeDtypeStruct
    vae = modules["vae"]
    h = configs["size"] // vae.config.scale_factor
    rows = 2 * batch
    latents = sds((rows, vae.config.latent_channels, h, h), jnp.float32)
    calls = {}
    if "transformer" in modules:
        cfg = modules["transformer"].config
        calls["transformer"] = (modules["transformer"].apply, (
            latents, sds((rows, 77 + 256, cfg.joint_attention_dim), jnp.bfloat16),
            sds((rows, cfg.pooled_projection_dim), jnp.bfloat16), sds((), jnp.float32)), {})
    else:
        unet = modules["unet"]
        extra = {}
        if unet.config.addition_embed_type == "text_time":
            pooled = modules["text_encoder_2"].config.projection_dim
            n_ids = (unet.config.projection_class_embeddings_input_dim - pooled) // \
                unet.config.addition_time_embed_dim
            extra = {"text_embeds": sds((rows, pooled), jnp.float32), "time_ids": sds((rows, n_ids), jnp.float32)}
        calls["unet"] = (unet.apply, (latents, sds((), jnp.float32),
                                      sds((rows, 77, unet.config.cross_attention_dim), jnp.bfloat16)), extra)
    calls["vae"] = (lambda p, z: vae.apply(p, z, method=vae.decode),
                    (sds((batch, *latents.shape[1:]), jnp.float32),), {})
    for name in ("text_encoder", "text_encoder_2"):  # CLIP's: the pipelines read its hidden states
        if name in modules:
            encoder = modules[name]
            calls[name] = (lambda p, ids, encoder=encoder: encoder.apply(p, ids, output_hidden_states=True),
                           (sds((rows, 77), jnp.int32),), {})
    if "text_encoder_3" in modules:  # T5's
        calls["text_encoder_3"] = (modules["text_encoder_3"].apply, (sds((rows, 256), jnp.int32),), {})
    return calls


def sdflax_pipeline(family, size, dtype, attention="auto", scheduler=None, kernels=None, weights=True):
    """(pipeline, params) of `family` with random weights, or their shapes alone (`weights=False`: params of
    jax.ShapeDtypeStruct, for tracing); `kernels` as `build_models` takes them."""
    import jax

    from sdflax import StableDiffusion, StableDiffusion3, StableDiffusionXL
    from sdflax.loading.assemble import build_models
    from sdflax.loading.folders import load_tokenizer
    from sdflax.schedulers import scheduler_from_config
    from sdflax.loading.tokenizers import T5Tokenizer

    configs = configs_for(family, size)
    modules = build_models(model_classes(family), configs, dtype, attention, kernels)
    if weights:
        params = {name: random_params(module, dtype, seed=i) for i, (name, module) in enumerate(modules.items())}
    else:
        from sdflax.cache import param_shapes

        params = {name: jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dtype), param_shapes(module))
                  for name, module in modules.items()}
    extra = {"tokenizer_2": load_tokenizer(str(TOKENIZER), pad_token="!")} if family != "sd15" else {}
    if family == "sd35":
        from benchmark import write_t5_tokenizer  # scripts/benchmark.py's small vocabulary: the compute is T5's

        with tempfile.TemporaryDirectory() as folder:
            extra["tokenizer_3"] = T5Tokenizer.from_folder(write_t5_tokenizer(folder))
    cls = {"sd15": StableDiffusion, "sdxl": StableDiffusionXL, "sd35": StableDiffusion3}[family]
    pipeline = cls(tokenizer=load_tokenizer(str(TOKENIZER)), dtype=dtype,
                   scheduler=scheduler_from_config(configs["scheduler"], scheduler), **modules, **extra)
    return pipeline, params


def write_checkpoint(job, size):
    """SD 1.5's architecture with random weights (`torch_models`), saved in float32 by diffusers' own
    `save_pretrained` into `job["folder"]`, as the hub's files are: what the cold and warm jobs load, so that their
    `ready_s` counts a user's load from disk."""
    import diffusers
    import torch
    import transformers

    if job["family"] != "sd15":
        raise ValueError(f"checkpoints are written for sd15 only, not {job['family']}")
    models = torch_models("sd15", size, "cuda" if torch.cuda.is_available() else "cpu")
    scheduler = configs_for("sd15", size)["scheduler"]
    pipe = diffusers.StableDiffusionPipeline(
        tokenizer=transformers.CLIPTokenizer.from_pretrained(str(TOKENIZER)), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
        scheduler=getattr(diffusers, scheduler["_class_name"]).from_config(scheduler), **models)
    pipe.save_pretrained(job["folder"])
    return {"bytes": sum(f.stat().st_size for f in Path(job["folder"]).rglob("*.safetensors"))}


def torch_models(family, size, device, seed=0):
    """{name: model} of `family` from diffusers / transformers, random weights drawn on `device`, float32, with
    random norm scales and biases (so that a mix-up of the two shows)."""
    import diffusers
    import torch
    import transformers

    configs = configs_for(family, size)
    clip = lambda c: transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**c))  # noqa: E731
    with torch.device(device):
        torch.manual_seed(seed)
        if family == "sd35":
            models = {"transformer": diffusers.SD3Transformer2DModel(**configs["transformer"]),
                      "vae": diffusers.AutoencoderKL(**configs["vae"]), "text_encoder": clip(configs["text_encoder"]),
                      "text_encoder_2": clip(configs["text_encoder_2"]), "text_encoder_3": transformers.T5EncoderModel(
                          transformers.T5Config(**configs["text_encoder_3"]))}
        else:
            models = {"unet": diffusers.UNet2DConditionModel(**configs["unet"]),
                      "vae": diffusers.AutoencoderKL(**configs["vae"]),
                      "text_encoder": transformers.CLIPTextModel(
                          transformers.CLIPTextConfig(**configs["text_encoder"]))}
        if family == "sdxl":
            models["text_encoder_2"] = clip(configs["text_encoder_2"])
        g = torch.Generator(device).manual_seed(seed)
        with torch.no_grad():
            for model in models.values():
                for m in model.modules():
                    if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None:
                        m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g, device=device))
                        m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g, device=device))
    return {name: model.eval() for name, model in models.items()}


# ---- correctness ------------------------------------------------------------------------------------------------

def compare(ours, theirs, bound):
    """The check of one output against its reference."""
    import numpy as np

    ours, theirs = (np.asarray(x, np.float64) for x in (ours, theirs))
    finite = bool(np.isfinite(ours).all())
    rel = float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30)) if finite else None
    constant = bool(np.ptp(ours) == 0) if finite else None
    return {"rel_l2": rel, "max_abs": float(np.abs(ours - theirs).max()) if finite else None, "bound": bound,
            "finite": finite, "constant": constant,
            "ok": bool(finite and not constant and rel is not None and rel <= bound)}


def correctness(job, size):
    """sdflax's models against diffusers' on this device, float32 and bfloat16."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the device
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from sdflax.loading.assemble import build_models
    from sdflax.cache import param_shapes
    from sdflax.models import AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, UNet2DConditionModel
    from sdflax.loading.weights import convert_state_dict

    family = job["family"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    configs = configs_for(family, size)
    theirs = torch_models(family, size, device)
    classes = {"unet": UNet2DConditionModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel,
               "text_encoder_2": CLIPTextModelWithProjection}
    classes = {name: classes[name] for name in theirs}
    state = {name: {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
             for name, model in theirs.items()}

    # inputs: two rows, as classifier-free guidance runs the UNet; latents at the family's image size
    rng = np.random.default_rng(0)
    side = configs["size"] // 8
    unet_cfg = configs["unet"]
    inputs = {"sample": rng.standard_normal((2, 4, side, side), np.float32),
              "timesteps": np.asarray([500.0, 20.0], np.float32),
              "context": rng.standard_normal((2, 77, unet_cfg["cross_attention_dim"]), np.float32)}
    if family == "sdxl":
        inputs["text_embeds"] = rng.standard_normal((2, configs["text_encoder_2"]["projection_dim"]), np.float32)
        size_px = configs["size"]
        inputs["time_ids"] = np.tile(np.asarray([size_px, size_px, 0, 0, size_px, size_px], np.float32), (2, 1))
    latents = rng.standard_normal((1, 4, side, side), np.float32)
    ids = rng.integers(0, 49407, (2, 77)).astype(np.int32)
    ids[:, -1] = 49407  # an end token to pool at

    def torch_outputs(dtype):
        t = lambda x: torch.from_numpy(x).to(device, dtype)  # noqa: E731
        out = {}
        with torch.no_grad():
            models = {name: copy.deepcopy(m).to(dtype) for name, m in theirs.items()}
            extra = {}
            if family == "sdxl":
                extra = {"added_cond_kwargs": {"text_embeds": t(inputs["text_embeds"]),
                                               "time_ids": t(inputs["time_ids"])}}
            out["unet"] = models["unet"](t(inputs["sample"]), t(inputs["timesteps"]),
                                         encoder_hidden_states=t(inputs["context"]), **extra).sample
            out["vae"] = models["vae"].decode(t(latents)).sample
            for name in TEXT_ENCODERS:
                if name in models:
                    result = models[name](torch.from_numpy(ids).long().to(device), output_hidden_states=True)
                    out[name] = result.hidden_states[-2]  # what SD 2 / SDXL condition on (SD 1: the last)
                    out[name + ".last"] = result.last_hidden_state
            del models
        return {k: v.float().cpu().numpy() for k, v in out.items()}

    converted = {}  # dtype -> params

    def sdflax_outputs(dtype, attention="auto", only=None):
        modules = build_models(classes if only is None else {only: classes[only]}, configs, dtype, attention)
        params = converted.setdefault(dtype, {})
        for name in modules:
            if name not in params:
                params[name] = convert_state_dict(state[name], param_shapes(modules[name]), dtype)
        unet = modules["unet"]
        extra = {"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]} if family == "sdxl" else {}
        out = {"unet": jax.jit(unet.apply)(params["unet"], inputs["sample"], inputs["timesteps"], inputs["context"],
                                           **extra)}
        if "vae" in modules:
            vae = modules["vae"]
            out["vae"] = jax.jit(lambda p, z: vae.apply(p, z, method=vae.decode))(params["vae"], latents)
        for name in TEXT_ENCODERS:
            if name in modules:
                result = jax.jit(lambda p, x, m=modules[name]: m.apply(p, x, output_hidden_states=True))(
                    params[name], ids)
                out[name] = result.hidden_states[-2]
                out[name + ".last"] = result.last_hidden_state
        return {k: np.asarray(jnp.asarray(v, jnp.float32)) for k, v in out.items()}

    report = {"device": str(jax.devices()[0].device_kind), "image_size": configs["size"]}
    log(f"correctness {family}: float32 ...")
    theirs32 = torch_outputs(torch.float32)
    with jax.default_matmul_precision("highest"):
        ours32 = sdflax_outputs(jnp.float32)
    report["float32"] = {k: compare(ours32[k], theirs32[k], FLOAT32_BOUND) for k in theirs32}
    log(f"correctness {family}: bfloat16 ...")
    theirs16 = torch_outputs(torch.bfloat16)
    try:
        ours16 = sdflax_outputs(jnp.bfloat16)
    except Exception as e:  # cuDNN refusing a shape: say so, and check XLA's attention instead
        report["attention_fallback"] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
        ours16 = sdflax_outputs(jnp.bfloat16, attention="xla")
    checks = {}
    for k in theirs16:
        reference = compare(theirs16[k], theirs32[k], math.inf)["rel_l2"]
        bound = max(2 * reference, BFLOAT16_FLOOR) if reference is not None else BFLOAT16_FLOOR
        checks[k] = {**compare(ours16[k], theirs32[k], bound), "diffusers_rel_l2": reference,
                     "against_diffusers_bfloat16": compare(ours16[k], theirs16[k], math.inf)["rel_l2"]}
    report["bfloat16"] = checks
    log(f"correctness {family}: attention kernels ...")
    report["attention"] = attention_layers(configs, side)
    if all(row["kernel"] == "xla" for row in report["attention"]):  # `auto` is XLA's attention here: one program
        xla16 = ours16
    else:
        xla16 = sdflax_outputs(jnp.bfloat16, attention="xla", only="unet")
    # the UNet with the attention `auto` picks here (cuDNN on a GPU) and with XLA's, each against float32
    bound = checks["unet"]["bound"]
    report["unet_attention"] = {"auto": compare(ours16["unet"], theirs32["unet"], bound),
                                "xla": compare(xla16["unet"], theirs32["unet"], bound),
                                "auto_vs_xla_rel_l2": compare(ours16["unet"], xla16["unet"], math.inf)["rel_l2"]}
    return report


def attention_shapes(configs, side):
    """(kind, query tokens, key tokens, heads, head dim) of each distinct attention of the UNet at `side` latents."""
    unet = configs["unet"]
    channels = unet["block_out_channels"]
    heads = unet["attention_head_dim"]
    heads = heads if isinstance(heads, list) else [heads] * len(channels)
    shapes = set()
    for level, (kind, c) in enumerate(zip(unet["down_block_types"], channels)):
        if kind.startswith("CrossAttn"):
            n = heads[level]  # diffusers' old naming: "attention_head_dim" is the head count
            tokens = (side >> level) ** 2
            shapes.add(("self", tokens, tokens, n, c // n))
            shapes.add(("cross", tokens, 77, n, c // n))
    tokens, n = (side >> (len(channels) - 1)) ** 2, heads[-1]  # the mid block, at the lowest resolution
    shapes |= {("self", tokens, tokens, n, channels[-1] // n), ("cross", tokens, 77, n, channels[-1] // n)}
    return sorted(shapes, key=lambda s: (-s[1], s[0]))


def attention_layers(configs, side):
    """Per attention shape at bfloat16: the kernel sdflax picks here, and XLA's and (where it runs) cuDNN's
    results against float64 attention on the same (bfloat16-rounded) inputs."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from sdflax.models.layers import dot_product_attention, resolve_kernels

    kernels = resolve_kernels()
    rng = np.random.default_rng(0)
    rows = []
    for kind, t, s, heads, head_dim in attention_shapes(configs, side):
        q = rng.standard_normal((2, t, heads, head_dim)).astype(ml_dtypes.bfloat16)
        k, v = (rng.standard_normal((2, s, heads, head_dim)).astype(ml_dtypes.bfloat16) for _ in range(2))
        q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
        logits = np.einsum("bqhd,bkhd->bhqk", q64, k64) / math.sqrt(head_dim)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        reference = np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v64)
        row = {"kind": kind, "query_tokens": t, "key_tokens": s, "heads": heads, "head_dim": head_dim,
               "kernel": kernels.attention_kernel(head_dim, jnp.bfloat16, t, s)}
        runs = {"xla": True, "cudnn": kernels.cudnn_runs(head_dim, jnp.bfloat16),
                "pallas": kernels.pallas_runs(t, s, jnp.bfloat16)}
        for name, here in runs.items():
            if not here:
                row[name] = None  # the kernel does not run here (another device, or shapes): sdflax takes XLA
                continue
            chosen = dataclasses.replace(kernels, attention=name)
            try:
                out = jax.jit(lambda q, k, v, c=chosen: dot_product_attention(q, k, v, kernels=c))(q, k, v)
                row[name] = compare(np.asarray(out.astype(jnp.float32)), reference, BFLOAT16_FLOOR)
            except Exception as e:  # a shape the kernel refuses: the finding itself
                row[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", "ok": False}
        rows.append(row)
    return rows


# ---- speed ------------------------------------------------------------------------------------------------------

def timed(call, repeats):
    """(first call's seconds, [timed calls' seconds])."""
    start = time.perf_counter()
    call(0)
    first = time.perf_counter() - start
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        call(i + 1)
        times.append(time.perf_counter() - start)
    return first, times


def figures(batch, first, times, peak):
    median = statistics.median(times)
    return {"batch": batch, "first_call_s": first, "seconds_per_call": median, "seconds_per_call_min": min(times),
            "seconds_per_call_max": max(times), "seconds_per_image": median / batch, "images_per_s": batch / median,
            "peak_memory_bytes": peak}


def speed_sdflax(job, size, repeats):
    import jax
    import jax.numpy as jnp

    if job["cache"] == "none":
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        jax.config.update("jax_compilation_cache_dir", job["cache_dir"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    from sdflax.cli import CompileClock

    import_s = time.perf_counter() - _JOB_START
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    if job.get("weights") == "checkpoint":  # a user's load: the files written by `write_checkpoint`
        from sdflax import StableDiffusion

        pipeline, params = StableDiffusion.from_pretrained(job["checkpoint"], dtype=dtype, scheduler=job["scheduler"],
                                                           attention=job["attention"])
    else:
        pipeline, params = sdflax_pipeline(job["family"], size, dtype, job["attention"], job["scheduler"])
    jax.block_until_ready(params)
    build_s = time.perf_counter() - _JOB_START - import_s
    side = configs_for(job["family"], size)["size"]
    out = {"import_s": import_s, "build_s": build_s, "dtype": jnp.dtype(dtype).name,
           "device": jax.devices()[0].device_kind, "height": side, "width": side, "results": []}
    for batch in job["batches"]:
        ids = pipeline.prepare_inputs([PROMPT] * batch)

        def call(seed):
            images = pipeline(ids, params, jax.random.key(seed), num_inference_steps=job["steps"], height=side,
                              width=side, guidance_scale=job["guidance"])
            return images.images

        log(f"sdflax {job['family']} batch {batch} ...")
        with CompileClock() as clock:
            try:
                first, times = timed(call, repeats)
            except Exception as e:  # cuDNN refusing a shape: say so, and measure XLA's attention instead
                if pipeline.denoiser.model.kernels.attention == "xla":
                    raise
                log(f"attention {job['attention']!r} failed ({type(e).__name__}: {e}); XLA's attention instead")
                out["attention_fallback"] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
                pipeline, params = sdflax_pipeline(job["family"], size, dtype, "xla", job["scheduler"])
                first, times = timed(call, repeats)
        if "ready_s" not in out:
            out["ready_s"] = time.perf_counter() - _JOB_START - sum(times)
            out["cache_hits"] = clock.cache_hits
        peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
        out["results"].append({**figures(batch, first, times, peak), "compile_s": clock.seconds})
    log(f"sdflax {job['family']} batch {batch}: one more call, profiled ...")
    out["profile"] = {"batch": batch, **device_profile(lambda: call(repeats + 1))}  # the last batch's
    return out


# Kernel categories of a device profile, the first whose words a kernel's name or HLO op holds (lower case).
PROFILE_CATEGORIES = (("attention", ("fmha", "flash", "attention", "sdpa")),
                      ("convolution", ("convolution", "convolve", "conv_general", "cudnn-conv", "cudnn$conv", "fprop",
                                       "dgrad", "wgrad")),
                      ("matmul", ("gemm", "nvjet", "cublas", "dot", "matmul")),
                      ("memory", ("memcpy", "memset", "copy")))


# The CPU's events that hold others: the executor's, and a loop's or a call's thunk around its body's.
CPU_WRAPPERS = ("ThunkExecutor", "while.", "conditional.", "call.")


def kernel_category(name: str) -> str:
    name = name.lower()
    return next((category for category, words in PROFILE_CATEGORIES if any(w in name for w in words)), "other")


def device_profile(run, top=25):
    """Where one call's device time goes: `run()` under JAX's profiler, its kernels' seconds summed by kernel (with
    XLA's HLO op where the trace names it), by category (`PROFILE_CATEGORIES`; "other" is XLA's own fusions:
    norms, activations, elementwise) and in all (`device_busy_s`, against the call's `wall_s`: the rest is the
    device waiting on launches or the host). A GPU's kernels are its streams' events; a TPU's, its "XLA Ops"
    line's; the CPU's, XLA's thunks on its threads. Never fails its job: a trace it cannot read is an error
    here."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # the device's kernels and XLA's ops, not every Python call
    options.raise_error_on_start_failure = True  # a device tracer that does not start is this profile's error
    options.enable_hlo_proto = False
    try:
        with tempfile.TemporaryDirectory() as folder:
            with jax.profiler.trace(folder, profiler_options=options):
                start = time.perf_counter()
                run()
                wall_s = time.perf_counter() - start
            data = jax.profiler.ProfileData.from_file(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
            devices = [plane for plane in data.planes if plane.name.startswith("/device:")]
            if devices:
                lines = [line for line in devices[0].lines if line.name.startswith("Stream")] or \
                    [line for line in devices[0].lines if line.name == "XLA Ops"]
            else:
                lines = [line for plane in data.planes if plane.name == "/host:CPU" for line in plane.lines
                         if line.name.startswith("tf_XLA")]
            if not lines:
                seen = {plane.name: [line.name for line in plane.lines][:8] for plane in data.planes}
                raise ValueError(f"no kernel events in the trace; its planes and their lines: {seen}")
            kernels = {}
            for line in lines:
                for event in line.events:
                    if event.name.startswith(CPU_WRAPPERS):  # their thunks are counted themselves
                        continue
                    stats = dict(event.stats)
                    key = (event.name, str(stats.get("hlo_op", "")))
                    count, ns = kernels.get(key, (0, 0))
                    kernels[key] = (count + 1, ns + event.duration_ns)
    except Exception as e:  # a profiler without its device tracer (CUPTI), an unreadable trace
        return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:1000]}"}
    categories = dict.fromkeys([category for category, _ in PROFILE_CATEGORIES] + ["other"], 0.0)
    for (name, op), (_, ns) in kernels.items():
        categories[kernel_category(f"{name} {op}")] += ns / 1e9
    ranked = sorted(kernels.items(), key=lambda item: -item[1][1])
    return {"wall_s": wall_s, "device_busy_s": sum(ns for _, ns in kernels.values()) / 1e9,
            "kernel_launches": sum(count for count, _ in kernels.values()),
            "lines": sorted({line.name for line in lines}),
            "categories_s": categories,
            "top": [{"name": name[:160], "hlo_op": op, "count": count, "seconds": ns / 1e9}
                    for (name, op), (count, ns) in ranked[:top]]}


def flop_count(job, size):
    """FLOPs per image of a speed setting from XLA's cost analysis, counted in a CPU-only process from the param
    shapes (no weights, no device): the UNet (SD 3.5: the transformer, counted under the same keys) lowered once
    with XLA's attention (cuDNN's is a custom call XLA cannot count) on a guidance batch of two rows, times its
    evaluations, plus the VAE decode. The text encoders' share is left out (under 0.1%; SD 3.5's T5-XXL, about
    0.4%). The count is the model's, whatever device or framework runs it."""
    import jax
    import jax.numpy as jnp

    from sdflax.loading.assemble import build_models
    from sdflax.cache import param_shapes
    from sdflax.models.layers import Kernels
    from sdflax.schedulers import scheduler_from_config

    configs = configs_for(job["family"], size)
    kernels = Kernels("gpu", None, "xla")  # a GPU's graph, XLA's attention
    modules = build_models(model_classes(job["family"]), configs, jnp.bfloat16, kernels=kernels)
    calls = model_calls(modules, configs, batch=1)

    def flops(name):
        function, inputs, keywords = calls[name]
        cost = jax.jit(function).lower(param_shapes(modules[name]), *inputs, **keywords).cost_analysis()
        return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])

    unet_flops = flops("transformer" if job["family"] == "sd35" else "unet")
    vae_flops = flops("vae")
    scheduler = scheduler_from_config(configs["scheduler"], job["scheduler"])
    evals = int(scheduler.set_timesteps(job["steps"], shape=calls["vae"][1][0].shape).timesteps.shape[0])
    return {"flops_per_image": evals * unet_flops + vae_flops, "unet_evals": evals,
            "unet_eval_flops": unet_flops, "vae_decode_flops": vae_flops, "program": program_size(job, size, kernels)}


def one_layer_configs(configs) -> dict:
    """{model: config} of the models whose layers repeat, each stack cut to one layer: the UNet's transformer
    stacks (SDXL's ten), CLIP's encoder layers. What a model whose repeated layers were one `lax.scan` body would
    compile, so its compile beside the whole model's bounds what scanning them could save."""
    cut = {}
    unet = configs.get("unet")
    if unet:
        layers = unet.get("transformer_layers_per_block", 1)
        per_block = layers if isinstance(layers, list) else [layers] * len(unet["block_out_channels"])
        if max(per_block) > 1:
            cut["unet"] = {**unet, "transformer_layers_per_block": [min(n, 1) for n in per_block]}
    for name in TEXT_ENCODERS:
        if name in configs and configs[name]["num_hidden_layers"] > 1:
            cut[name] = {**configs[name], "num_hidden_layers": 1}
    return cut


def compile_split(job, size, repeats):
    """Where a setting's cold compile goes: each model's call of `model_calls` at the job's batch, lowered and
    compiled alone on this device from the param shapes (no weights, no compile cache) with the kernels the speed
    jobs pick, as the pipeline's dtype. Beside a speed job's `compile_s` (the whole program, the sampling loop and
    the guidance around them included) they say which model's compile to shorten. Then what scanning over the
    repeated layers would save: `one_layer`, the same for the models of `one_layer_configs` (a bound); `scanned`,
    for the UNet with each stack of transformer layers one `lax.scan` (`scanned_transformer_stacks`); and
    `unet_runs`, both UNets run with the same random weights: seconds an evaluation, what scanning costs of the
    speed, and the scanned output against the plain one."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdflax.loading.assemble import build_models
    from sdflax.cache import param_shapes

    jax.config.update("jax_enable_compilation_cache", False)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    classes, batch = model_classes(job["family"]), job["batches"][0]
    configs = configs_for(job["family"], size)

    def compile_each(configs, names, what=""):
        """({name: module}, {name: times}, {name: compiled call}) of the models `names`."""
        modules = build_models(classes, configs, dtype, "auto")
        times, compiled = {}, {}
        for name, (function, inputs, keywords) in model_calls(modules, configs, batch).items():
            if name not in names:
                continue
            log(f"compile split {job['family']}: {name}{what} ...")
            params = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dtype), param_shapes(modules[name]))
            start = time.perf_counter()
            lowered = jax.jit(function).lower(params, *inputs, **keywords)
            lowered_at = time.perf_counter()
            compiled[name] = lowered.compile()
            times[name] = {"lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at,
                           "stablehlo_lines": lowered.as_text().count("\n")}
        return modules, times, compiled

    modules, times, plain = compile_each(configs, set(classes))
    cut = one_layer_configs(configs)
    out = {"batch": batch, "dtype": jnp.dtype(dtype).name, "device": jax.devices()[0].device_kind, "models": times,
           "one_layer": compile_each({**configs, **cut}, set(cut), ", one layer a stack")[1]}
    if "unet" not in modules:
        return out
    with scanned_transformer_stacks():
        _, out["scanned"], scanned = compile_each(configs, {"unet"}, ", its stacks scanned")
    # both UNets on the same random weights and inputs
    _, shapes, keyword_shapes = model_calls(modules, configs, batch)["unet"]
    params = random_params(modules["unet"], dtype)
    keys = iter(jax.random.split(jax.random.key(0), len(shapes) + len(keyword_shapes)))
    draw = lambda shape: jax.random.normal(next(keys), shape.shape).astype(shape.dtype)  # noqa: E731
    inputs, keywords = [draw(shape) for shape in shapes], {k: draw(shape) for k, shape in keyword_shapes.items()}
    runs, outputs = {}, {}
    for name, call in (("plain", plain["unet"]), ("scanned", scanned["unet"])):
        log(f"compile split {job['family']}: the {name} UNet runs ...")
        first, seconds = timed(lambda i: outputs.__setitem__(name, call(params, *inputs, **keywords)
                                                             .block_until_ready()), repeats)
        runs[name] = {"first_call_s": first, "seconds_per_call": statistics.median(seconds),
                      "seconds_per_call_min": min(seconds), "seconds_per_call_max": max(seconds)}
    out["unet_runs"] = {**runs, "scanned_rel_l2": compare(outputs["scanned"], outputs["plain"], math.inf)["rel_l2"],
                        "output_std": float(np.asarray(outputs["plain"], np.float64).std())}
    return out


@contextlib.contextmanager
def scanned_transformer_stacks():
    """Within, the UNets built run each stack of two or more transformer layers as one `lax.scan` over the layers'
    params, stacked in the program (the params tree, and so loading, stay as they are): sdflax's `Transformer2DModel`
    with its loop of layers replaced, for `compile_split` to measure. Hooks, which address layers by name, would not
    see the layers inside the scan: an experiment, not a way sdflax runs."""
    import flax.linen as nn
    import jax

    from sdflax.models import unet

    class ScannedTransformer2DModel(unet.Transformer2DModel):
        @nn.compact
        def __call__(self, x, context):
            b, h, w, c = x.shape
            linear = self.config.use_linear_projection
            project = lambda name: (unet.Dense(c, dtype=self.dtype, name=name) if linear  # noqa: E731
                                    else unet.conv(c, kernel=1, name=name, dtype=self.dtype, kernels=self.kernels))
            hidden = unet.GroupNorm(self.config.norm_num_groups, 1e-6, self.dtype, name="norm")(x)
            hidden = project("proj_in")(hidden).reshape(b, h * w, c)
            block = lambda **where: unet.BasicTransformerBlock(  # noqa: E731
                self.heads, c // self.heads, self.config.upcast_attention, self.dtype, self.kernels, **where)
            names = [f"transformer_blocks_{i}" for i in range(self.layers)]
            if self.is_initializing() or self.layers == 1:  # the params, one tree a layer, as the loaders fill them
                for name in names:
                    hidden = block(name=name)(hidden, context)
            else:
                stacked = jax.tree.map(lambda *layers: jax.numpy.stack(layers),
                                       *(self.variables["params"][name] for name in names))
                step = lambda h, params: (block(parent=None).apply({"params": params}, h, context), None)  # noqa
                hidden = jax.lax.scan(step, hidden, stacked)[0]
            return x + project("proj_out")(hidden.reshape(b, h, w, c))

    plain = unet.Transformer2DModel
    unet.Transformer2DModel = ScannedTransformer2DModel
    try:
        yield
    finally:
        unet.Transformer2DModel = plain


def program_size(job, size, kernels):
    """The whole generate program of a speed setting (batch 1, the GPU's graph with XLA's attention), traced and
    lowered from the param shapes: the seconds of the host's part of a cold compile, and the size of the StableHLO
    module XLA then compiles."""
    import jax
    import jax.numpy as jnp

    pipeline, params = sdflax_pipeline(job["family"], size, jnp.bfloat16, scheduler=job["scheduler"], kernels=kernels,
                                       weights=False)
    side = configs_for(job["family"], size)["size"]

    def generate(params, ids, key):
        return pipeline._generate(ids, params, key, num_inference_steps=job["steps"], height=side, width=side,
                                  guidance_scale=job["guidance"])

    start = time.perf_counter()
    traced = jax.jit(generate).trace(params, pipeline.prepare_inputs([PROMPT]), jax.random.key(0))
    trace_s = time.perf_counter() - start
    text = traced.lower().as_text()
    return {"batch": 1, "trace_s": trace_s, "lower_s": time.perf_counter() - start - trace_s,
            "stablehlo_bytes": len(text.encode()), "stablehlo_lines": text.count("\n")}


def speed_diffusers(job, size, repeats):
    import diffusers
    import torch
    import transformers

    import_s = time.perf_counter() - _JOB_START
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.float16) if cuda else ("cpu", torch.float32)
    family = job["family"]
    configs = configs_for(family, size)
    models = torch_models(family, size, device)
    models = {name: m.to(dtype) for name, m in models.items()}
    tokenizer = transformers.CLIPTokenizer.from_pretrained(str(TOKENIZER))
    scheduler_config = configs["scheduler"]
    scheduler_class = diffusers.EulerDiscreteScheduler if job["scheduler"] == "euler" else \
        getattr(diffusers, scheduler_config["_class_name"])
    scheduler = scheduler_class.from_config(scheduler_config)
    if family == "sd35":
        from benchmark import write_t5_tokenizer

        with tempfile.TemporaryDirectory() as folder:  # T5's tokenizer (max_sequence_length: diffusers' 256)
            tokenizer_3 = transformers.T5TokenizerFast(
                tokenizer_file=os.path.join(write_t5_tokenizer(folder), "tokenizer.json"))
        pipe = diffusers.StableDiffusion3Pipeline(
            tokenizer_2=transformers.CLIPTokenizer.from_pretrained(str(TOKENIZER), pad_token="!"), tokenizer=tokenizer,
            tokenizer_3=tokenizer_3, scheduler=scheduler, **models)
    elif family == "sdxl":
        pipe = diffusers.StableDiffusionXLPipeline(
            tokenizer_2=transformers.CLIPTokenizer.from_pretrained(str(TOKENIZER), pad_token="!"), tokenizer=tokenizer,
            scheduler=scheduler, add_watermarker=False, **models)
    else:
        pipe = diffusers.StableDiffusionPipeline(tokenizer=tokenizer, scheduler=scheduler, safety_checker=None,
                                                 feature_extractor=None, requires_safety_checker=False, **models)
    pipe.set_progress_bar_config(disable=True)
    compiled = job["framework"] == "diffusers+compile"
    if compiled:  # diffusers' speed guide: channels-last, the UNet compiled whole
        pipe.unet.to(memory_format=torch.channels_last)
        pipe.unet = torch.compile(pipe.unet, fullgraph=True, backend="inductor" if cuda else "eager")
    build_s = time.perf_counter() - _JOB_START - import_s
    side = configs["size"]
    out = {"import_s": import_s, "build_s": build_s, "dtype": str(dtype).removeprefix("torch."),
           "device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
           "attention": "sdpa", "compile": "torch.compile(unet, fullgraph=True)" if compiled else None,
           "height": side, "width": side, "results": []}
    for batch in job["batches"]:
        def call(seed):
            pipe([PROMPT] * batch, height=side, width=side, num_inference_steps=job["steps"],
                 guidance_scale=job["guidance"], generator=torch.Generator(device).manual_seed(seed),
                 output_type="np")
            if cuda:
                torch.cuda.synchronize()

        log(f"diffusers {family} batch {batch} ...")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            first, times = timed(call, repeats)
        if "ready_s" not in out:
            out["ready_s"] = time.perf_counter() - _JOB_START - sum(times)
        peak = torch.cuda.max_memory_allocated() if cuda else None
        out["results"].append(figures(batch, first, times, peak))
    return out


# ---- training ---------------------------------------------------------------------------------------------------

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the LoRA scripts' UNet targets


def train_batches(job, size, count):
    """`count` batches of one LoRA update each, the same for both frameworks: cached latents (the scripts'
    --cache_latents), random caption ids (SDXL: both tokenizers' and the size ids of a 1024² picture), the noise
    and the timesteps."""
    import numpy as np

    configs, batch = configs_for(job["family"], size), job["batches"][0]
    side = configs["size"] // 2 ** (len(configs["vae"]["block_out_channels"]) - 1)
    g = np.random.default_rng(0)
    out = []
    for _ in range(count):
        shape = (batch, configs["vae"]["latent_channels"], side, side)
        ids = (batch, 2, 77) if job["family"] == "sdxl" else (batch, 77)
        step = {"latents": g.standard_normal(shape, dtype=np.float32), "input_ids": g.integers(0, 49407, ids),
                "noise": g.standard_normal(shape, dtype=np.float32), "timesteps": g.integers(0, 1000, batch)}
        if job["family"] == "sdxl":
            step.update(original_size=np.full((batch, 2), configs["size"]), target_size=np.full((batch, 2),
                        configs["size"]), crops_coords_top_left=np.zeros((batch, 2), np.int64))
        out.append(step)
    return out


def train_figures(job, first, times, peak):
    median, batch = statistics.median(times), job["batches"][0]
    return {"batch": batch, "first_step_s": first, "seconds_per_step": median, "seconds_per_step_min": min(times),
            "seconds_per_step_max": max(times), "steps_per_s": 1 / median, "images_per_s": batch / median,
            "peak_memory_bytes": peak}


def train_sdflax(job, size, repeats):
    """sdflax.train's LoRA update (one compiled program): the UNet's frozen weights in bfloat16, the LoRA and
    Adam's state in float32, the text encoders run in the step."""
    import jax
    import jax.numpy as jnp

    from sdflax.train import TrainConfig, Trainer

    import_s = time.perf_counter() - _JOB_START
    bf16 = jax.default_backend() != "cpu"
    pipeline, params = sdflax_pipeline(job["family"], size, jnp.bfloat16 if bf16 else jnp.float32)
    trainer = Trainer(pipeline, params, TrainConfig(method="lora", rank=job["rank"], lora_targets=LORA_TARGETS,
                                                    mixed_precision="bf16" if bf16 else "no"))
    del params
    jax.block_until_ready(trainer.state)
    build_s = time.perf_counter() - _JOB_START - import_s
    batches = train_batches(job, size, repeats + 1)

    def call(i):
        step = dict(batches[i])
        draws = {k: step.pop(k) for k in ("noise", "timesteps")}
        trainer.step(step, **draws)
        jax.block_until_ready(trainer.state)

    log(f"sdflax train {job['family']} batch {job['batches'][0]} ...")
    first, times = timed(call, repeats)
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return {"import_s": import_s, "build_s": build_s, "dtype": "bfloat16" if bf16 else "float32",
            "device": jax.devices()[0].device_kind, "results": [train_figures(job, first, times, peak)]}


def train_diffusers(job, size, repeats):
    """diffusers' LoRA scripts' update (train_text_to_image_lora.py, its _sdxl twin): PEFT's LoRA layers on the
    UNet, the frozen weights in bfloat16 and the LoRA cast to float32 (`cast_training_params`), autocast, the
    scripts' loss line, clip_grad_norm_ and torch.optim.AdamW."""
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler
    from peft import LoraConfig, inject_adapter_in_model

    import_s = time.perf_counter() - _JOB_START
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    models = torch_models(job["family"], size, device)
    unet = models["unet"]
    encoders = [models[name] for name in TEXT_ENCODERS if name in models]
    for model in (unet, *encoders):
        model.requires_grad_(False).to(dtype=dtype)
    inject_adapter_in_model(LoraConfig(r=job["rank"], lora_alpha=job["rank"], init_lora_weights="gaussian",
                                       target_modules=LORA_TARGETS), unet)
    trained = [p for n, p in unet.named_parameters() if "lora_" in n]
    for p in trained:
        p.data = p.data.float()
        p.requires_grad_(True)
    unet.train()
    optimizer = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    scheduler = DDPMScheduler.from_config(configs_for(job["family"], size)["scheduler"])
    build_s = time.perf_counter() - _JOB_START - import_s
    batches = train_batches(job, size, repeats + 1)
    tensor = lambda x: torch.from_numpy(x).to(device)  # noqa: E731

    def call(i):
        step = batches[i]
        latents, noise, timesteps = tensor(step["latents"]), tensor(step["noise"]), tensor(step["timesteps"])
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            noisy = scheduler.add_noise(latents, noise, timesteps)
            ids = tensor(step["input_ids"])
            if job["family"] == "sdxl":  # the SDXL script's encode_prompt: both encoders' penultimate states
                with torch.no_grad():
                    first_out = encoders[0](ids[:, 0], output_hidden_states=True)
                    second_out = encoders[1](ids[:, 1], output_hidden_states=True)
                states = torch.cat([first_out.hidden_states[-2], second_out.hidden_states[-2]], dim=-1)
                time_ids = torch.cat([tensor(step[k]) for k in ("original_size", "crops_coords_top_left",
                                                                 "target_size")], dim=1).to(states.dtype)
                extra = {"added_cond_kwargs": {"text_embeds": second_out.text_embeds, "time_ids": time_ids}}
            else:
                with torch.no_grad():
                    states = encoders[0](ids, return_dict=False)[0]
                extra = {}
            prediction = unet(noisy, timesteps, states, return_dict=False, **extra)[0]
        loss = F.mse_loss(prediction.float(), noise.float(), reduction="mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()

    log(f"diffusers train {job['family']} batch {job['batches'][0]} ...")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first, times = timed(call, repeats)
    return {"import_s": import_s, "build_s": build_s, "dtype": str(dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
            "results": [train_figures(job, first, times, torch.cuda.max_memory_allocated() if cuda else None)]}


# ---- the parent -------------------------------------------------------------------------------------------------

def device_platform() -> str:
    """JAX's platform here ("cpu", "gpu", "tpu"), asked in a process of its own: a TPU belongs to one process at a
    time, and each job's process needs it."""
    done = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                          text=True, timeout=300)
    if done.returncode:
        raise SystemExit(f"JAX does not start here: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip()


def provenance(args):
    from importlib.metadata import PackageNotFoundError, version

    def v(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    commit = args.commit
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                    timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit, "nvidia_smi": driver,
            "python": sys.version.split()[0], "size": args.size, "part": args.part, "repeats": args.repeats,
            "versions": {n: v(n) for n in ("jax", "jaxlib", "flax", "sdflax", "torch", "diffusers", "transformers")}}


def work(job, args):
    """Run one job here -> its result."""
    if job["kind"] == "speed":
        worker = speed_sdflax if job["framework"] == "sdflax" else speed_diffusers
        return worker(job, args.size, args.repeats)
    if job["kind"] == "compile_split":
        return compile_split(job, args.size, args.repeats)
    if job["kind"] == "train":
        return (train_sdflax if job["framework"] == "sdflax" else train_diffusers)(job, args.size, args.repeats)
    return {"correctness": correctness, "flops": flop_count,
            "checkpoint": write_checkpoint}[job["kind"]](job, args.size)


def measures_start_up(job) -> bool:
    """Whether a job's figures include its process's start (the cold- and warm-cache jobs' `ready_s`)."""
    return job.get("cache") in ("cold", "warm")


def preload():
    """Import what the jobs import, once, so that the CPU run's forked jobs start with it: their imports (torch,
    diffusers' lazily loaded classes, jax, sdflax) cost more than the tiny models' work. Nothing is run: no device
    and no thread pool is started before a fork."""
    import diffusers
    import jax  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import sdflax.cli  # noqa: F401
    import sdflax.train  # noqa: F401
    from sdflax import StableDiffusion  # noqa: F401
    from sdflax.loading.assemble import build_models  # noqa: F401

    with contextlib.suppress(ImportError):  # the training jobs' (diffusers' side says so where it is missing)
        import peft  # noqa: F401
    for name in ("UNet2DConditionModel", "AutoencoderKL", "SD3Transformer2DModel", "StableDiffusionPipeline",
                 "StableDiffusionXLPipeline", "StableDiffusion3Pipeline", "PNDMScheduler", "EulerDiscreteScheduler",
                 "FlowMatchEulerDiscreteScheduler", "DDPMScheduler"):
        getattr(diffusers, name)


def job_environment(job) -> dict:
    """The environment of a job's fresh interpreter: this one's, sdflax from this checkout, the CPU for a FLOP
    count, and the job's XLA flag set after the user's XLA_FLAGS (XLA reads the last)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if job["kind"] == "flops":
        env["JAX_PLATFORMS"] = "cpu"
    if job.get("xla_flags"):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {XLA_FLAG_SETS[job['xla_flags']]}".strip()
    return env


def worker_command(job, args) -> list[str]:
    """The command line of a job's fresh interpreter: this script, given the job."""
    return [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job), "--size", args.size,
            "--repeats", str(args.repeats)]


class JobProcess:
    """One job running in a process of its own: forked from this one where `fork` (the CPU run, after `preload`)
    and the job does not measure its process's start, else a fresh interpreter. A forked job has its own JAX
    backend and caches and this process's imports; it is the CPU's only: JAX_PLATFORMS is already "cpu" there, and
    a job's XLA flags are read when its backend starts, after the fork."""

    def __init__(self, job, args, fork=False):
        self.start = time.perf_counter()
        if fork and not measures_start_up(job):
            import multiprocessing

            self.receive, send = multiprocessing.Pipe(duplex=False)
            self.process = multiprocessing.get_context("fork").Process(target=self._forked, args=(job, args, send))
            self.process.start()
            send.close()
        else:
            self.receive = None
            self.output, self.errors = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # never a full pipe
            self.process = subprocess.Popen(worker_command(job, args), env=job_environment(job), stdout=self.output,
                                            stderr=self.errors, text=True)

    @staticmethod
    def _forked(job, args, connection):
        import traceback

        global _JOB_START
        _JOB_START = time.perf_counter()
        if job.get("xla_flags"):
            os.environ["XLA_FLAGS"] = job_environment(job)["XLA_FLAGS"]
        try:
            connection.send({"result": work(job, args)})
        except BaseException:  # as a Python process ends on one: its traceback's tail, and status 1
            connection.send({"error": "\n".join(traceback.format_exc().strip().splitlines()[-15:])})
            sys.exit(1)

    def done(self) -> bool:
        return self.receive.poll() if self.receive else self.process.poll() is not None

    def result(self) -> dict:
        """The job's result, or {"error": ...}, once `done`."""
        if self.receive:
            try:
                message = self.receive.recv()
            except EOFError:  # the child died without a word (a signal, a crash in native code)
                message = {"error": "the job's process ended without a result"}
            self.process.join()
            status = self.process.exitcode
        else:
            status = self.process.wait()
            with self.output, self.errors:
                self.output.seek(0)
                self.errors.seek(0)
                message = {"result": json.loads(self.output.read().strip().splitlines()[-1])} if status == 0 else \
                    {"error": "\n".join(self.errors.read().strip().splitlines()[-15:])}
        wall_s = time.perf_counter() - self.start
        if "error" in message:
            return {"error": f"exit {status}: {message['error']}", "wall_s": wall_s}
        return {**message["result"], "wall_s": wall_s}

    def stop(self) -> dict:
        self.process.kill()
        if self.receive:
            self.process.join()
        else:
            self.process.wait()
            self.output.close()
            self.errors.close()
        return {"error": "stopped at the deadline", "wall_s": time.perf_counter() - self.start}


def needs(job, earlier) -> list[int]:
    """Which of the `earlier` jobs (a list) a job reads what they write of: a checkpoint its loader's, a cold
    compile cache its warm process's."""
    return [i for i, e in enumerate(earlier)
            if (e["kind"] == "checkpoint" and job.get("weights") == "checkpoint")
            or (e.get("cache") == "cold" and job.get("cache") == "warm" and e["family"] == job["family"])]


def run_jobs(jobs, args, deadline, fork=False, lanes=1):
    """Run `jobs` in processes of their own, up to `lanes` at once, each in order once the jobs it `needs` have
    ended -> yields (index, result) as each ends. One lane runs them in order. At the deadline a running job is
    stopped, and the ones not yet started are not run."""
    waiting, running = list(range(len(jobs))), {}
    while waiting or running:
        for i in [i for i in waiting if time.perf_counter() < deadline and
                  not set(needs(jobs[i], jobs[:i])) & {*waiting, *running}][:lanes - len(running)]:
            waiting.remove(i)
            log(f"job: {job_name(jobs[i])} ...")
            running[i] = JobProcess(jobs[i], args, fork)
        if not running:
            yield from ((i, {"error": "not run, past the deadline"}) for i in waiting)
            return
        for i, process in list(running.items()):
            if process.done() or time.perf_counter() > deadline:
                del running[i]
                yield i, process.result() if process.done() else process.stop()
        time.sleep(0.01)


def plan(chosen, cache_dir, checkpoint) -> list[dict]:
    """The chosen jobs and what they need, in the order one lane runs them: the checkpoint written before its
    first loader, each speed setting's FLOP count after its first job. The cold- and warm-cache jobs share one
    compile cache."""
    tasks = []
    for job in chosen:
        if job.get("cache") in ("cold", "warm"):
            job = {**job, "cache_dir": cache_dir}
        if job.get("weights") == "checkpoint":
            job = {**job, "checkpoint": checkpoint}
            if not any(task["kind"] == "checkpoint" for task in tasks):
                tasks.append({"kind": "checkpoint", "family": job["family"], "folder": checkpoint})
        tasks.append(job)
        if job["kind"] == "speed" and not any(task["kind"] == "flops" and setting_key(task) == setting_key(job)
                                              for task in tasks):
            tasks.append({"kind": "flops", **{k: job[k] for k in ("family", "setting", "steps", "guidance",
                                                                  "scheduler") if k in job}})
    return tasks


def job_name(job) -> str:
    return " ".join(str(job[k]) for k in ("kind", "framework", "family", "setting", "batches", "xla_flags")
                    if k in job)


def assemble(tasks, results, run_provenance) -> dict:
    """The report of the tasks that have ended (`results`: index -> result), in the tasks' order."""
    report = {"schema": SCHEMA, "provenance": run_provenance, "correctness": {},
              "speed": {"runs": [], "flops": [], "compile_split": []}, "training": [], "errors": []}
    counts = {}  # setting -> its FLOP count
    for i in sorted(results):
        task, result = tasks[i], results[i]
        if "error" in result:
            report["errors"].append(f"{job_name(task)}: {result['error']}")
        if task["kind"] == "correctness":
            report["correctness"][task["family"]] = result
        elif task["kind"] == "checkpoint":
            report["speed"]["checkpoint"] = {"family": task["family"], **result}
        elif task["kind"] == "compile_split":
            report["speed"]["compile_split"].append({**task, **result})
        elif task["kind"] == "flops":
            counts[setting_key(task)] = result
            report["speed"]["flops"].append({**task, **result})
        elif task["kind"] == "train":
            report["training"].append({**task, **result})
        else:
            report["speed"]["runs"].append({**{k: v for k, v in task.items() if k not in ("cache_dir", "checkpoint")},
                                            **result})
    add_ratios(report["speed"]["runs"], counts)
    add_training_ratios(report["training"])
    return report


def add_training_ratios(runs):
    """Each training row's steps per second and peak memory against diffusers' at the same family and batch."""
    baseline = {(run["family"], r["batch"]): r for run in runs if run["framework"] == "diffusers"
                for r in run.get("results", [])}
    for run in runs:
        for r in run.get("results", []):
            base = baseline.get((run["family"], r["batch"]))
            r["speedup_vs_diffusers"] = r["steps_per_s"] / base["steps_per_s"] if base else None
            r["memory_vs_diffusers"] = (r["peak_memory_bytes"] / base["peak_memory_bytes"]
                                        if base and r["peak_memory_bytes"] and base["peak_memory_bytes"] else None)


def setting_key(job):
    return job["family"], job.get("setting"), job["steps"]


def add_ratios(runs, counts):
    """Each row's achieved TFLOP/s from the setting's FLOP count (`counts`), and its speed against diffusers'
    plain (SDPA) row at the same setting and batch."""
    baseline = {(setting_key(run), r["batch"]): r["images_per_s"] for run in runs if run["framework"] == "diffusers"
                for r in run.get("results", [])}
    for run in runs:
        flops = (counts.get(setting_key(run)) or {}).get("flops_per_image")
        for r in run.get("results", []):
            r["flops_per_image"] = flops
            r["tflops_per_s"] = flops * r["images_per_s"] / 1e12 if flops else None
            base = baseline.get((setting_key(run), r["batch"]))
            r["speedup_vs_diffusers"] = r["images_per_s"] / base if base else None


def markdown(report):
    devices = [run["device"] for run in report["speed"]["runs"] if "device" in run]
    device = report["provenance"].get("nvidia_smi") or (devices[0] if devices else "?")
    lines = [f"Device: {device}. `python scripts/accelerator_report.py --part {report['provenance']['part']}`, "
             f"median of {report['provenance']['repeats']} calls after the first.", "",
             "| setting | framework | batch | s/image | images/s | vs diffusers | first call s | ready s | "
             "peak GiB | TFLOP/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, f="{:.3g}": "–" if x is None else f.format(x)  # noqa: E731
    for run in report["speed"]["runs"]:
        loaded = ", loaded" if run.get("weights") == "checkpoint" else ""
        name = run["framework"] + (f" ({run['attention']}, cache {run['cache']}{loaded})"
                                   if run["framework"] == "sdflax" else "") + \
            (f" {run['xla_flags']}" if run.get("xla_flags") else "")
        setting = (f"{run['family']}{' MLPerf' if run.get('setting') == 'mlperf' else ''} {run.get('height', '?')}px "
                   f"{run['steps']} steps")
        lines += table_rows(setting, name, run, 10, lambda r, peak: [
            fmt(r["seconds_per_image"]), fmt(r["images_per_s"]), fmt(r["speedup_vs_diffusers"], "{:.2f}x"),
            fmt(r["first_call_s"]), fmt(run.get("ready_s")), fmt(peak), fmt(r["tflops_per_s"])])
    if report.get("training"):
        lines += ["", "| LoRA training | framework | batch | steps/s | images/s | vs diffusers | first step s | "
                  "peak GiB | memory vs diffusers |", "|---|---|---|---|---|---|---|---|---|"]
        sizes = SIZES[report["provenance"]["size"]]
        for run in report["training"]:
            setting = f"{run['family']} rank {run['rank']} {sizes[run['family']]['size']}px"
            lines += table_rows(setting, run["framework"], run, 9, lambda r, peak: [
                fmt(r["steps_per_s"]), fmt(r["images_per_s"]), fmt(r["speedup_vs_diffusers"], "{:.2f}x"),
                fmt(r["first_step_s"]), fmt(peak), fmt(r["memory_vs_diffusers"], "{:.2f}x")])
    return "\n".join(lines)


def table_rows(setting, name, run, columns, cells) -> list[str]:
    """A run's Markdown rows, one per batch size: the setting, the framework, the batch and `cells(result, peak
    GiB)`; a run that failed is one row saying so."""
    if "error" in run:
        return [f"| {setting} | {name} | {run['batches']} | error |" + " |" * (columns - 4)]
    return [f"| {setting} | {name} | {r['batch']} | " + " | ".join(cells(
        r, r["peak_memory_bytes"] and r["peak_memory_bytes"] / 2 ** 30)) + " |" for r in run["results"]]


def write(report, path):
    report["table"] = markdown(report)
    tmp = Path(str(path) + ".part")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="the JSON report to write (a Markdown table beside it, .md)")
    p.add_argument("--part", choices=("all", "correctness", "sd15", "sdxl", "sd35", "compile", "flags", "train"),
                   default="all")
    p.add_argument("--family", choices=("sd15", "sdxl", "sd35"), help="only the jobs of this family's models")
    p.add_argument("--size", choices=("full", "tiny"), help="the models: full size (default on an accelerator) or "
                   "tiny (default on the CPU)")
    p.add_argument("--batch", type=int, help="only the speed jobs timing this batch size, at that size alone")
    p.add_argument("--repeats", type=int, default=3, help="timed calls after the first (default: 3)")
    p.add_argument("--deadline-s", type=float, default=570.0,
                   help="launch no job after this many seconds, and stop a running one there (default: 570)")
    p.add_argument("--commit", help="the commit measured (default: git's HEAD, where there is a git checkout)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # one job, in its own process
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(work(json.loads(args.worker), args)))
        return 0
    if not args.out:
        p.error("--out FILE.json is required")
    out = Path(args.out)
    if out.exists():
        p.error(f"{out} exists: give a new file (the report never overwrites one)")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    platform = device_platform()
    if args.size is None:
        args.size = "tiny" if platform == "cpu" else "full"
    deadline = _START + args.deadline_s
    fork = platform == "cpu"
    if fork:
        log("importing the jobs' libraries once, for the jobs forked from here ...")
        preload()
    run_provenance = {**provenance(args), "platform": platform}
    with tempfile.TemporaryDirectory() as cache_dir, tempfile.TemporaryDirectory() as checkpoint:
        tasks, results = plan(jobs(args.part, args.size, args.family, args.batch), cache_dir, checkpoint), {}
        if platform == "tpu":
            results = {i: {"error": "not run on a TPU (PyTorch has none here; its correctness reference runs on "
                                    "the host's CPU)"} for i, task in enumerate(tasks)
                       if task.get("framework", "").startswith("diffusers")}
        # the CPU's timings are no figures: two jobs at once there
        lanes = min(2, os.cpu_count() or 1) if platform == "cpu" else 1
        to_run = [i for i in range(len(tasks)) if i not in results]
        for i, result in run_jobs([tasks[i] for i in to_run], args, deadline, fork, lanes):
            results[to_run[i]] = result
            if "error" in result:
                log(f"  {job_name(tasks[to_run[i]])}: {result['error']}")
            write(assemble(tasks, results, run_provenance), out)
    report = assemble(tasks, results, run_provenance)
    write(report, out)
    out.with_suffix(".md").write_text(report["table"] + "\n")
    print(report["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
