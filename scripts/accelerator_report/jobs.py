"""The jobs of each part of the report, as dicts: what each runs, in the order they are wanted."""

from __future__ import annotations

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
TRAIN_RANK = 4  # diffusers' LoRA scripts' default --rank


def settings(family, size):
    """The issue's settings for `family`: steps, guidance and the scheduler, (fewer steps for the tiny models)."""
    steps = {"sd15": 50, "sdxl": 30, "sd35": 28, "flux": 28}[family] if size == "full" else 2
    return {"family": family, "steps": steps,
            "guidance": {"sd15": 7.5, "sdxl": 5.0, "sd35": 7.0, "flux": 3.5}[family],  # Flux: dev's distilled one
            "scheduler": None}


def jobs(part: str, size: str, family: str | None = None, batch: int | None = None) -> list[dict]:
    """The jobs of a part (of one family's models where `family` is given; of the speed jobs timing that batch
    size where `batch` is), most wanted first (a deadline drops the last)."""
    full = size == "full"
    big = [1, 8] if full else [1, 2]
    sd15, sdxl, sd35, flux = (settings(family, size) for family in ("sd15", "sdxl", "sd35", "flux"))
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
        # FLUX.1-dev: its parity on small models, then batch 1 and batch 4 (last: `--batch 4` runs them alone)
        "flux": [{"kind": "correctness", "family": "flux"},
                 speed("sdflax", flux, [1], attention="auto", cache="none"), speed("diffusers", flux, [1]),
                 speed("sdflax", flux, [4], attention="auto", cache="none"), speed("diffusers", flux, [4])],
        # a LoRA update of sdflax.train against diffusers' LoRA scripts' step, bf16: SD 1.5 512² batch 8, SDXL 1024²
        # batch 2
        "train": [train(framework, family) for family in ("sd15", "sdxl") for framework in ("sdflax", "diffusers")],
    }
    if part == "all":  # the most wanted of each part first
        order = [("sd15", 0), ("sd15", 1), ("correctness", 0), ("sdxl", 0), ("sdxl", 1), ("sdxl", 2), ("sdxl", 3),
                 ("compile", 4), ("sd15", 2), ("sd15", 3), ("sd15", 4), ("correctness", 1), ("sd15", 5), ("sd15", 6),
                 ("sd35", 0), ("sd35", 1), ("train", 0), ("train", 1), ("train", 2), ("train", 3), ("flux", 0),
                 ("flux", 1), ("flux", 2), ("flux", 3), ("flux", 4)]
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


def setting_key(job):
    return job["family"], job.get("setting"), job["steps"]


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
