"""Checkpoint load time and peak host memory of `StableDiffusion.from_pretrained`, against diffusers' PyTorch load.

Writes, once, a full-size SD 1.5 checkpoint with random weights in diffusers layout (float32 safetensors, 4.3 GB:
UNet 3.4 GB) into `weights/sd15-random` (git ignores it), then loads it in fresh processes:
sdflax in float32 and bfloat16, and diffusers' `StableDiffusionPipeline.from_pretrained` in float32 as the
baseline. Peak memory: the process's maximum resident set, and the peak of its private (anonymous) memory, each
minus what it held before the load began; the second leaves out the memory-mapped checkpoint's page cache, so it
is what copies of the weights cost. Prints one JSON object.

    python scripts/benchmark_load.py                  # needs the test extra (torch, diffusers) to write the files
    python scripts/benchmark_load.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

MEASURE = r"""
import json, resource, sys, threading, time
which, folder, dtype = sys.argv[1:4]
def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def anon():  # private memory: what a copy of the weights costs (memory-mapped file pages are not counted)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
peak_anon, done = [anon()], threading.Event()
def watch():
    while not done.wait(0.005):
        peak_anon[0] = max(peak_anon[0], anon())
if which == "sdflax":
    import jax, jax.numpy as jnp
    from sdflax import StableDiffusion
    before, anon_before = rss(), anon()
    threading.Thread(target=watch, daemon=True).start()
    t = time.perf_counter()
    pipeline, params = StableDiffusion.from_pretrained(folder, dtype=getattr(jnp, dtype))
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(params)})
else:
    import torch
    from diffusers import StableDiffusionPipeline
    torch.set_num_threads(2)
    before, anon_before = rss(), anon()
    threading.Thread(target=watch, daemon=True).start()
    t = time.perf_counter()
    pipeline = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=getattr(torch, dtype), safety_checker=None)
    seconds = time.perf_counter() - t
    dtypes = sorted({str(p.dtype) for p in pipeline.unet.parameters()})
done.set()
print(json.dumps({"load_s": seconds, "peak_rss_increase_bytes": rss() - before,
                  "peak_anon_increase_bytes": max(peak_anon[0], anon()) - anon_before, "param_dtypes": dtypes}))
"""


def write_checkpoint(folder: Path):
    """SD 1.5's architecture with random weights, saved by diffusers' and transformers' own classes."""
    import torch
    from benchmark import SD15, TOKENIZER
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    UNet2DConditionModel(**SD15["unet"]).save_pretrained(folder / "unet")
    AutoencoderKL(**SD15["vae"]).save_pretrained(folder / "vae")
    text = {k: v for k, v in SD15["text_encoder"].items() if not k.startswith("_")}
    CLIPTextModel(CLIPTextConfig(**text)).save_pretrained(folder / "text_encoder")
    PNDMScheduler.from_config(SD15["scheduler"]).save_pretrained(folder / "scheduler")
    shutil.copytree(TOKENIZER, folder / "tokenizer", dirs_exist_ok=True)
    index = {"_class_name": "StableDiffusionPipeline", "scheduler": ["diffusers", "PNDMScheduler"],
             "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
             "safety_checker": [None, None], "feature_extractor": [None, None]}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def measure(which, folder, dtype):
    out = subprocess.run([sys.executable, "-c", MEASURE, which, str(folder), dtype], capture_output=True, text=True,
                         env={**os.environ, "XLA_FLAGS": ""})
    if out.returncode:
        sys.exit(f"{which} {dtype} load failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=REPO / "weights" / "sd15-random")
    parser.add_argument("--repeats", type=int, default=2, help="loads per configuration; the best is reported")
    args = parser.parse_args(argv)

    if not (args.folder / "model_index.json").is_file():
        print(f"writing a random SD 1.5 checkpoint to {args.folder} ...", file=sys.stderr)
        write_checkpoint(args.folder)
    unet_file = args.folder / "unet" / "diffusion_pytorch_model.safetensors"
    sizes = {"checkpoint_bytes": sum(f.stat().st_size for f in args.folder.rglob("*.safetensors")),
             "unet_bytes": unet_file.stat().st_size}

    results = {}
    for which, dtype in (("sdflax", "float32"), ("sdflax", "bfloat16"), ("torch", "float32")):
        runs = [measure(which, args.folder, dtype) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["load_s"])
        best["load_s_all"] = [r["load_s"] for r in runs]
        results[f"{which}_{dtype}"] = best
        print(f"{which} {dtype}: {best['load_s']:.2f} s", file=sys.stderr)

    bf16_size = sizes["checkpoint_bytes"] / 2
    report = {
        **sizes,
        **results,
        "ratio_load_s_sdflax_over_torch_float32": results["sdflax_float32"]["load_s"] / results["torch_float32"]["load_s"],
        "bfloat16_peak_anon_over_bf16_size": results["sdflax_bfloat16"]["peak_anon_increase_bytes"] / bf16_size,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
