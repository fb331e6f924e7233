"""The scripts' command lines: --help without PyTorch, one line and status 2 where PyTorch is needed and missing,
and benchmark.py's --scheduler read as `sdflax generate --scheduler` reads it. No model runs."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
# Runs a script as `python SCRIPT ARGS...` would, with `import torch` failing (a None in sys.modules makes every
# import of torch and its submodules raise ImportError).
WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = sys.argv[1:]; "
                 "runpy.run_path(sys.argv[0], run_name='__main__')")


def without_torch(script, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, str(SCRIPTS / script), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script", ["benchmark.py", "benchmark_kernels.py", "make_tiny_checkpoint.py",
                                    "benchmark_train.py",
                                    "accelerator_report.py", "benchmark_compile_flags.py", "profile_suite.py"])
def test_help_runs_without_torch(script):
    """Friction: `benchmark_kernels.py --help` and `make_tiny_checkpoint.py --help` failed without torch."""
    result = without_torch(script, "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("script, args", [("benchmark_kernels.py", ["--small", "--repeats", "1"]),
                                          ("make_tiny_checkpoint.py", ["--out", "{tmp}/tiny"])])
def test_a_run_that_needs_torch_says_how_to_install_it(script, args, tmp_path):
    result = without_torch(script, *(arg.format(tmp=tmp_path) for arg in args))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.rstrip().endswith("pip install torch==2.13.0"), result.stderr
    assert not (tmp_path / "tiny").exists()


def test_benchmark_scheduler_takes_the_names_the_cli_takes(capsys):
    """Friction: `scripts/benchmark.py --scheduler` took sdflax's names only, not A1111's."""
    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPTS / "benchmark.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    parser = benchmark.build_parser()
    for name in ("DPM++ 2M Karras", "Euler a SGM Uniform", "DPM++ 2M SDE (Heun)", "dpmpp_2m",
                 "EulerDiscreteScheduler"):
        assert parser.parse_args(["--scheduler", name]).scheduler == name
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--scheduler", "DDIM Karras"])
    assert exit_.value.code == 2
    assert "argument --scheduler: scheduler 'DDIM Karras': DDIM has no Karras σ schedule" in capsys.readouterr().err


def test_the_scripts_run_from_a_clone_with_the_runtime_install(tmp_path):
    """Friction: make_tiny_checkpoint.py's default tokenizer folder was outside the repository, and the accelerator
    report, which needs the test extra, ended in `ModuleNotFoundError: diffusers` in a runtime install."""
    spec = importlib.util.spec_from_file_location("make_tiny", SCRIPTS / "make_tiny_checkpoint.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    tokenizer = make_tiny.DEFAULT_TOKENIZER
    assert tokenizer.is_relative_to(SCRIPTS.parent) and (tokenizer / "vocab.json").is_file()

    result = without_torch("accelerator_report.py", "--out", tmp_path / "report.json")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "lacks torch" in result.stderr and "pip install -e '.[test]'" in result.stderr, result.stderr
    assert not (tmp_path / "report.json").exists()
