"""DeepCache's speed-up and image change on the SD 1.5 architecture (random weights): the whole text -> image
program with and without `sdflax.hooks.deep_cache`, each timed in fresh processes, medians reported.

    python scripts/benchmark_deep_cache.py                          # 512x512, 50 steps, interval 3, 3 processes each
    python scripts/benchmark_deep_cache.py --height 256 --width 256 --steps 10 --processes 2

Prints one JSON object: per mode the median seconds per call over the processes (each process: the median of
--repeats timed calls after its compile and first call) and its compile time; `speedup` (plain / DeepCache);
`image_change`: mean and max absolute difference of the two modes' images in [0, 1] (same prompt, same key).
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

HERE = Path(__file__).resolve().parent


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--height", type=int, default=512)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--interval", type=int, default=3, help="DeepCache's full-UNet interval (default: 3)")
    p.add_argument("--branch", type=int, default=1, help="DeepCache's skip connection (default: 1)")
    p.add_argument("--scheduler", default="ddim")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: float32 on the CPU, else bfloat16")
    p.add_argument("--processes", type=int, default=3, help="fresh processes per mode (default: 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per process (default: 3)")
    p.add_argument("--child", choices=("plain", "deep_cache"), help=argparse.SUPPRESS)
    p.add_argument("--images", help=argparse.SUPPRESS)
    return p


def child(args):
    """One mode in this process: compile, a first call, --repeats timed calls; the images to --images (.npy)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path[:0] = [str(HERE.parent), str(HERE)]  # this checkout's sdflax, and benchmark.py beside this file
    from benchmark import PROMPT, SD15, TOKENIZER, random_pipeline

    from sdflax import Inputs, Settings
    from sdflax.hooks.deep_cache import deep_cache

    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    pipeline, params = random_pipeline(SD15, TOKENIZER, getattr(jnp, dtype), args.scheduler)
    hooks = (deep_cache(args.interval, args.branch),) if args.child == "deep_cache" else None
    inputs = Inputs(prompt_ids=pipeline.prepare_inputs([PROMPT]), prng_seed=jax.random.key(0),
                    guidance_scale=jnp.float32(7.5), guidance_rescale=jnp.float32(0), hooks=hooks)
    settings = Settings(num_inference_steps=args.steps, height=args.height, width=args.width)
    start = time.perf_counter()
    compiled = pipeline._runner.jit.lower(pipeline.spec, params, inputs, settings).compile()
    compile_s = time.perf_counter() - start
    images = jax.block_until_ready(compiled(params, inputs)).images
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, inputs))
        times.append(time.perf_counter() - start)
    np.save(args.images, np.asarray(images, np.float32))
    print(json.dumps({"compile_s": compile_s, "seconds_per_call": statistics.median(times),
                      "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind, "dtype": dtype}))


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.child:
        return child(args)
    import numpy as np

    common = [f"--{name}={getattr(args, name)}" for name in ("height", "width", "steps", "interval", "branch",
                                                             "scheduler", "repeats")]
    common += [f"--dtype={args.dtype}"] if args.dtype else []
    runs, images = {"plain": [], "deep_cache": []}, {}
    with tempfile.TemporaryDirectory() as folder:
        for p in range(args.processes):
            for mode in runs:  # alternated, so that drifts in the machine's load hit both
                path = os.path.join(folder, f"{mode}.npy")
                print(f"process {p + 1}/{args.processes}: {mode} ...", file=sys.stderr)
                out = subprocess.run([sys.executable, __file__, f"--child={mode}", f"--images={path}", *common],
                                     check=True, capture_output=True, text=True)
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
                images[mode] = np.load(path)
    median = {mode: {key: statistics.median(r[key] for r in rs) for key in ("compile_s", "seconds_per_call")}
              for mode, rs in runs.items()}
    change = np.abs(images["deep_cache"] - images["plain"])
    print(json.dumps({
        "model": "SD 1.5 architecture, random weights", **{k: v for k, v in runs["plain"][0].items()
                                                           if k in ("backend", "device_kind", "dtype")},
        "height": args.height, "width": args.width, "steps": args.steps, "scheduler": args.scheduler,
        "interval": args.interval, "branch": args.branch, "processes": args.processes, "repeats": args.repeats,
        **median, "speedup": median["plain"]["seconds_per_call"] / median["deep_cache"]["seconds_per_call"],
        "image_change": {"mean_abs": float(change.mean()), "max_abs": float(change.max())},
        "seconds_per_call_all": {mode: [r["seconds_per_call"] for r in rs] for mode, rs in runs.items()},
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
