"""The XLA options of the suite's processes (no torch here: scripts/benchmark_compile_flags.py reads them too)."""

# On the CPU: LLVM's optimisation level 0, fusions emitted by XLA's elemental emitter instead of its MLIR fusion
# emitters, and each program's machine code made in one piece instead of split for parallel compilation (the two
# pytest-xdist workers keep both cores busy already). Each shortens the CPU time of the suite's compiles, which is
# most of its time (scripts/benchmark_compile_flags.py measures a pipeline's; the README gives the figures); runs
# of small tensors are slower by less, and the numbers move by float32 rounding alone (parity holds under these
# options and under XLA's defaults).
SUITE_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False,
                 "xla_cpu_parallel_codegen_split_count": 1}
# LLVM's level 1 in place of 0, for the programs that run much longer than they compile: the gradients through the
# sampler, whose runs level 0 slows most (the README's test section gives the figures).
RUN_OPTIONS = {**SUITE_OPTIONS, "xla_backend_optimization_level": 1}
# XLA's own values of those options: the compiles of the tests whose bit-exact or batch-invariant images are a
# promise under a user's flags (the batch-invariance test's processes run without FAST_COMPILE instead).
XLA_DEFAULTS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True,
                "xla_cpu_parallel_codegen_split_count": 32}
FAST_COMPILE = " ".join(f"--{name}={str(value).lower()}" for name, value in SUITE_OPTIONS.items())


def xla_flags(devices: int, *more: str) -> str:
    """XLA_FLAGS for a test process with `devices` CPU devices."""
    return " ".join((f"--xla_force_host_platform_device_count={devices}", FAST_COMPILE, *more))
