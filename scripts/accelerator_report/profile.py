"""Where one call's device time goes: its kernels' seconds from JAX's profiler, by kernel and by category."""

from __future__ import annotations

import glob
import tempfile
import time

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
