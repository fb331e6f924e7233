"""The first call of a pipeline at each LLVM optimisation level of XLA's CPU, each call in a fresh process: the
test suite's level 0 (tests/builders.py, FAST_COMPILE) against the pipelines' default, level 1.

    python scripts/benchmark_compile_levels.py                        # the tiny checkpoint in weights/tiny-sd
    python scripts/benchmark_compile_levels.py --model FOLDER --levels 1 0 --processes 5

A process loads the pipeline, makes one image (`--steps` steps at `--size` pixels, guidance 7.5) twice, and
reports the first call (tracing, compiling and running; the persistent compile cache off) and the second (running).
Per level, the medians over `--processes` processes and their range, as one JSON object; `first_call_ratio` and
`run_ratio` are each level's median over the first level's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_process(model: str, steps: int, size: int) -> dict:
    """In this process (XLA_FLAGS set by the caller): the first and the second call's seconds."""
    import jax

    from sdflax import StableDiffusion

    pipeline, params = StableDiffusion.from_pretrained(model)
    ids = pipeline.prepare_inputs(["a watercolor fox"])
    seconds = []
    for seed in range(2):
        start = time.perf_counter()
        pipeline(ids, params, jax.random.key(seed), num_inference_steps=steps, height=size, width=size,
                 guidance_scale=7.5).images.sum()
        seconds.append(time.perf_counter() - start)
    return {"first_call_s": seconds[0], "run_s": seconds[1]}


def spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "weights" / "tiny-sd"), help="an SD checkpoint folder or hub id")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 0], help="LLVM optimisation levels (first: baseline)")
    p.add_argument("--processes", type=int, default=3, help="fresh processes per level (default: 3)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--size", type=int, default=64, help="image side in pixels (default: 64)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(one_process(args.model, args.steps, args.size)))
        return 0
    if args.processes < 1:
        p.error("--processes must be at least 1")
    results = {}
    for level in args.levels:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false",
               "XLA_FLAGS": f"--xla_backend_optimization_level={level}"}
        runs = []
        for _ in range(args.processes):
            done = subprocess.run([sys.executable, __file__, "--worker", "--model", args.model, "--steps",
                                   str(args.steps), "--size", str(args.size)], env=env, capture_output=True,
                                  text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        results[level] = {name: spread([run[name] for run in runs]) for name in ("first_call_s", "run_s")}
    base = results[args.levels[0]]
    for level, figures in results.items():
        figures["first_call_ratio"] = figures["first_call_s"]["median"] / base["first_call_s"]["median"]
        figures["run_ratio"] = figures["run_s"]["median"] / base["run_s"]["median"]
    print(json.dumps({"model": args.model, "steps": args.steps, "size": args.size, "processes": args.processes,
                      "levels": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
