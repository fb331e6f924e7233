"""The first call of a pipeline on XLA's CPU under each setting of XLA_FLAGS, each call in a fresh process: by
default a user's (no flags: the pipelines' own options) against the test suite's (FAST_COMPILE in
tests/compile_flags.py).

    python scripts/benchmark_compile_flags.py                         # the tiny checkpoint in weights/tiny-sd
    python scripts/benchmark_compile_flags.py --processes 5 --flags= --flags=--xla_backend_optimization_level=0

A process loads the pipeline, makes one image (`--steps` steps at `--size` pixels, guidance 7.5) twice, and
reports the first call (tracing, compiling and running; the persistent compile cache off) in seconds and in CPU
seconds of all its threads (what two test workers on two cores share), and the second call (running). Per
setting, the medians over `--processes` processes and their range, as one JSON object; the ratios are each
setting's medians over the first setting's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES = ("first_call_s", "first_call_cpu_s", "run_s")


def suite_flags() -> str:
    """tests/compile_flags.py's FAST_COMPILE, read without importing the tests' package (or torch)."""
    spec = importlib.util.spec_from_file_location("compile_flags", REPO / "tests" / "compile_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FAST_COMPILE


def one_process(model: str, steps: int, size: int) -> dict:
    """In this process (XLA_FLAGS set by the caller): the first and the second call's seconds."""
    import jax

    from sdflax import StableDiffusion

    pipeline, params = StableDiffusion.from_pretrained(model)
    ids = pipeline.prepare_inputs(["a watercolor fox"])
    seconds, cpu_seconds = [], []
    for seed in range(2):
        start, cpu_start = time.perf_counter(), time.process_time()
        pipeline(ids, params, jax.random.key(seed), num_inference_steps=steps, height=size, width=size,
                 guidance_scale=7.5).images.sum()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    return {"first_call_s": seconds[0], "first_call_cpu_s": cpu_seconds[0], "run_s": seconds[1]}


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "weights" / "tiny-sd"), help="an SD checkpoint folder or hub id")
    p.add_argument("--flags", action="append", default=None, metavar="XLA_FLAGS",
                   help="one setting of XLA_FLAGS (--flags=...), repeated; the first is the baseline "
                        "(default: none, then the suite's FAST_COMPILE)")
    p.add_argument("--processes", type=int, default=3, help="fresh processes per setting (default: 3)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--size", type=int, default=64, help="image side in pixels (default: 64)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(one_process(args.model, args.steps, args.size)))
        return 0
    if args.processes < 1:
        p.error("--processes must be at least 1")
    settings = args.flags if args.flags is not None else ["", suite_flags()]
    results = {}
    for flags in settings:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false", "XLA_FLAGS": flags}
        runs = []
        for _ in range(args.processes):
            done = subprocess.run([sys.executable, __file__, "--worker", "--model", args.model, "--steps",
                                   str(args.steps), "--size", str(args.size)], env=env, capture_output=True,
                                  text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        results[flags] = {name: spread([run[name] for run in runs]) for name in FIGURES}
    base = results[settings[0]]
    for figures in results.values():
        for name in FIGURES:
            figures[name[:-2] + "_ratio"] = figures[name]["median"] / base[name]["median"]
    print(json.dumps({"model": args.model, "steps": args.steps, "size": args.size, "processes": args.processes,
                      "settings": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
