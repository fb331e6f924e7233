"""The report: its JSON from the jobs' results, the speed rows' ratios, and the Markdown table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .configs import REPO, SIZES
from .jobs import job_name, setting_key

SCHEMA = 1


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
