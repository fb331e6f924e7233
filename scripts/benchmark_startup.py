"""Time to first image: what a user waits for in a fresh process, phase by phase, sdflax against the tools it
replaces. Every run is its own fresh process; each figure is the median of `--repeats` processes, with its range.

Two cases:

- `--case small` (default): `weights/tiny-sd` (UNet 32/64 channels, 128x128 images: 32x32 latents), 20 PNDM
  steps, guidance 7.5, one image, through the diffusers Flax walkthrough's calls (`from_pretrained`,
  `prepare_inputs`, `replicate`, `shard`, `pipeline(ids, params, rng, jit=True)`). The baseline is diffusers 0.39's
  `FlaxStableDiffusionPipeline` (the last diffusers with Flax classes, which needs transformers < 5), run from its
  own virtual environment and its own Flax msgpack copy of the checkpoint:

      python -m venv peer && peer/bin/pip install "diffusers==0.39.0" "transformers<5" jax flax torch==2.13.0
      python scripts/benchmark_startup.py --peer-python peer/bin/python --write-peer-folder
      peer/bin/pip uninstall -y torch       # torch only converts the checkpoint: the timed peer never needs it
      python scripts/benchmark_startup.py --peer-python peer/bin/python

  Without `--peer-python` only sdflax is timed.
- `--case sd15`: the SD 1.5 architecture, float32 safetensors with random weights (written once by
  `scripts/benchmark_load.py`), 256x256, 4 PNDM steps, against diffusers' PyTorch `StableDiffusionPipeline`
  (needs the test extra). sdflax runs `jit=False` (one device); the CLI row is `sdflax generate` writing one PNG
  with a warm compile cache, timed from the process's start to the PNG's last write and to its exit, beside a
  diffusers process that imports, loads, makes and saves the same image.

Phases (seconds): `import_s` (the framework and the library; `import_framework_s` the framework's part: jax.numpy
or torch), `backend_s` (JAX's CPU client, or nothing), `load_s` (`from_pretrained`, params on the device),
`first_call_s` (the first call, compiling included; for sdflax
also split into `trace_s`, `lower_s` and `compile_s` from JAX's monitoring events), `steady_s` (a later call with
the same shapes and new values), `to_first_image_s` (from the process's start to the first image in hand), and for
the PNG-writing processes `to_png_s` (to the file's last write) and `process_s` (to the exit). The `sdflax` row
starts with an empty cache folder (`SDFLAX_CACHE_DIR`: no compiled program, no parameter shapes), as on a user's
first run; `sdflax_warm_cache` is every later run (one untimed process filled the folder). Python's bytecode cache
is on, as a user's is (one untimed process writes it).
Prints one JSON object: every run's phases, the medians, their ranges, and the ratios sdflax / baseline.

    python scripts/benchmark_startup.py --case small --peer-python peer/bin/python --repeats 3
    python scripts/benchmark_startup.py --case sd15 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "a photo of an astronaut riding a horse on mars"
CASES = {
    "small": {"folder": REPO / "weights" / "tiny-sd", "steps": 20, "size": 128},
    "sd15": {"folder": REPO / "weights" / "sd15-random", "steps": 4, "size": 256},
}
PHASES = ("import_framework_s", "import_s", "backend_s", "load_s", "trace_s", "lower_s", "compile_s", "first_call_s",
          "steady_s", "to_first_image_s", "to_png_s", "process_s")

# Runs in the fresh process. argv: which, folder, steps, size, mode. Prints one JSON line of phases.
MEASURE = r"""
import json, os, sys, time
T = time.perf_counter
which, folder, steps, size, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
PROMPT = os.environ["STARTUP_PROMPT"]
phases, start = {}, T()

def timed(name, fn):
    t = T()
    out = fn()
    phases[name] = T() - t
    return out

if which == "torch":
    def imports():
        global torch, StableDiffusionPipeline
        timed("import_framework_s", lambda: __import__("torch"))
        import torch
        from diffusers import StableDiffusionPipeline
    timed("import_s", imports)
    phases["backend_s"] = 0.0
    pipe = timed("load_s", lambda: StableDiffusionPipeline.from_pretrained(folder, safety_checker=None))
    def call(seed):
        g = torch.Generator().manual_seed(seed)
        return pipe(PROMPT, num_inference_steps=steps, height=size, width=size, generator=g, output_type="np").images
    images = timed("first_call_s", lambda: call(0))
    phases["to_first_image_s"] = T() - start
    timed("steady_s", lambda: call(1))
else:
    def imports():
        global jax, np, replicate, shard, Pipeline
        timed("import_framework_s", lambda: __import__("jax.numpy"))
        import jax, numpy as np
        if which == "peer":
            from diffusers import FlaxStableDiffusionPipeline as Pipeline
            from flax.jax_utils import replicate
            from flax.training.common_utils import shard
        else:
            from sdflax import StableDiffusion as Pipeline, enable_compile_cache, replicate, shard
            enable_compile_cache()  # what a library user calls to keep compiled programs between processes
    timed("import_s", imports)
    timed("backend_s", lambda: jax.devices())
    from jax import monitoring
    EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
              "/jax/core/compile/backend_compile_duration": "compile_s"}
    def on_duration(event, duration, **kwargs):
        if event in EVENTS:
            phases[EVENTS[event]] = phases.get(EVENTS[event], 0.0) + duration
    def load():
        kwargs = {"safety_checker": None, "feature_extractor": None} if which == "peer" else {}
        pipeline, params = Pipeline.from_pretrained(folder, **kwargs)
        return pipeline, jax.block_until_ready(params)
    pipeline, params = timed("load_s", load)
    for name in EVENTS.values():
        phases[name] = 0.0
    monitoring.register_event_duration_secs_listener(on_duration)
    if mode == "pmap":  # the diffusers Flax walkthrough
        params = replicate(params)
        ids = shard(np.asarray(pipeline.prepare_inputs([PROMPT] * jax.local_device_count())))
        def call(seed):
            rng = jax.random.split(jax.random.PRNGKey(seed), jax.local_device_count())
            return np.asarray(pipeline(ids, params, rng, num_inference_steps=steps, height=size, width=size,
                                       jit=True).images)
    else:
        ids = pipeline.prepare_inputs([PROMPT])
        def call(seed):
            return pipeline(ids, params, jax.random.key(seed), num_inference_steps=steps, height=size, width=size,
                            jit=False).images
    images = timed("first_call_s", lambda: call(0))
    phases["to_first_image_s"] = T() - start
    monitoring.unregister_event_duration_listener(on_duration)
    timed("steady_s", lambda: call(1))
print(json.dumps(phases))
"""

# The baseline of `sdflax generate`: a diffusers process that makes and saves one image.
TORCH_PNG = r"""
import sys, torch
from diffusers import StableDiffusionPipeline
folder, steps, size, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None)
pipe(sys.argv[5], num_inference_steps=steps, height=size, width=size,
     generator=torch.Generator().manual_seed(0)).images[0].save(out)
"""

# Writes the peer's Flax copy of a PyTorch-format checkpoint (runs in the peer's environment, which needs torch).
WRITE_PEER = r"""
import os, shutil, sys, tempfile
import torch
from safetensors.torch import load_file
from diffusers import FlaxStableDiffusionPipeline
source, target = sys.argv[1:3]
with tempfile.TemporaryDirectory() as tmp:
    copy = os.path.join(tmp, "pt")
    shutil.copytree(source, copy)
    for model in ("unet", "vae", "text_encoder"):
        for name in os.listdir(os.path.join(copy, model)):
            if name.endswith(".safetensors"):  # diffusers 0.39's Flax from_pt reads .bin files only
                path = os.path.join(copy, model, name)
                stem = "pytorch_model" if model == "text_encoder" else "diffusion_pytorch_model"
                torch.save(load_file(path), os.path.join(copy, model, stem + ".bin"))
                os.remove(path)
    pipeline, params = FlaxStableDiffusionPipeline.from_pretrained(copy, from_pt=True, safety_checker=None,
                                                                   feature_extractor=None)
    pipeline.save_pretrained(target, params=params)
"""


def log(message):
    print(message, file=sys.stderr, flush=True)


def run(argv, env=None):
    """(stdout's last line as JSON or None, wall seconds of the whole process)."""
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if out.returncode:
        what = " ".join(str(a) for a in argv if "\n" not in str(a))
        sys.exit(f"{what} failed:\n{out.stderr[-3000:]}")
    lines = out.stdout.strip().splitlines()
    return (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None), wall


def until_written(argv, env, path):
    """A process that writes `path`: {"to_png_s": from its start to the file's last write, "process_s": to its exit}."""
    start = time.time()  # the file's mtime is wall-clock time too
    wall = run(argv, env)[1]
    return {"to_png_s": os.stat(path).st_mtime - start, "process_s": wall}


def measure(python, which, folder, case, mode, env):
    phases, wall = run([python, "-c", MEASURE, which, str(folder), str(case["steps"]), str(case["size"]), mode],
                       env)
    phases["process_wall_s"] = wall
    return phases


def summary(runs):
    keys = [k for k in runs[0] if all(isinstance(r.get(k), (int, float)) for r in runs)]
    return {"median": {k: statistics.median(r[k] for r in runs) for k in keys},
            "range": {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in keys},
            "runs": runs}


def ratios(ours, theirs):
    return {k: ours["median"][k] / theirs["median"][k] for k in ours["median"]
            if k in theirs["median"] and theirs["median"][k] > 0}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=sorted(CASES), default="small")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per row (default: 3)")
    p.add_argument("--peer-python", help="python of an environment with diffusers==0.39.0, transformers<5, jax, flax")
    p.add_argument("--peer-folder", type=Path, default=REPO / "weights" / "tiny-sd-flax",
                   help="the peer's Flax copy of weights/tiny-sd (default: weights/tiny-sd-flax)")
    p.add_argument("--write-peer-folder", action="store_true", help="write --peer-folder with the peer's "
                   "environment (which then needs torch) and stop")
    args = p.parse_args(argv)
    case = CASES[args.case]
    env = {**os.environ, "STARTUP_PROMPT": PROMPT, "XLA_FLAGS": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # Python's bytecode cache as a user's Python keeps it: with PYTHONDONTWRITEBYTECODE set, every process compiles
    # each module's source again (a quarter of a second for sdflax's), which no installed package pays.
    env.pop("PYTHONDONTWRITEBYTECODE", None)

    if args.write_peer_folder:
        if not args.peer_python:
            sys.exit("--write-peer-folder needs --peer-python")
        if args.peer_folder.exists():
            sys.exit(f"{args.peer_folder} exists: remove it first")
        run([args.peer_python, "-c", WRITE_PEER, str(case["folder"]), str(args.peer_folder)], env)
        log(f"wrote {args.peer_folder}")
        return 0
    if not (case["folder"] / "model_index.json").is_file():
        sys.exit(f"no checkpoint at {case['folder']}"
                 + (": python scripts/benchmark_load.py writes it" if args.case == "sd15" else ""))

    report = {"case": args.case, "steps": case["steps"], "size": case["size"], "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        def cold_env():  # a fresh, empty cache folder
            return {**env, "SDFLAX_CACHE_DIR": tempfile.mkdtemp(dir=tmp)}

        rows = {}
        mode = "pmap" if args.case == "small" else "jit"
        measure(sys.executable, "sdflax", case["folder"], case, mode, cold_env())  # writes the bytecode caches
        log(f"sdflax ({args.case}, cold cache) ...")
        rows["sdflax"] = [measure(sys.executable, "sdflax", case["folder"], case, mode, cold_env())
                          for _ in range(args.repeats)]
        warm = cold_env()
        measure(sys.executable, "sdflax", case["folder"], case, mode, warm)  # fills the cache
        log(f"sdflax ({args.case}, warm cache: a second process) ...")
        rows["sdflax_warm_cache"] = [measure(sys.executable, "sdflax", case["folder"], case, mode, warm)
                                     for _ in range(args.repeats)]
        if args.case == "small" and args.peer_python:
            if not (args.peer_folder / "model_index.json").is_file():
                sys.exit(f"no peer checkpoint at {args.peer_folder}: run with --write-peer-folder first")
            log("diffusers 0.39 Flax ...")
            peer_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
            measure(args.peer_python, "peer", args.peer_folder, case, mode, peer_env)  # writes the bytecode caches
            rows["peer"] = [measure(args.peer_python, "peer", args.peer_folder, case, mode, peer_env)
                            for _ in range(args.repeats)]
        if args.case == "sd15":
            log("diffusers PyTorch ...")
            rows["torch"] = [measure(sys.executable, "torch", case["folder"], case, mode, env)
                             for _ in range(args.repeats)]
            cli = [sys.executable, "-m", "sdflax", "generate", PROMPT, "--model", str(case["folder"]), "--steps",
                   str(case["steps"]), "--height", str(case["size"]), "--width", str(case["size"]), "--seed", "0"]
            run([*cli, "--out", os.path.join(tmp, "fill.png")], warm)  # the CLI's program, with its progress bar
            log("sdflax generate (warm compile cache) and a diffusers process ...")
            rows["cli"], rows["torch_png"] = [], []
            for i in range(args.repeats):
                out = os.path.join(tmp, f"cli{i}.png")
                rows["cli"].append(until_written([*cli, "--out", out], warm, out))
                out = os.path.join(tmp, f"torch{i}.png")
                rows["torch_png"].append(until_written([sys.executable, "-c", TORCH_PNG, str(case["folder"]),
                                                        str(case["steps"]), str(case["size"]), out, PROMPT], env, out))
    for name, runs in rows.items():
        report[name] = summary(runs)
    baseline = "peer" if "peer" in report else "torch" if "torch" in report else None
    if baseline:
        report[f"ratio_sdflax_over_{baseline}"] = ratios(report["sdflax"], report[baseline])
        report[f"ratio_sdflax_warm_cache_over_{baseline}"] = ratios(report["sdflax_warm_cache"], report[baseline])
    if "cli" in report:
        report["ratio_cli_over_torch_png"] = ratios(report["cli"], report["torch_png"])
        torch = report["torch"]["median"]  # the issue's yardstick: diffusers' load + first call, in its process
        report["ratio_cli_to_png_over_torch_load_and_first_call"] = (
            report["cli"]["median"]["to_png_s"] / (torch["load_s"] + torch["first_call_s"]))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
