"""The documentation runs: README.md and every page of docs/, on tiny stand-ins of the models they name.

Conventions (what a page's author writes):
- ```python blocks of a page run in order in one namespace, in this process, in the page's own temporary working
  folder (on sys.path, as a script's folder is), offline (HF_HUB_OFFLINE=1), with the hub ids of
  tests/docs_standins.py (STANDINS) resolved from a Hugging Face cache of stand-ins and its FILES (photo.png,
  mask.png, loras/..., ..., and its large files linked) in the working folder.
- ```bash / ```sh blocks of a page run after its Python blocks, all in one `bash -euo pipefail` process, in the same
  folder, in a fresh interpreter per command as a new user's shell has (one CPU device, `sdflax` and `python` of
  this environment on PATH, `weights/` of the repository beside them), compiling as the suite does
  (compile_flags.FAST_COMPILE).
- A stated output is a `print(...)` line ending in a comment: `print(ids.shape)  # (1, 77)` fails unless the line
  prints exactly `(1, 77)`. In a shell block, a comment line `# writes PATH` (a glob) fails unless PATH exists after
  the page's commands ran.
- A block whose first line is `# not run in the tests: REASON` is skipped (and listed); there are at most
  MAX_NOT_RUN of them.
A block that raises, prints another stated output or writes no stated file fails its page's test, naming the block's
first line.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builders import REPO
from compile_flags import FAST_COMPILE
from docs_standins import standins

DOCS = REPO / "docs"
PAGES = ["README.md"] + sorted(str(p.relative_to(REPO)) for p in DOCS.rglob("*.md"))
NOT_RUN = "# not run in the tests:"
MAX_NOT_RUN = 6
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
STATED = re.compile(r"^(\s*)print\((.*)\)\s*#\s*(.+?)\s*$")
WRITES = re.compile(r"^\s*# writes (\S+)\s*$", re.M)


def blocks(text):
    """[(language, first line number, code)] of the fenced blocks of a page."""
    return [(m.group(1), text.count("\n", 0, m.start()) + 2, m.group(2)) for m in BLOCK.finditer(text)]


def runnable(page, languages):
    found = []
    for language, line, code in blocks((REPO / page).read_text()):
        if language in languages and not code.startswith(NOT_RUN):
            found.append((line, code))
    return found


def with_stated_outputs(code):
    """`print(x)  # text` -> a call that prints x and fails unless it printed `text`."""
    return "\n".join(STATED.sub(lambda m: f"{m.group(1)}__stated__({m.group(3)!r}, {m.group(2)})", line)
                     for line in code.splitlines())


def stated(expected, *args, **kwargs):
    out = io.StringIO()
    print(*args, **kwargs, file=out)
    printed = out.getvalue().rstrip("\n")
    print(printed)
    assert printed == expected, f"printed {printed!r}, the page says {expected!r}"


@pytest.fixture(scope="session")
def standin_root(tmp_path_factory):
    """Built once a session: in the folder every pytest-xdist worker of the session shares."""
    base = tmp_path_factory.getbasetemp()
    return standins((base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "docs-standins")


@pytest.fixture
def workdir(standin_root, tmp_path, monkeypatch):
    """The page's working folder with the FILES, and the stand-ins' cache as the Hugging Face cache."""
    import huggingface_hub.constants

    work = tmp_path / "work"
    shutil.copytree(standin_root / "files", work)
    os.symlink(REPO / "weights", work / "weights")
    for path in (standin_root / "large").iterdir():
        os.symlink(path, work / path.name)
    hub = str(standin_root / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", hub)  # read at import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    return work


def test_mkdocs_builds_strict(tmp_path):
    """A broken link, a page left out of the nav or a missing page fails the build."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # The README is outside docs/: its links to the pages are checked here.
    links = re.findall(r"\]\((docs/[^)#]+)", (REPO / "README.md").read_text())
    assert links and [link for link in links if not (REPO / link).is_file()] == []


def test_the_index_lists_every_page_and_the_command_line_page_every_option():
    """Friction: docs/index.md left out the SD 3.5 page, and docs/command-line.md --guider and --guider-arg."""
    from sdflax.cli.options import build_parser

    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    index, readme = (DOCS / "index.md").read_text(), (REPO / "README.md").read_text()
    assert [page for page in pages if f"]({page})" not in index] == []
    assert [page for page in pages if f"](docs/{page})" not in readme] == []
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    options = {option for name in ("generate", "img2img", "inpaint") for action in commands[name]._actions
               for option in action.option_strings if option.startswith("--") and action.help != argparse.SUPPRESS}
    documented = (DOCS / "command-line.md").read_text() + (DOCS / "img2img-inpainting.md").read_text()
    assert sorted(option for option in options - {"--help"}
                  if not re.search(re.escape(option) + r"(?![\w-])", documented)) == []


def test_few_blocks_are_not_run():
    skipped = [(page, line, code.splitlines()[0][len(NOT_RUN):].strip())
               for page in PAGES for language, line, code in blocks((REPO / page).read_text())
               if language in ("python", "bash", "sh") and code.startswith(NOT_RUN)]
    print("\n".join(f"{page}:{line}: {reason}" for page, line, reason in skipped))
    assert len(skipped) <= MAX_NOT_RUN, skipped


@pytest.mark.parametrize("page", [page for page in PAGES if runnable(page, ("python", "bash", "sh"))])
def test_page_runs(page, workdir):
    python, shell = runnable(page, ("python",)), runnable(page, ("bash", "sh"))
    namespace = {"__name__": "__main__", "__stated__": stated}
    for line, code in python:
        start = time.perf_counter()
        try:
            exec(compile(with_stated_outputs(code), f"{page}:{line}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{page}:{line}: the block `{code.splitlines()[0]}` failed: "
                                 f"{type(error).__name__}: {error}") from error
        print(f"{page}:{line}: {time.perf_counter() - start:.1f} s")
    if shell:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        env["XLA_FLAGS"] = FAST_COMPILE  # one CPU device, as a user's machine has; the suite's compiles
        script = "\n".join(f"# {page}:{line}\n{code}" for line, code in shell)
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workdir, env=env,
                                 capture_output=True, text=True)
        print(result.stdout, result.stderr, sep="\n")
        assert result.returncode == 0, f"{page}: a shell command failed:\n{result.stdout}\n{result.stderr}"
        for line, code in shell:
            for path in WRITES.findall(code):
                assert list(workdir.glob(path)), f"{page}:{line}: the page says {path} is written; it is not"
