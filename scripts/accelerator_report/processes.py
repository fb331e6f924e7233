"""The parent: the command line, and each job run in a process of its own, in order or two at once on the CPU."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .compile_split import compile_split
from .configs import REPO
from .correctness import correctness
from .jobs import XLA_FLAG_SETS, job_name, jobs, plan
from .models import write_checkpoint
from .report import assemble, provenance, write
from .speed import flop_count, speed_diffusers, speed_sdflax
from .timing import START, log, start_job_clock
from .training import train_diffusers, train_sdflax

SCRIPT = Path(__file__).resolve().parents[1] / "accelerator_report.py"  # the command line, which runs `main`


def device_platform() -> str:
    """JAX's platform here ("cpu", "gpu", "tpu"), asked in a process of its own: a TPU belongs to one process at a
    time, and each job's process needs it."""
    done = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                          text=True, timeout=300)
    if done.returncode:
        raise SystemExit(f"JAX does not start here: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip()


def work(job, args):
    """Run one job here -> its result."""
    if job["kind"] == "speed":
        worker = speed_sdflax if job["framework"] == "sdflax" else speed_diffusers
        return worker(job, args.size, args.repeats)
    if job["kind"] == "compile_split":
        return compile_split(job, args.size, args.repeats)
    if job["kind"] == "train":
        return (train_sdflax if job["framework"] == "sdflax" else train_diffusers)(job, args.size, args.repeats)
    return {"correctness": correctness, "flops": flop_count,
            "checkpoint": write_checkpoint}[job["kind"]](job, args.size)


def measures_start_up(job) -> bool:
    """Whether a job's figures include its process's start (the cold- and warm-cache jobs' `ready_s`)."""
    return job.get("cache") in ("cold", "warm")


def preload():
    """Import what the jobs import, once, so that the CPU run's forked jobs start with it: their imports (torch,
    diffusers' lazily loaded classes, jax, sdflax) cost more than the tiny models' work. Nothing is run: no device
    and no thread pool is started before a fork."""
    import diffusers
    import jax  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import sdflax.cli  # noqa: F401
    import sdflax.train  # noqa: F401
    from sdflax import Flux, StableDiffusion  # noqa: F401
    from sdflax.loading.assemble import build_models  # noqa: F401

    with contextlib.suppress(ImportError):  # the training jobs' (diffusers' side says so where it is missing)
        import peft  # noqa: F401
    for name in ("UNet2DConditionModel", "AutoencoderKL", "SD3Transformer2DModel", "FluxTransformer2DModel",
                 "StableDiffusionPipeline", "StableDiffusionXLPipeline", "StableDiffusion3Pipeline", "FluxPipeline",
                 "PNDMScheduler", "EulerDiscreteScheduler", "FlowMatchEulerDiscreteScheduler", "DDPMScheduler"):
        getattr(diffusers, name)


def job_environment(job) -> dict:
    """The environment of a job's fresh interpreter: this one's, sdflax from this checkout, the CPU for a FLOP
    count, and the job's XLA flag set after the user's XLA_FLAGS (XLA reads the last)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if job["kind"] == "flops":
        env["JAX_PLATFORMS"] = "cpu"
    if job.get("xla_flags"):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {XLA_FLAG_SETS[job['xla_flags']]}".strip()
    return env


def worker_command(job, args) -> list[str]:
    """The command line of a job's fresh interpreter: scripts/accelerator_report.py, given the job."""
    return [sys.executable, str(SCRIPT), "--worker", json.dumps(job), "--size", args.size,
            "--repeats", str(args.repeats)]


class JobProcess:
    """One job running in a process of its own: forked from this one where `fork` (the CPU run, after `preload`)
    and the job does not measure its process's start, else a fresh interpreter. A forked job has its own JAX
    backend and caches and this process's imports; it is the CPU's only: JAX_PLATFORMS is already "cpu" there, and
    a job's XLA flags are read when its backend starts, after the fork."""

    def __init__(self, job, args, fork=False):
        self.start = time.perf_counter()
        if fork and not measures_start_up(job):
            import multiprocessing

            self.receive, send = multiprocessing.Pipe(duplex=False)
            self.process = multiprocessing.get_context("fork").Process(target=self._forked, args=(job, args, send))
            self.process.start()
            send.close()
        else:
            self.receive = None
            self.output, self.errors = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # never a full pipe
            self.process = subprocess.Popen(worker_command(job, args), env=job_environment(job), stdout=self.output,
                                            stderr=self.errors, text=True)

    @staticmethod
    def _forked(job, args, connection):
        import traceback

        start_job_clock()
        if job.get("xla_flags"):
            os.environ["XLA_FLAGS"] = job_environment(job)["XLA_FLAGS"]
        try:
            connection.send({"result": work(job, args)})
        except BaseException:  # as a Python process ends on one: its traceback's tail, and status 1
            connection.send({"error": "\n".join(traceback.format_exc().strip().splitlines()[-15:])})
            sys.exit(1)

    def done(self) -> bool:
        return self.receive.poll() if self.receive else self.process.poll() is not None

    def result(self) -> dict:
        """The job's result, or {"error": ...}, once `done`."""
        if self.receive:
            try:
                message = self.receive.recv()
            except EOFError:  # the child died without a word (a signal, a crash in native code)
                message = {"error": "the job's process ended without a result"}
            self.process.join()
            status = self.process.exitcode
        else:
            status = self.process.wait()
            with self.output, self.errors:
                self.output.seek(0)
                self.errors.seek(0)
                message = {"result": json.loads(self.output.read().strip().splitlines()[-1])} if status == 0 else \
                    {"error": "\n".join(self.errors.read().strip().splitlines()[-15:])}
        wall_s = time.perf_counter() - self.start
        if "error" in message:
            return {"error": f"exit {status}: {message['error']}", "wall_s": wall_s}
        return {**message["result"], "wall_s": wall_s}

    def stop(self) -> dict:
        self.process.kill()
        if self.receive:
            self.process.join()
        else:
            self.process.wait()
            self.output.close()
            self.errors.close()
        return {"error": "stopped at the deadline", "wall_s": time.perf_counter() - self.start}


def needs(job, earlier) -> list[int]:
    """Which of the `earlier` jobs (a list) a job reads what they write of: a checkpoint its loader's, a cold
    compile cache its warm process's."""
    return [i for i, e in enumerate(earlier)
            if (e["kind"] == "checkpoint" and job.get("weights") == "checkpoint")
            or (e.get("cache") == "cold" and job.get("cache") == "warm" and e["family"] == job["family"])]


def run_jobs(jobs, args, deadline, fork=False, lanes=1):
    """Run `jobs` in processes of their own, up to `lanes` at once, each in order once the jobs it `needs` have
    ended -> yields (index, result) as each ends. One lane runs them in order. At the deadline a running job is
    stopped, and the ones not yet started are not run."""
    waiting, running = list(range(len(jobs))), {}
    while waiting or running:
        for i in [i for i in waiting if time.perf_counter() < deadline and
                  not set(needs(jobs[i], jobs[:i])) & {*waiting, *running}][:lanes - len(running)]:
            waiting.remove(i)
            log(f"job: {job_name(jobs[i])} ...")
            running[i] = JobProcess(jobs[i], args, fork)
        if not running:
            yield from ((i, {"error": "not run, past the deadline"}) for i in waiting)
            return
        for i, process in list(running.items()):
            if process.done() or time.perf_counter() > deadline:
                del running[i]
                yield i, process.result() if process.done() else process.stop()
        time.sleep(0.01)


def main(argv=None):
    from . import __doc__ as description  # the package's: how to run the report, what it measures, its JSON

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="the JSON report to write (a Markdown table beside it, .md)")
    p.add_argument("--part", choices=("all", "correctness", "sd15", "sdxl", "sd35", "flux", "compile", "flags",
                                       "train"), default="all")
    p.add_argument("--family", choices=("sd15", "sdxl", "sd35", "flux"), help="only the jobs of this family's models")
    p.add_argument("--size", choices=("full", "tiny"), help="the models: full size (default on an accelerator) or "
                   "tiny (default on the CPU)")
    p.add_argument("--batch", type=int, help="only the speed jobs timing this batch size, at that size alone")
    p.add_argument("--repeats", type=int, default=3, help="timed calls after the first (default: 3)")
    p.add_argument("--deadline-s", type=float, default=570.0,
                   help="launch no job after this many seconds, and stop a running one there (default: 570)")
    p.add_argument("--commit", help="the commit measured (default: git's HEAD, where there is a git checkout)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # one job, in its own process
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(work(json.loads(args.worker), args)))
        return 0
    if not args.out:
        p.error("--out FILE.json is required")
    lacking = [name for name in ("torch", "diffusers", "transformers") if importlib.util.find_spec(name) is None]
    if lacking:  # the oracle side: the runtime install has none of them
        p.error(f"the report compares sdflax with PyTorch's diffusers and lacks {', '.join(lacking)}: install the "
                "test extra (pip install -e '.[test]'), or on a GPU machine the wheels the docstring names")
    out = Path(args.out)
    if out.exists():
        p.error(f"{out} exists: give a new file (the report never overwrites one)")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    platform = device_platform()
    if args.size is None:
        args.size = "tiny" if platform == "cpu" else "full"
    deadline = START + args.deadline_s
    fork = platform == "cpu"
    if fork:
        log("importing the jobs' libraries once, for the jobs forked from here ...")
        preload()
    run_provenance = {**provenance(args), "platform": platform}
    with tempfile.TemporaryDirectory() as cache_dir, tempfile.TemporaryDirectory() as checkpoint:
        tasks, results = plan(jobs(args.part, args.size, args.family, args.batch), cache_dir, checkpoint), {}
        if platform == "tpu":
            results = {i: {"error": "not run on a TPU (PyTorch has none here; its correctness reference runs on "
                                    "the host's CPU)"} for i, task in enumerate(tasks)
                       if task.get("framework", "").startswith("diffusers")}
        # the CPU's timings are no figures: two jobs at once there
        lanes = min(2, os.cpu_count() or 1) if platform == "cpu" else 1
        to_run = [i for i in range(len(tasks)) if i not in results]
        for i, result in run_jobs([tasks[i] for i in to_run], args, deadline, fork, lanes):
            results[to_run[i]] = result
            if "error" in result:
                log(f"  {job_name(tasks[to_run[i]])}: {result['error']}")
            write(assemble(tasks, results, run_provenance), out)
    report = assemble(tasks, results, run_provenance)
    write(report, out)
    out.with_suffix(".md").write_text(report["table"] + "\n")
    print(report["table"])
    return 0
