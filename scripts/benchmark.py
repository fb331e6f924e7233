"""Time sdflax's whole text -> image program (text encoder, scan, VAE decode), optionally against diffusers' PyTorch.

    python scripts/benchmark.py                                       # SD 1.5 architecture, random weights, 512x512
    python scripts/benchmark.py --height 256 --width 256 --steps 4 --compare torch
    python scripts/benchmark.py --model weights/tiny-sd --steps 2     # a checkpoint folder (or hub id)
    python scripts/benchmark.py --model sd35-medium-random --no-t5 --height 256 --width 256 --steps 2 --compare torch

Prints one JSON object on stdout (progress goes to stderr):
- load_s: building the pipeline and its params (reading files, or drawing random weights);
- compile_s: tracing, lowering and compiling the program (loading it when the disk cache is warm, see `cache`);
  first_call_s: its first run; first_image_s: the two together;
- seconds_per_call (median of --repeats calls, each waited on with block_until_ready), seconds_per_image,
  unet_steps_per_s (denoising steps, one UNet evaluation on the guidance batch each, per second of the whole call;
  SD 3.5: its transformer's, as `unet_evals` and `unet_eval_flops_per_image` count them);
- flops_per_image and tflops_per_s, from XLA's cost analysis. XLA counts a loop body once, so the scan's other
  `unet_evals - 1` iterations are added from the cost of one guided UNet evaluation (null without a cost analysis);
- peak_memory_bytes: the devices' peak, where the backend reports one (null on the CPU).
`--compare torch` adds `torch` (the same figures for diffusers' StableDiffusionPipeline or StableDiffusion3Pipeline
on one device, with the same FLOP count) and `ratio` (sdflax / torch per figure: below 1 is faster for times, above
1 for rates); sdflax and diffusers each run in a fresh process of their own, one after the other.

`--model sd15-random` (the default) builds SD 1.5 from sdflax's bundled configs with random weights: no download, the
same compute as the real weights. `--model sd35-medium-random` does the same for SD 3.5 Medium (by default as
diffusers' StableDiffusion3Pipeline runs it: 28 steps, guidance 7.0, 1024x1024, T5's 256 tokens), T5-XXL
included unless `--no-t5`: its 4.7 B parameters are 19 GB in float32, so on a machine with less memory `--no-t5`
runs SD 3.5 as diffusers does with `text_encoder_3=None` (T5's states zeros; the transformer's work is the same).
`--random-weights` does the same with a folder's configs (SD 1.x / 2.x, or SD 3.x: a folder with a transformer).

`--batch-prompts N` (with a checkpoint `--model`) times making N PNGs from N prompts two ways, each in a fresh
process: `sdflax batch` (--batch images per device, the writer thread overlapping PNG writing with the next
batch) and a loop of one `pipeline(...)` call per prompt, each image saved as a PNG. It prints `batch` and `loop`
(wall_s: the whole process, load and compile included; images_per_s: N / wall_s; steady_images_per_s: after the
first image or batch, compiling left out) and `ratio` (batch / loop images per second).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "weights" / "tiny-sd" / "tokenizer"  # the real CLIP BPE vocabulary
PROMPT = "a photo of an astronaut riding a horse on mars"

BUNDLED = REPO / "sdflax" / "configs"  # sdflax's copies of the published checkpoints' config.json files
COMPONENTS = ("text_encoder", "unet", "vae")
SD3_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")  # T5 last


def read_bundled_configs(folder, components) -> dict:
    """{component: config, "scheduler": config} of a published checkpoint from sdflax/configs/`folder`, read
    without importing sdflax (and JAX) so that --help stays quick."""
    configs = {c: json.loads((BUNDLED / folder / c / "config.json").read_text()) for c in components}
    configs["scheduler"] = json.loads((BUNDLED / folder / "scheduler" / "scheduler_config.json").read_text())
    for config in configs.values():
        # T5's "torch_dtype" (float16, how its weights are stored) would become the transformers config's dtype,
        # with a deprecation warning; the scripts choose each model's dtype themselves
        config.pop("torch_dtype", None)
    return configs


SD15 = read_bundled_configs("sd1", COMPONENTS)  # stable-diffusion-v1-5's
SD15_NAME = "sd15-random"
SD35_MEDIUM = read_bundled_configs("sd35_medium", SD3_COMPONENTS)  # stable-diffusion-3.5-medium's
SD35_NAME = "sd35-medium-random"
RANDOM_MODELS = {SD15_NAME: SD15, SD35_NAME: SD35_MEDIUM}
# a small SentencePiece (Unigram) vocabulary for T5's tokenizer: the compute depends on T5's embedding size and the
# sequence length, not on the vocabulary
T5_PIECES = ["<pad>", "</s>", "<unk>", "\u2581", *(f"\u2581{w}" for w in PROMPT.split()),
             *"abcdefghijklmnopqrstuvwxyz"]
RATIO_KEYS = ("load_s", "first_image_s", "seconds_per_call", "seconds_per_image", "unet_steps_per_s",
              "tflops_per_s", "peak_memory_bytes")


_START = time.perf_counter()


def log(message):
    print(f"[{time.perf_counter() - _START:6.1f} s] {message}", file=sys.stderr, flush=True)


def build_parser():
    from sdflax.cli.parse import scheduler_argument
    from sdflax.models.layers import ATTENTION_IMPLEMENTATIONS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=SD15_NAME, help=f"{SD15_NAME} (default), {SD35_NAME}, a diffusers folder or "
                   "a hub id")
    p.add_argument("--random-weights", action="store_true", help="the model's configs with random weights")
    p.add_argument("--no-t5", action="store_true", help=f"{SD35_NAME} (or an SD 3 folder's configs) without T5-XXL "
                   "(default: with it, 19 GB in float32): T5's states zeros, as diffusers' text_encoder_3=None")
    p.add_argument("--height", type=int, help="pixels (default: the model's own, 512 for SD 1.5, 1024 for SD 3.5)")
    p.add_argument("--width", type=int, help="pixels (default: the model's own)")
    p.add_argument("--steps", type=int, help=f"denoising steps (default: 50; 28 with {SD35_NAME})")
    p.add_argument("--batch", type=int, default=1, help="images per device and call (default: 1)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="default: bfloat16 on an accelerator, float32 on the CPU")
    p.add_argument("--scheduler", type=scheduler_argument, metavar="NAME", help="as `sdflax generate --scheduler`: "
                   "sdflax's name (dpmpp_2m, ...), a diffusers class name or A1111's (\"DPM++ 2M Karras\") "
                   "(default: the model's own)")
    p.add_argument("--attention", choices=ATTENTION_IMPLEMENTATIONS, default="auto",
                   help="UNet attention: cuDNN flash attention where it runs, else XLA (auto, the default), or "
                        "either forced")
    p.add_argument("--guidance", type=float,
                   help=f"classifier-free guidance scale (default: 7.5; 7.0 with {SD35_NAME})")
    p.add_argument("--repeats", type=int, default=3, help="timed calls after the first (default: 3)")
    p.add_argument("--compare", choices=("torch",), help="also time diffusers' PyTorch pipeline")
    p.add_argument("--cache-dir", help="JAX's compile cache (default: as `sdflax generate`)")
    p.add_argument("--no-cache", action="store_true", help="no persistent compile cache: always compile")
    p.add_argument("--batch-prompts", type=int, metavar="N", help="time `sdflax batch` on N prompts against a loop "
                   "of pipeline(...) calls (needs a checkpoint --model)")
    p.add_argument("--loop-worker", metavar="FOLDER", help=argparse.SUPPRESS)  # the loop's own process
    p.add_argument("--sdflax-worker", action="store_true", help=argparse.SUPPRESS)  # --compare's sdflax process
    p.add_argument("--torch-worker", metavar="JSON", help=argparse.SUPPRESS)  # --compare's diffusers process
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    sd35 = args.model == SD35_NAME
    args.steps = args.steps if args.steps is not None else 28 if sd35 else 50
    args.guidance = args.guidance if args.guidance is not None else 7.0 if sd35 else 7.5
    for name in ("steps", "batch", "repeats"):
        if getattr(args, name) < 1:
            return fail(f"--{name} must be at least 1")
    if args.no_t5 and not (sd35 or args.random_weights):
        return fail(f"--no-t5 leaves out SD 3.5's T5 encoder: it goes with --model {SD35_NAME} or --random-weights")
    if args.torch_worker:
        print(json.dumps(benchmark_torch(args, **json.loads(args.torch_worker))))
        return 0
    if args.loop_worker:
        return loop_worker(args)
    if args.batch_prompts is not None:
        return benchmark_batch(args)
    if args.compare == "torch" and not args.sdflax_worker:
        try:  # fail before minutes of JAX work
            import diffusers  # noqa: F401
            import torch  # noqa: F401
        except ImportError as e:
            return fail(f"--compare torch needs PyTorch and diffusers ({e}): pip install torch==2.13.0 "
                        "diffusers==0.39.0")
        # Both frameworks share the accelerator: JAX must not reserve most of its memory up front.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        return compare_torch(argv)

    import jax

    from sdflax.cache import cache_dir as default_cache_dir

    if args.no_cache:
        jax.config.update("jax_enable_compilation_cache", False)
        cache_dir = None
    else:
        cache_dir = os.path.expanduser(args.cache_dir) if args.cache_dir else default_cache_dir()
        if cache_dir:
            jax.config.update("jax_compilation_cache_dir", cache_dir)  # before the first compile, as sdflax.cli

    if args.attention == "cudnn" and jax.default_backend() != "gpu":
        return fail(f"--attention cudnn needs an NVIDIA GPU; this backend is {jax.default_backend()}")
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    try:
        result = benchmark_sdflax(args, dtype)
    except (OSError, ValueError) as e:
        return fail(str(e))
    result["cache"] = {"enabled": cache_dir is not None, "dir": cache_dir, "warm": result.pop("cache_hits") > 0}
    print(json.dumps(result, indent=2))
    return 0


def fail(message):
    log(f"benchmark: error: {' '.join(message.split())}")
    return 2


# ---- batch mode -----------------------------------------------------------------------------------------------

def batch_prompts(n):
    return [f"{PROMPT}, picture {i}" for i in range(n)]


def benchmark_batch(args):
    """`sdflax batch` against a loop of pipeline(...) calls on the same prompts, each in a fresh process."""
    import re
    import subprocess
    import tempfile

    if args.batch_prompts < 1:
        return fail("--batch-prompts must be at least 1")
    if args.model in RANDOM_MODELS or args.random_weights:
        return fail("--batch-prompts runs `sdflax batch`, which reads a checkpoint: give --model a diffusers folder "
                    "or hub id (scripts/benchmark_load.py writes the SD 1.5 architecture with random weights)")
    common = ["--model", args.model, "--steps", str(args.steps), "--guidance", str(args.guidance),
              "--attention", args.attention, *(["--height", str(args.height)] if args.height else []),
              *(["--width", str(args.width)] if args.width else []), *(["--dtype", args.dtype] if args.dtype else []),
              *(["--scheduler", args.scheduler] if args.scheduler else []),
              *(["--cache-dir", args.cache_dir] if args.cache_dir else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = {"prompts": args.batch_prompts, "batch_per_device": args.batch, "steps": args.steps}
    with tempfile.TemporaryDirectory() as folder:
        prompts = os.path.join(folder, "prompts.txt")
        with open(prompts, "w") as f:
            f.write("\n".join(batch_prompts(args.batch_prompts)) + "\n")
        log(f"sdflax batch on {args.batch_prompts} prompts ...")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "sdflax", "batch", prompts, "--out", os.path.join(folder, "b"),
                               "--seed", "0", "--batch-per-device", str(args.batch), *common], env=env,
                              capture_output=True, text=True)
        wall_s = time.perf_counter() - start
        if done.returncode:
            return fail(f"sdflax batch failed: {done.stderr.strip().splitlines()[-1]}")
        rates = re.findall(r"([\d.]+) images/s", done.stderr)
        result["batch"] = {"wall_s": wall_s, "images_per_s": args.batch_prompts / wall_s,
                           "steady_images_per_s": float(rates[-1]) if rates else None}
        log(f"a loop of pipeline(...) calls on {args.batch_prompts} prompts ...")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--loop-worker", folder,
                               "--batch-prompts", str(args.batch_prompts), *common], env=env, capture_output=True,
                              text=True)
        wall_s = time.perf_counter() - start
        if done.returncode:
            return fail(f"the pipeline loop failed: {done.stderr.strip().splitlines()[-1]}")
        result["loop"] = {"wall_s": wall_s, "images_per_s": args.batch_prompts / wall_s, **json.loads(done.stdout)}
    import jax

    result.update(backend=jax.default_backend(), devices=jax.local_device_count(),
                  device_kind=jax.local_devices()[0].device_kind, versions=versions("jax", "jaxlib", "sdflax"))
    result["ratio"] = {k: result["batch"][k] / result["loop"][k] for k in ("images_per_s", "steady_images_per_s")
                       if result["batch"].get(k) and result["loop"].get(k)}
    print(json.dumps(result, indent=2))
    return 0


def loop_worker(args):
    """One pipeline(...) call per prompt on one device, each image written as a PNG, as a script would."""
    import jax
    import jax.numpy as jnp

    from sdflax import StableDiffusion
    from sdflax.cache import cache_dir as default_cache_dir

    cache_dir = args.cache_dir or default_cache_dir()
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    pipeline, params = StableDiffusion.from_pretrained(args.model, dtype=getattr(jnp, dtype),
                                                       scheduler=args.scheduler, attention=args.attention)
    out = os.path.join(args.loop_worker, "loop")
    os.makedirs(out)
    first = None
    for i, prompt in enumerate(batch_prompts(args.batch_prompts)):
        images = pipeline(pipeline.prepare_inputs(prompt), params, jax.random.key(i), args.steps, args.height,
                          args.width, args.guidance).images
        pipeline.numpy_to_pil(images)[0].save(os.path.join(out, f"{i}.png"))
        if first is None:
            first = time.perf_counter()
    steady = (args.batch_prompts - 1) / (time.perf_counter() - first) if args.batch_prompts > 1 else None
    print(json.dumps({"steady_images_per_s": steady}))
    return 0


# ---- sdflax ---------------------------------------------------------------------------------------------------

def model_configs(args):
    """{model name: config dict, "scheduler": ...} and the CLIP tokenizer folder, or None for a checkpoint."""
    if args.model in RANDOM_MODELS:
        configs = RANDOM_MODELS[args.model]
        return {k: v for k, v in configs.items() if not (args.no_t5 and k == "text_encoder_3")}, TOKENIZER
    if not args.random_weights:
        return None, None
    from sdflax.cli import CONFIG_FILES
    from sdflax.loading.hub import resolve_folder
    from sdflax.models.config import read_config_file

    folder = resolve_folder(args.model, allow_patterns=CONFIG_FILES)  # configs and tokenizer, no weights
    sd3 = os.path.isfile(os.path.join(folder, "transformer", "config.json"))
    names = SD3_COMPONENTS[:len(SD3_COMPONENTS) - args.no_t5] if sd3 else COMPONENTS
    configs = {c: read_config_file(os.path.join(folder, c, "config.json")) for c in names}
    configs["scheduler"] = read_config_file(os.path.join(folder, "scheduler", "scheduler_config.json"))
    return configs, os.path.join(folder, "tokenizer")


def random_pipeline(configs, tokenizer_folder, dtype, scheduler=None, attention="auto", seed=0):
    """(StableDiffusion or StableDiffusion3, params) built from config dicts with random weights (SD 3 where they
    have a transformer; T5 where they have a text_encoder_3)."""
    import tempfile

    from sdflax import StableDiffusion, StableDiffusion3
    from sdflax.loading.assemble import build_models
    from sdflax.loading.folders import load_tokenizer
    from sdflax.models import (AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, SD3Transformer2DModel,
                               T5EncoderModel, UNet2DConditionModel)
    from sdflax.schedulers import scheduler_from_config
    from sdflax.loading.tokenizers import T5Tokenizer

    sd3 = "transformer" in configs
    classes = {"text_encoder": CLIPTextModelWithProjection, "text_encoder_2": CLIPTextModelWithProjection,
               "text_encoder_3": T5EncoderModel, "transformer": SD3Transformer2DModel, "vae": AutoencoderKL} if sd3 \
        else {"text_encoder": CLIPTextModel, "unet": UNet2DConditionModel, "vae": AutoencoderKL}
    modules = build_models({name: cls for name, cls in classes.items() if name in configs}, configs, dtype, attention)
    params = {name: random_params(module, seed + i, dtype) for i, (name, module) in enumerate(modules.items())}
    tokenizers = {"tokenizer": load_tokenizer(str(tokenizer_folder))}
    if sd3:
        tokenizers["tokenizer_2"] = load_tokenizer(str(tokenizer_folder), pad_token="!")  # SD 3's CLIP-G pads so
        if "text_encoder_3" in modules:
            with tempfile.TemporaryDirectory() as folder:
                tokenizers["tokenizer_3"] = T5Tokenizer.from_folder(write_t5_tokenizer(folder))
    pipeline = (StableDiffusion3 if sd3 else StableDiffusion)(
        scheduler=scheduler_from_config(configs["scheduler"], scheduler), dtype=dtype, **tokenizers, **modules)
    return pipeline, params


def write_t5_tokenizer(folder):
    """`folder` with a T5 tokenizer.json (a SentencePiece Unigram model, as transformers converts T5's) of a few
    pieces, `T5_PIECES`."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import Unigram

    backend = Tokenizer(Unigram([(p, 0.0 if i < 3 else -1.0 - 0.1 * i) for i, p in enumerate(T5_PIECES)], unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in T5_PIECES[:3]])
    backend.save(os.path.join(folder, "tokenizer.json"))
    return folder


def random_params(module, seed, dtype):
    """Random params of the module's parameter shapes (from sdflax's cache, as a loaded model's), drawn with numpy:
    `module.init_params` compiles one program per model (half a minute for tiny-sd's UNet on a CPU), which would
    swamp the load time. Kernels N(0, 1/fan_in) as flax's default (LeCun) init, norm scales 1, biases 0,
    embeddings N(0, 1); cast to `dtype` as loaded."""
    import jax
    import numpy as np

    from sdflax.cache import param_shapes

    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name, shape = path[-1].key, leaf.shape
        if name in ("bias", "scale"):
            value = np.full(shape, float(name == "scale"), np.float32)
        else:
            std = 1 / math.sqrt(math.prod(shape[:-1])) if name == "kernel" else 1.0
            value = rng.standard_normal(shape, np.float32) * np.float32(std)
        return jax.device_put(value.astype(dtype))

    return jax.tree_util.tree_map_with_path(draw, param_shapes(module))


def benchmark_sdflax(args, dtype_name):
    import jax
    import jax.numpy as jnp

    from sdflax import Inputs, Settings, StableDiffusion, replicate, shard
    from sdflax.pipeline import checks
    from sdflax.cli import CompileClock, scheduler_name

    dtype = getattr(jnp, dtype_name)
    attention = args.attention
    configs, tokenizer_folder = model_configs(args)
    log(f"Building {args.model} in {dtype_name} ({'random weights' if configs else 'checkpoint weights'}) ...")
    start = time.perf_counter()
    if configs:
        pipeline, params = random_pipeline(configs, tokenizer_folder, dtype, args.scheduler, attention)
    else:
        pipeline, params = StableDiffusion.from_pretrained(args.model, dtype=dtype, scheduler=args.scheduler,
                                                           attention=attention)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - start

    height, width = checks.sizes(pipeline.spec, args.height, args.width)
    devices = jax.local_device_count()
    b = args.batch
    ids = pipeline.prepare_inputs([PROMPT] * (b * devices))
    key = jax.random.key(0)
    inputs = Inputs(prompt_ids=ids, prng_seed=key, guidance_scale=jnp.asarray(args.guidance, jnp.float32),
                    guidance_rescale=jnp.asarray(0.0, jnp.float32))
    f = pipeline.vae_scale_factor
    settings = Settings(num_inference_steps=args.steps, height=height, width=width,
                        image_seq_len=pipeline.denoiser.image_seq_len(height // f, width // f))
    if devices == 1:  # what pipeline(...) runs on one device
        program, call_args = pipeline._runner.jit, (params, inputs)
    else:  # pipeline(..., jit=True): pmap over the local devices, `b` images each
        program = pipeline._runner.pmap
        call_args = (replicate(params), inputs.replace(prompt_ids=shard(ids), prng_seed=jax.random.split(key, devices)))
    all_args = (pipeline.spec, *call_args, settings)

    log(f"Compiling {args.steps} steps at {width}x{height}, {b} image(s) on each of {devices} "
        f"{jax.default_backend().upper()} device(s) ...")
    with CompileClock() as clock:
        start = time.perf_counter()
        compiled = program.lower(*all_args).compile()  # the spec and settings are its static arguments
        compile_s = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(*call_args))
    first_call_s = time.perf_counter() - start

    times = []
    for i in range(args.repeats):
        log(f"Timed call {i + 1}/{args.repeats} ...")
        start = time.perf_counter()
        jax.block_until_ready(compiled(*call_args))
        times.append(time.perf_counter() - start)
    seconds_per_call = statistics.median(times)

    latent_shape = (b, pipeline.denoiser.in_channels, height // f, width // f)
    evals = int(settings.scheduler(pipeline.scheduler).set_timesteps(args.steps, shape=latent_shape)
                .timesteps.shape[0])
    # FLOPs of one device's program: the scan body counted once by XLA, plus the other evals - 1 iterations.
    program_flops, eval_flops = count_flops(pipeline, compiled, program, all_args, params, latent_shape)
    flops_per_call = program_flops + (evals - 1) * eval_flops if program_flops and eval_flops else None
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    return {
        "model": args.model, "weights": "random" if configs else "checkpoint",
        "t5": "text_encoder_3" in params if getattr(pipeline, "transformer", None) is not None else None,
        "backend": jax.default_backend(), "device_kind": jax.local_devices()[0].device_kind, "devices": devices,
        "dtype": dtype_name, "attention": args.attention,
        "scheduler": args.scheduler or scheduler_name(pipeline.scheduler), "height": height, "width": width,
        "steps": args.steps, "unet_evals": evals, "batch_per_device": b,
        "images_per_call": b * devices, "guidance_scale": args.guidance, "repeats": args.repeats,
        "load_s": load_s, "compile_s": compile_s, "first_call_s": first_call_s,
        "first_image_s": compile_s + first_call_s, "seconds_per_call": seconds_per_call,
        "seconds_per_call_all": times, "seconds_per_image": seconds_per_call / (b * devices),
        "unet_steps_per_s": evals / seconds_per_call,
        "flops_per_image": flops_per_call and flops_per_call / b,
        "unet_eval_flops_per_image": eval_flops and eval_flops / b,
        "tflops_per_s": flops_per_call and flops_per_call * devices / seconds_per_call / 1e12,
        "peak_memory_bytes": max(peaks) if all(p is not None for p in peaks) else None,
        "versions": versions("jax", "jaxlib", "flax", "sdflax"),
        "cache_hits": clock.cache_hits,
    }


def count_flops(pipeline, compiled, program, all_args, params, latent_shape):
    """(FLOPs of the compiled program with its loop body once, FLOPs of one guided denoiser evaluation: the UNet,
    or SD 3's transformer), per device.

    cuDNN attention is a custom call XLA cannot count: then both come from the same program with XLA's attention,
    lowered but not compiled, so the figure is the model's work whatever the kernel."""
    import jax
    import jax.numpy as jnp

    from sdflax import Inputs, sampling

    if "cudnn" not in compiled.as_text():  # no cuDNN custom call: XLA counts everything
        program_flops = flops(compiled.cost_analysis())
    else:
        model = pipeline.denoiser.model
        twin = pipeline.replace(**{pipeline.denoiser.component: model.clone(
            kernels=dataclasses.replace(model.kernels, attention="xla"))})
        program_flops = flops(getattr(twin._runner, "jit" if program is pipeline._runner.jit else "pmap")
                              .lower(twin.spec, *all_args[1:]).cost_analysis())
        pipeline = twin
    spec, settings = pipeline.spec, all_args[-1]
    # the text conditioning's shapes for one device's 2b guidance rows (states, and SD 3's pooled projections)
    ids = pipeline.prepare_inputs([PROMPT] * latent_shape[0])
    cond = jax.eval_shape(lambda p, ids: spec.text.encode(p, Inputs(prompt_ids=ids), settings), params, ids)

    def denoiser_eval(denoiser_params, x, t, cond, scale):
        def denoiser_fn(x, t, context):
            return spec.denoiser(denoiser_params, x, t, context, **cond.unet_kwargs)

        return sampling.guided_model(denoiser_fn, cond.context, scale)(x, t)

    name = spec.denoiser.component
    lowered = jax.jit(denoiser_eval).lower({name: params[name]}, jax.ShapeDtypeStruct(latent_shape, jnp.float32),
                                           jax.ShapeDtypeStruct((), jnp.float32), cond,
                                           jax.ShapeDtypeStruct((), jnp.float32))
    return program_flops, flops(lowered.cost_analysis())


def flops(cost):
    """The FLOP count of a cost analysis, or None where the backend gives none."""
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost  # older JAX: one dict per program
    value = (cost or {}).get("flops")
    return float(value) if value and math.isfinite(value) and value > 0 else None


def versions(*names):
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


# ---- diffusers (PyTorch) --------------------------------------------------------------------------------------

def torch_pipeline(args, dtype, device):
    """diffusers' StableDiffusionPipeline (StableDiffusion3Pipeline) for the same model: the checkpoint, or its
    configs with random weights."""
    import tempfile

    import diffusers
    import torch
    import transformers

    from sdflax.schedulers import DIFFUSERS_NAMES, scheduler_from_config

    configs, tokenizer_folder = model_configs(args)
    strip = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
    if configs and "transformer" in configs:
        torch.manual_seed(0)
        clip = lambda c: transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**strip(c)))  # noqa: E731
        t5 = t5_tokenizer = None
        if "text_encoder_3" in configs:
            t5 = transformers.T5EncoderModel(transformers.T5Config(**strip(configs["text_encoder_3"])))
            with tempfile.TemporaryDirectory() as folder:
                t5_tokenizer = transformers.T5TokenizerFast(
                    tokenizer_file=os.path.join(write_t5_tokenizer(folder), "tokenizer.json"))
        pipe = diffusers.StableDiffusion3Pipeline(
            transformer=diffusers.SD3Transformer2DModel(**strip(configs["transformer"])),
            vae=diffusers.AutoencoderKL(**strip(configs["vae"])),
            text_encoder=clip(configs["text_encoder"]), text_encoder_2=clip(configs["text_encoder_2"]),
            text_encoder_3=t5, tokenizer=transformers.CLIPTokenizer.from_pretrained(str(tokenizer_folder)),
            tokenizer_2=transformers.CLIPTokenizer.from_pretrained(str(tokenizer_folder), pad_token="!"),
            tokenizer_3=t5_tokenizer,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_config(configs["scheduler"]))
    elif configs:
        torch.manual_seed(0)
        scheduler_class = getattr(diffusers, configs["scheduler"]["_class_name"])
        pipe = diffusers.StableDiffusionPipeline(
            vae=diffusers.AutoencoderKL(**strip(configs["vae"])),
            text_encoder=transformers.CLIPTextModel(transformers.CLIPTextConfig(**strip(configs["text_encoder"]))),
            tokenizer=transformers.CLIPTokenizer.from_pretrained(str(tokenizer_folder)),
            unet=diffusers.UNet2DConditionModel(**strip(configs["unet"])),
            scheduler=scheduler_class.from_config(configs["scheduler"]),
            safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    else:
        pipe = diffusers.StableDiffusionPipeline.from_pretrained(args.model, torch_dtype=dtype, safety_checker=None,
                                                                 requires_safety_checker=False)
    if args.scheduler:  # the class and config values sdflax runs, from the model's scheduler config
        ours = scheduler_from_config(dict(pipe.scheduler.config), args.scheduler)
        name = {cls: n for n, cls in DIFFUSERS_NAMES.items()}.get(type(ours))
        if name is None:
            raise SystemExit(fail(f"--compare torch: diffusers has no class for --scheduler {args.scheduler!r}"))
        pipe.scheduler = getattr(diffusers, name).from_config({**pipe.scheduler.config,
                                                               **dataclasses.asdict(ours.config)})
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device, dtype)


def compare_torch(argv):
    """sdflax's figures and diffusers', each from a fresh process of its own (one after the other: neither holds
    the device, nor memory, while the other runs), and their ratios."""
    ours = worker(argv + ["--sdflax-worker"], "sdflax")
    if ours is None:
        return 2
    needed = {"dtype_name": ours["dtype"], **{k: ours[k] for k in ("height", "width", "flops_per_image")}}
    theirs = worker(argv + ["--torch-worker", json.dumps(needed)], "diffusers")
    if theirs is None:
        return 2
    ratio = {k: ours[k] / theirs[k] for k in RATIO_KEYS if ours.get(k) and theirs.get(k)}
    print(json.dumps({**ours, "torch": theirs, "ratio": ratio}, indent=2))
    return 0


def worker(argv, name):
    """The JSON a run of this script with `argv` prints, its progress shown; None after saying why it failed."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=env, stdout=subprocess.PIPE,
                          text=True)
    if done.returncode:
        fail(f"the {name} process failed (exit {done.returncode}): see its messages above")
        return None
    return json.loads(done.stdout)


def benchmark_torch(args, dtype_name, height, width, flops_per_image):
    import diffusers
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, dtype_name)
    log(f"diffusers: building {args.model} in {dtype_name} on {device} ...")
    start = time.perf_counter()
    pipe = torch_pipeline(args, dtype, device)
    sync(device)
    load_s = time.perf_counter() - start

    b = args.batch  # what one sdflax device computes: torch runs on one device
    sd3 = isinstance(pipe, diffusers.StableDiffusion3Pipeline)
    extra = {"max_sequence_length": 256} if sd3 else {}  # T5's tokens, as sdflax's prepare_inputs
    call = functools.partial(pipe, [PROMPT] * b, height=height, width=width, num_inference_steps=args.steps,
                             guidance_scale=args.guidance, output_type="np", **extra)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        log("diffusers: first call ...")
        start = time.perf_counter()
        call(generator=torch.Generator(device).manual_seed(0))
        sync(device)
        first_call_s = time.perf_counter() - start
        times = []
        for i in range(args.repeats):
            log(f"diffusers: timed call {i + 1}/{args.repeats} ...")
            start = time.perf_counter()
            call(generator=torch.Generator(device).manual_seed(0))
            sync(device)
            times.append(time.perf_counter() - start)
    seconds_per_call = statistics.median(times)
    evals = len(pipe.scheduler.timesteps)
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "unet_evals": evals, "batch": b, "attention": "sdpa",
        "load_s": load_s, "first_call_s": first_call_s, "first_image_s": first_call_s,
        "seconds_per_call": seconds_per_call, "seconds_per_call_all": times, "seconds_per_image": seconds_per_call / b,
        "unet_steps_per_s": evals / seconds_per_call,
        # sdflax's count: the same model
        "tflops_per_s": flops_per_image and flops_per_image * b / seconds_per_call / 1e12,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "versions": versions("torch", "diffusers", "transformers"),
    }


def sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
