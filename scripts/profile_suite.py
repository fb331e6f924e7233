"""Where the test suite's time goes, and the shortest it could take on this machine.

Runs pytest from the repository root (the README's `-q -n 2` unless pytest arguments follow `--`) with every Python
process it starts, the pytest-xdist workers and every subprocess the tests launch (the command line, the scripts,
the documentation's shell commands), reporting on exit its CPU time and the seconds its JAX spent tracing, lowering
and compiling programs (or loading them from the persistent cache; JAX times them on the clock, so a process
waiting for a core counts its wait: with no more busy processes than cores, as under `-n 2` on two, the clock is the
CPU). Then it prints:
- the wall time and the CPU seconds of the whole process tree;
- the compile work: those seconds summed over every process, and the *compile floor*, that sum over this machine's
  cores: the test time the suite would still take if running the models and the diffusers oracles, importing and
  everything else cost nothing, and the cores were never idle;
- the compile seconds of each test module in the pytest processes (tests/conftest.py's SDFLAX_TEST_COMPILE_REPORT)
  and the CPU seconds of the subprocesses by command.

Usage: python scripts/profile_suite.py [--out FILE.json] [-- PYTEST ARGS...]
Each process reports through a sitecustomize module put first on PYTHONPATH (it shadows any other sitecustomize
for the run), a forked one too; a process killed by a test reports nothing, its CPU time still counts in the tree's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASES = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
NAMES = {"jaxpr_trace_duration": "tracing", "jaxpr_to_mlir_module_duration": "lowering",
         "backend_compile_duration": "XLA"}

# Imports nothing heavy at start (a test checks that a module does not bring in torch or jax): JAX's listener is
# registered when the process first imports jax.
SITECUSTOMIZE = '''
import os
import sys

_OUT = os.environ.get("SDFLAX_PROFILE_SUITE")
if _OUT:
    import atexit
    import importlib.abc
    import importlib.util
    import json
    import resource

    _sums = {}

    def _listen(event, seconds, **_):
        if event.startswith("/jax/core/compile/"):
            name = event.rsplit("/", 1)[1]
            _sums[name] = _sums.get(name, 0.0) + seconds

    class _OnJaxImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "jax":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec("jax")
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.monitoring.register_event_duration_secs_listener(_listen)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _OnJaxImport())

    def _report():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        line = {"argv": sys.argv[:3], "pytest": "pytest" in sys.modules,
                "cpu_s": usage.ru_utime + usage.ru_stime, **_sums}
        with open(_OUT, "a") as f:
            f.write(json.dumps(line) + "\\n")

    atexit.register(_report)

    class _Token:  # what multiprocessing's after-fork registry holds on to
        pass

    _token = _Token()

    def _forked():
        """A forked child counts its own compiles; one of multiprocessing's ends in os._exit, which skips atexit,
        after running its finalizers (the accelerator report's jobs on the CPU)."""
        _sums.clear()
        util = sys.modules.get("multiprocessing.util")
        if util is not None:
            util.register_after_fork(_token, lambda _: util.Finalize(None, _report, exitpriority=0))

    os.register_at_fork(after_in_child=_forked)
'''


def command_label(argv) -> str:
    """A subprocess's command without its paths' folders: `__main__.py generate`, `run_modes_worker.py FOLDER`."""
    return " ".join(Path(arg).name if "/" in arg else arg for arg in argv[:2])[:60] or "python"


def summarize(processes: list[dict], modules: list[str], wall_s: float, tree_cpu_s: float, cores: int,
              returncode: int) -> dict:
    compile_s = {NAMES[phase]: sum(p.get(phase, 0.0) for p in processes) for phase in PHASES}
    total = sum(compile_s.values())
    by_command = collections.defaultdict(lambda: {"processes": 0, "cpu_s": 0.0, "compile_s": 0.0})
    for p in processes:
        if not p["pytest"]:  # the pytest processes' compiles are the modules' below
            row = by_command[command_label(p["argv"])]
            row["processes"] += 1
            row["cpu_s"] += p["cpu_s"]
            row["compile_s"] += sum(p.get(phase, 0.0) for phase in PHASES)
    per_module = collections.Counter()
    for line in modules:  # "<seconds compiling> <programs traced> <module>", one per module and worker
        seconds, _, module = line.split(maxsplit=2)
        per_module[module.strip()] += float(seconds)
    return {"pytest_exit": returncode, "wall_s": wall_s, "cpu_s": tree_cpu_s, "cores": cores,
            "python_processes": len(processes), "compile_s": {**compile_s, "total": total},
            "compile_floor_s": total / cores,
            "subprocesses": dict(sorted(by_command.items(), key=lambda item: -item[1]["cpu_s"])),
            "pytest_compile_s_by_module": dict(per_module.most_common())}


def show(summary: dict, top: int = 12) -> str:
    c = summary["compile_s"]
    lines = [f"wall {summary['wall_s']:.0f} s, CPU {summary['cpu_s']:.0f} s on {summary['cores']} cores, "
             f"{summary['python_processes']} Python processes (pytest exit {summary['pytest_exit']})",
             f"of which compiling {c['total']:.0f} s (tracing {c['tracing']:.0f}, lowering {c['lowering']:.0f}, "
             f"XLA {c['XLA']:.0f}): a compile floor of {summary['compile_floor_s']:.0f} s on {summary['cores']} "
             "cores",
             "", "compile seconds of the test modules in the pytest processes:"]
    lines += [f"  {seconds:7.1f}  {module}" for module, seconds in
              list(summary["pytest_compile_s_by_module"].items())[:top]]
    lines += ["", "subprocesses by command: CPU s, of which compiling, (processes):"]
    lines += [f"  {row['cpu_s']:7.1f} {row['compile_s']:7.1f}  ({row['processes']}) {command}"
              for command, row in list(summary["subprocesses"].items())[:top]]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    pytest_args = argv[split + 1:] or ["-q", "-n", "2"]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="also write the figures to this JSON file (never overwritten)")
    args = p.parse_args(argv[:split])
    if args.out and Path(args.out).exists():
        p.error(f"{args.out} exists: give a new file")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        report, modules = Path(tmp, "processes.jsonl"), Path(tmp, "modules.txt")
        env = {**os.environ, "SDFLAX_PROFILE_SUITE": str(report), "SDFLAX_TEST_COMPILE_REPORT": str(modules),
               "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=REPO, env=env)
        wall_s = time.perf_counter() - start
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        processes = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
        lines = modules.read_text().splitlines() if modules.exists() else []
    summary = summarize(processes, lines, wall_s, children.ru_utime + children.ru_stime, os.cpu_count() or 1,
                        done.returncode)
    print(show(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
