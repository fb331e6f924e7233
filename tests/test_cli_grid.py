"""`sdflax grid`: each cell is the image `sdflax generate` makes with the cell's options (equal pixels), the cells of
one program compile once and a seed axis is one batch, the labels are drawn in the grid's bands, `--metrics` writes
the library's CLIP scores, and bad axis specs are one line and status 2."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from PIL import Image
from test_cli import TINY, pixels
from test_metrics import save_random_clip

from sdflax.cli import main

PROMPT = "a red fox in the snow"
COMMON = ["--model", TINY, "--steps", "2", "--height", "32", "--width", "32", "--seed", "5"]
GRID = ["grid", PROMPT, *COMMON, "--x", "seed=5,6", "--y", "cfg=3,12", "--no-progress"]
SAMPLING_PROGRAM = "run"  # the traced name of the pipelines' sharded program (pipeline/runner.py)


class Traces:
    """The names of the programs JAX traces inside the block."""

    def __enter__(self):
        self.names = []
        jax.monitoring.register_event_duration_secs_listener(self.on_duration)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self.on_duration)

    def on_duration(self, event, duration, fun_name="?", **kwargs):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            self.names.append(fun_name)


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The grid run once (with --metrics, on a random CLIP), a user's file already in the folder under the first
    cell's name."""
    tmp = tmp_path_factory.mktemp("grid")
    save_random_clip(tmp / "clip")
    out = tmp / "out"
    out.mkdir()
    (out / "a-red-fox-in-the-snow-x0-y0.png").write_bytes(b"the user's")
    with Traces() as traces:
        assert main([*GRID, "--metrics", "--clip", str(tmp / "clip"), "--out", str(out)]) == 0
    cells = json.loads((out / "a-red-fox-in-the-snow-grid-cells-run2.json").read_text())
    return tmp, out, cells, traces.names


def test_each_cell_is_what_generate_makes_with_its_options(grid, capsys):
    tmp, out, cells, _ = grid
    assert (out / "a-red-fox-in-the-snow-x0-y0.png").read_bytes() == b"the user's"  # never overwritten
    assert [(c["seed"], c["cfg"], c["place"]) for c in cells["cells"]] == [
        (5, "3", {"x": 0, "y": 0}), (6, "3", {"x": 1, "y": 0}), (5, "12", {"x": 0, "y": 1}),
        (6, "12", {"x": 1, "y": 1})]
    paths = [c["path"] for c in cells["cells"]]
    assert paths[0] == str(out / "a-red-fox-in-the-snow-x0-y0-run2.png")
    for cell in cells["cells"][3:]:  # the second row of its batch, and the second guidance's call
        alone = tmp / f"alone-{cell['seed']}-{cell['cfg']}.png"
        assert main(["generate", PROMPT, *COMMON, "--seed", str(cell["seed"]), "--guidance", cell["cfg"],
                     "--num-images", "1", "--no-progress", "--out", str(alone)]) == 0
        np.testing.assert_array_equal(pixels(cell["path"]), pixels(alone))
        text, theirs = Image.open(cell["path"]).text, Image.open(alone).text
        assert {k: v for k, v in text.items() if k != "parameters"} == {
            k: v for k, v in theirs.items() if k != "parameters"}
        assert text["guidance_scale"] == f"{float(cell['cfg'])}" and text["seed"] == str(cell["seed"])
    capsys.readouterr()
    images = [pixels(p).astype(np.float32) / 255 for p in paths]
    assert np.abs(images[0] - images[2]).mean() > 1e-2  # the guidance axis moves the picture
    assert np.abs(images[0] - images[1]).mean() > 1e-2  # and the seed axis


def test_cells_of_one_program_compile_once(grid):
    """Seeds are rows of one batch and guidance a traced number: four cells, one sampling program traced."""
    *_, names = grid
    assert names.count(SAMPLING_PROGRAM) == 1, names


def test_the_grid_is_the_cells_with_their_labels_and_clip_scores(grid):
    from sdflax import metrics
    from sdflax.cli.sheets import labelled_strip

    tmp, out, cells, _ = grid
    sheet = pixels(out / "a-red-fox-in-the-snow-grid-run2.png").astype(np.int32)
    paths = [c["path"] for c in cells["cells"]]
    cell_h = pixels(paths[0]).shape[0]
    scores = metrics.clip_scores([pixels(p) for p in paths], [PROMPT] * 4, metrics.load_clip(tmp / "clip"))
    np.testing.assert_allclose([c["clip_score"] for c in cells["cells"]], scores, rtol=1e-4, atol=1e-4)
    assert np.ptp(scores) > 1e-2  # the cells' scores differ: the numbers say which
    # The cells sit in the bottom-right corner, each with its CLIP caption under it.
    captioned = labelled_strip([Image.new("RGB", (32, cell_h))], ["CLIP 0.00"]).height
    left, top = sheet.shape[1] - 2 * 32, sheet.shape[0] - 2 * captioned
    for j in range(2):
        for i in range(2):
            y, x = top + j * captioned, left + i * 32
            np.testing.assert_array_equal(sheet[y:y + cell_h, x:x + 32], pixels(paths[2 * j + i]))
            caption = sheet[y + cell_h:y + captioned, x:x + 32]
            assert (caption.max(-1) < 96).sum() > 10  # the score written under the cell
    dark = sheet.max(-1) < 96  # black label text on the white bands
    for i in range(2):  # each column's label above it, each row's to the left of it
        assert dark[:top, left + i * 32:left + (i + 1) * 32].sum() > 10
        assert dark[top + i * captioned:top + (i + 1) * captioned, :left].sum() > 10
    assert not dark[:top, :left].any()  # nothing drawn in the corner
    assert dark[:top].sum() > 0 and (sheet[:top] == 255).mean() > 0.5  # the bands are white with dark text


@pytest.mark.parametrize("args, expected", [
    (["--x", "steps"], "argument --x: expected NAME=V1,V2,... with NAME an option of sdflax generate"),
    (["--x", "steps=2,"], "argument --x: expected NAME=V1,V2,..."),
    (["--x", "nope=1,2"], "--x nope=...: nope is no option of sdflax grid that takes a value"),
    (["--x", "out=a,b"], "--x out=...: out is no option"),
    (["--x", "steps=2,x"], "--x steps=x: expected a whole number, got 'x'"),
    (["--x", "sampler=Euler,Nope"], "--x sampler=Nope: "),
    (["--x", "steps=2,3", "--y", "steps=4"], "steps is on two axes"),
    (["--x", "steps=2,3", "--metrics"], "--metrics scores each cell with CLIP: add --clip"),
    (["--x", "steps=2,3", "--out", "grid.png"], "--out grid.png: sdflax grid writes a folder"),
])
def test_bad_axis_specs_are_one_line(args, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["grid", PROMPT, "--model", TINY, *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_help_and_bad_axes_start_without_jax(tmp_path):
    """`sdflax grid --help` and a bad axis answer where importing JAX fails (a `jax` that raises stands first)."""
    import os
    import subprocess
    import sys

    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text('raise ImportError("jax is not to be imported here")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    for args, code, expected in ((["grid", "--help"], 0, "--x NAME=V1,V2,..."),
                                 (["grid", "a fox", "--model", TINY, "--x", "nope=1"], 2, "nope is no option")):
        result = subprocess.run([sys.executable, "-m", "sdflax", *args], capture_output=True, text=True, env=env,
                                cwd=tmp_path)
        assert result.returncode == code and expected in result.stdout + result.stderr, result.stderr
        assert "Traceback" not in result.stderr
