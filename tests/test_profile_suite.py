"""scripts/profile_suite.py on one small test module in one process: its JSON holds the tree's CPU time, the compile
seconds of every Python process and the floor they make; pytest's exit status is the script's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "profile_suite.py"
MODULE = "tests/test_flow_match_scheduler.py"


def profile(tmp_path, *pytest_args):
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--", "-q", "-n", "0",
                           "-p", "no:cacheprovider", *pytest_args], capture_output=True, text=True, timeout=600)
    return done, (json.loads(out.read_text()) if out.exists() else None)


def test_the_figures_of_one_module(tmp_path):
    done, summary = profile(tmp_path, MODULE, "-k", "dynamic_shift")
    assert done.returncode == 0 == summary["pytest_exit"], done.stdout[-2000:] + done.stderr[-2000:]
    c = summary["compile_s"]
    assert c["tracing"] > 0 and c["lowering"] > 0 and c["XLA"] > 0
    assert c["total"] == pytest.approx(c["tracing"] + c["lowering"] + c["XLA"])
    assert summary["compile_floor_s"] == pytest.approx(c["total"] / summary["cores"])
    assert summary["python_processes"] >= 1 and summary["cpu_s"] > 0
    assert list(summary["pytest_compile_s_by_module"]) == [MODULE]  # the one module, its compiles counted
    assert f"a compile floor of {summary['compile_floor_s']:.0f} s" in done.stdout


def test_pytests_failure_is_the_scripts_and_an_existing_file_is_kept(tmp_path):
    done, summary = profile(tmp_path, "tests/no_such_module.py")
    assert done.returncode == summary["pytest_exit"] == 4  # pytest's "usage error": the file is not there
    kept = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(kept)], capture_output=True, text=True)
    assert done.returncode == 2 and "exists" in done.stderr and json.loads(kept.read_text()) == summary
