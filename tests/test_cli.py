"""`sdflax generate` end to end on weights/tiny-sd, in subprocesses; bad input in process (it fails before JAX)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from compile_flags import xla_flags

from sdflax.cli import StepBar, grid_shape, main, png_info, slug
from sdflax.cli.output import OutputTarget

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "weights" / "tiny-sd")


def run_cli(args, tmp, devices=2, cwd=None, env=None):
    """`python -m sdflax ...` of this checkout (not another one an editable install points at) on `devices` CPU
    devices, offline, with its compile cache in `tmp`."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "XLA_FLAGS": xla_flags(devices), "JAX_PLATFORMS": "cpu",
           "HF_HUB_OFFLINE": "1", "SDFLAX_CACHE_DIR": str(tmp / "jax-cache"), "PYTHONPATH": path,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **(env or {})}  # cache every program: no timing
    return subprocess.run([sys.executable, "-m", "sdflax", *args], cwd=cwd or tmp, env=env, capture_output=True,
                          text=True, timeout=600)


def pixels(path):
    return np.asarray(Image.open(path).convert("RGB"))


def rows(arrays, keys):
    """One image's arrays repeated for each of the CLI's rows (one per device, a key each)."""
    return [np.repeat(x, len(keys), 0) for x in arrays]


def close_to(png, expected):
    """uint8 PNG pixels against the library's float image: rounding (at most one level)."""
    assert expected.std() > 0.05  # not a blank image: the comparison means something
    assert np.abs(pixels(png).astype(np.float32) - np.round(expected * 255)).max() <= 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs with the same static settings: seeds 3, 4, then 4, 5 (the second loads the compiled program, and
    draws the step bar, which is not in the program)."""
    tmp = tmp_path_factory.mktemp("cli")
    common = ["generate", "a red fox, watercolor", "--model", TINY, "--steps", "2", "--height", "64", "--width", "96",
              "--num-images", "2", "--grid", "--negative-prompt", "blurry"]
    first = run_cli([*common, "--no-progress", "--seed", "3", "--out", str(tmp / "a")], tmp)
    second = run_cli([*common, "--progress", "--seed", "4", "--out", str(tmp / "b")], tmp)
    for result in (first, second):
        assert result.returncode == 0, result.stderr
    return tmp, first, second


def test_writes_pngs_of_the_requested_size_with_their_settings(runs):
    tmp, first, _ = runs
    written = first.stdout.split()
    assert written == [str(tmp / "a" / n) for n in ("a-red-fox-watercolor-3.png", "a-red-fox-watercolor-4.png",
                                                    "a-red-fox-watercolor-3-grid.png")]
    for path, seed in zip(written, (3, 4)):
        image = Image.open(path)
        assert image.size == (96, 64) and image.mode == "RGB"
        assert {k: image.text[k] for k in ("prompt", "negative_prompt", "seed", "steps", "scheduler",
                                           "guidance_scale", "width", "height", "model", "revision", "dtype")} == {
            "prompt": "a red fox, watercolor", "negative_prompt": "blurry", "seed": str(seed), "steps": "2",
            "scheduler": "pndm", "guidance_scale": "7.5", "width": "96", "height": "64", "model": TINY,
            "revision": "", "dtype": "float32"}
        assert image.text["parameters"].startswith("a red fox, watercolor\nNegative prompt: blurry\nSteps: 2, ")
    grid = Image.open(written[2])
    assert grid.size == (2 * 96, 64) and grid.text["seeds"] == "3,4"
    np.testing.assert_array_equal(pixels(written[2])[:, :96], pixels(written[0]))
    np.testing.assert_array_equal(pixels(written[2])[:, 96:], pixels(written[1]))
    assert re.fullmatch(r"seed 3: load [\d.]+ s, compile [\d.]+ s.*, generate [\d.]+ s for 2 image\(s\)\n",
                        first.stderr)  # --no-progress: the timing line only


def test_a_seed_gives_the_same_pixels_and_other_seeds_other_pixels(runs):
    tmp, _, second = runs
    a, b = tmp / "a", tmp / "b"
    # Seed 4 was image 1 (device 1) of the first run and is image 0 (device 0) of the second.
    assert pixels(a / "a-red-fox-watercolor-4.png").tobytes() == pixels(b / "a-red-fox-watercolor-4.png").tobytes()
    assert not np.array_equal(pixels(a / "a-red-fox-watercolor-3.png"), pixels(b / "a-red-fox-watercolor-5.png"))
    assert not np.array_equal(pixels(a / "a-red-fox-watercolor-3.png"), pixels(a / "a-red-fox-watercolor-4.png"))
    assert "(from the disk cache)" in second.stderr  # a new seed, and the bar, reuse the first run's program
    assert "denoising: " in second.stderr and "(first run: no estimate)" in second.stderr  # no pace kept before
    paces = json.loads((tmp / "jax-cache" / StepBar.FILE).read_text())
    assert len(paces) == 1 and next(iter(paces.values())) > 0  # this run's, for the next
    assert any(name.startswith(("jit", "pmap")) for name in os.listdir(tmp / "jax-cache"))


def test_readme_offline_command_runs_as_written(tmp_path):
    """The README's `sdflax generate ... weights/tiny-sd` line, with --out moved into a tmp folder."""
    readme = (ROOT / "README.md").read_text()
    lines = [line for line in readme.splitlines() if line.startswith("sdflax generate") and "weights/tiny-sd" in line]
    assert len(lines) == 1, lines
    args = shlex.split(lines[0])[1:]  # "generate", ...: the test runs `python -m sdflax`, the same command
    out = args.index("--out") + 1
    assert not os.path.isabs(args[out])
    args[out] = str(tmp_path / args[out])
    result = run_cli(args, tmp_path, devices=2, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    paths = result.stdout.split()
    assert paths and all(os.path.isfile(p) and p.startswith(str(tmp_path)) for p in paths)
    assert "Compiling for" in result.stderr


def test_python_dash_m_and_help():
    assert main(["--help"]) == 0
    assert main(["generate", "--help"]) == 0
    result = subprocess.run([sys.executable, "-m", "sdflax"], capture_output=True, text=True)
    assert result.returncode == 2 and "generate" in result.stderr


def test_help_and_argument_errors_start_without_jax(tmp_path):
    """A light start: `import sdflax` imports no JAX (its names load on first use), and the command answers --help
    and a bad flag where importing JAX fails (a `jax` that raises stands in front of the real one)."""
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text('raise ImportError("jax is not to be imported here")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", "import sys, sdflax; sdflax.Pipeline"], capture_output=True,
                            text=True, env=env)
    assert "jax is not to be imported here" in result.stderr  # the stand-in is what `import jax` finds
    result = subprocess.run([sys.executable, "-c", "import sys, sdflax, sdflax.cli; print(sorted(m for m in "
                             "sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')))"], capture_output=True,
                            text=True)
    assert result.returncode == 0 and result.stdout == "[]\n", result.stderr
    from sdflax.cli.options import ATTENTION_IMPLEMENTATIONS
    from sdflax.models.layers import ATTENTION_IMPLEMENTATIONS as MODELS_TAKE

    assert ATTENTION_IMPLEMENTATIONS == MODELS_TAKE  # --attention's choices, written out in the command line
    for args, code, expected in ((["generate", "--help"], 0, "--guidance SCALE"),
                                 (["generate", "a fox", "--steps", "0"], 2, "--steps: must be at least 1, got 0")):
        result = subprocess.run([sys.executable, "-m", "sdflax", *args], capture_output=True, text=True, env=env)
        assert result.returncode == code and expected in result.stdout + result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def assert_help_lists(capsys, *options):
    """Each of the three image commands' --help names every option."""
    for command in ("generate", "img2img", "inpaint"):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert all(option in out for option in options), out


def one_error_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("args, expected", [
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--scheduler", "warp-drive"], "argument --scheduler: unknown scheduler 'warp-drive'; known: ddim"),
    (["--scheduler", "DDIM Karras"], "argument --scheduler: scheduler 'DDIM Karras': DDIM has no Karras σ schedule"),
    (["--height", "130"], "--height 130 is not a multiple of 4, the VAE scale factor of"),
    (["--width", "130", "--height", "128"], "use 128 or 132"),
    (["--seed", "-1"], "argument --seed: must be between 0 and 4294967295"),
    (["--out", "pictures.jpg"], "sdflax writes PNG files"),
    (["--revision", "v2"], "--revision applies to hub ids"),
    (["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
    (["--attention", "cudnn", "--dtype", "float32"], "--attention cudnn needs an NVIDIA GPU and --dtype bfloat16"),
])
def test_bad_input_is_one_line_and_status_2(args, expected, capsys, tmp_path):
    assert main(["generate", "a fox", "--model", TINY, "--out", str(tmp_path / "out"), *args]) == 2
    assert expected in one_error_line(capsys)


@pytest.mark.parametrize("flag", [None, "--negative-prompt", "--prompt-2", "--prompt-3"])
def test_a_prompt_that_is_not_utf8_is_one_line(flag, capsys, tmp_path):
    """Bytes that are not UTF-8 on the command line (Python keeps them as lone surrogates) ended in a tokenizer's
    TypeError."""
    text = os.fsdecode(b"a \xff fox")
    args = ["generate", text] if flag is None else ["generate", "a fox", flag, text]
    assert main([*args, "--model", TINY, "--out", str(tmp_path / "out")]) == 2
    assert f"argument {flag or 'prompt'}: 'a \ufffd fox' is not UTF-8 text" in one_error_line(capsys)


def test_a_negative_number_in_exponent_form_is_an_argument_not_an_option():
    """`--guidance -1e6` was "expected one argument": argparse took -1e6 for an option."""
    from sdflax.cli.options import build_parser

    assert build_parser().parse_args(["generate", "a fox", "--guidance", "-1e6"]).guidance == -1e6
    assert build_parser().parse_args(["generate", "a fox", "--guidance", "-2.5E-1"]).guidance == -0.25


def test_a_check_of_the_librarys_is_one_line_and_a_bug_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    """A ValueError raised by one of sdflax's checks that the command line's own did not catch first (a guider with
    a CFG++ scheduler was one) is the user's one line; one raised inside numpy is a bug, shown whole."""
    import sdflax.cli.run
    from sdflax.schedulers.common import checked_schedule

    args = ["generate", "a fox", "--model", TINY, "--out", str(tmp_path / "out")]
    monkeypatch.setattr(sdflax.cli.run, "run", lambda request: checked_schedule("timesteps", [1, 2], 1000))
    assert main(args) == 2
    assert "sdflax: error: timesteps=[1, 2] must be strictly descending" in one_error_line(capsys)
    monkeypatch.setattr(sdflax.cli.run, "run", lambda request: np.zeros(2).reshape(3))
    with pytest.raises(ValueError, match="cannot reshape"):
        main(args)


def test_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(TINY, broken)
    (broken / "model_index.json").unlink()
    assert main(["generate", "a fox", "--model", str(broken), "--out", str(tmp_path / "out")]) == 2
    err = one_error_line(capsys)
    assert "not a diffusers Stable Diffusion checkpoint: missing model_index.json" in err
    (broken / "model_index.json").write_text("{}")
    shutil.rmtree(broken / "unet")
    assert main(["generate", "a fox", "--model", str(broken), "--out", str(tmp_path / "out")]) == 2
    assert "missing unet/config.json" in one_error_line(capsys)


def test_output_path_that_cannot_be_written(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for out in (blocker, blocker / "sub", blocker / "sub" / "x.png"):
        assert main(["generate", "a fox", "--model", TINY, "--out", str(out)]) == 2
        err = one_error_line(capsys)
        assert f"--out {out}" in err and "a-file" in err
    assert not (tmp_path / "a-file").is_dir()


def test_the_step_bar_moves_at_the_last_runs_pace_and_keeps_this_ones(tmp_path, capsys):
    """The bar is not in the program (a host callback would keep it out of JAX's disk cache): with a pace recorded
    it advances by the clock, a step short of the end until the call returns, then ends full and records the
    new pace; an unreadable record is no estimate, and the file keeps the newest programs only."""
    paces = tmp_path / StepBar.FILE
    paces.write_text(json.dumps({**{f"old {i}": 1.0 for i in range(StepBar.KEPT)}, "k": 1e-9}))
    with StepBar(4, "k", str(tmp_path), tick_s=0.01) as bar:
        for _ in range(6000):  # a bound, not a deadline: the clock passes 3 steps of 1e-9 s at its first tick
            if bar.bar.n == 3:
                break
            time.sleep(0.01)
        assert (bar.bar.n, bar.bar.total) == (3, 4)  # never the last step before the images are made
    assert (bar.bar.n, bar.bar.total) == (4, 4) and "4/4" in capsys.readouterr().err
    kept = json.loads(paces.read_text())
    assert len(kept) == StepBar.KEPT and list(kept)[-1] == "k" and kept["k"] > 1e-9 and "old 0" not in kept
    paces.write_bytes(b"\x00 not json")
    with StepBar(4, "k", str(tmp_path)) as bar:
        bar.on_compiled("/jax/core/compile/backend_compile_duration", 1.0)  # the clock starts after a compile
    assert bar.pace is None and "(first run: no estimate)" in capsys.readouterr().err
    assert list(json.loads(paces.read_text())) == ["k"]


def test_the_step_bar_counts_the_steps_the_model_runs():
    """img2img and inpaint run int(steps * strength) steps of the schedule (with a refiner, base and refiner run
    all of them between them)."""
    from types import SimpleNamespace

    from sdflax.cli import Request
    from sdflax.cli.run import steps_run

    request = Request("generate", "a fox", steps=10)
    assert steps_run(request, SimpleNamespace(strength=None, features={})) == 10
    assert steps_run(request, SimpleNamespace(strength=0.75, features={})) == 7
    assert steps_run(request, SimpleNamespace(strength=None, features={"refiner": 0.8})) == 10


def test_a_rerun_into_a_folder_names_files_by_run_not_like_seeds(tmp_path):
    """Friction: a second run wrote a-fox-0-1.png, which reads as seed 1. A run whose names are taken writes
    NAME-runN.png for all its files, N the first run number free for every one of them; no file is ever replaced."""
    target = OutputTarget(str(tmp_path))
    first = target.paths("a fox", [0, 1], grid=True)
    assert first == ([str(tmp_path / "a-fox-0.png"), str(tmp_path / "a-fox-1.png")],
                     str(tmp_path / "a-fox-0-grid.png"))
    for path in [*first[0], first[1]]:
        Path(path).write_text("run 1")
    second = target.paths("a fox", [0, 1], grid=True)
    assert second == ([str(tmp_path / "a-fox-0-run2.png"), str(tmp_path / "a-fox-1-run2.png")],
                      str(tmp_path / "a-fox-0-grid-run2.png"))
    (tmp_path / "a-fox-2-run2.png").write_text("the user's")  # seeds 1, 2: a-fox-1.png and a-fox-2-run2.png taken
    assert target.paths("a fox", [1, 2], grid=False) == ([str(tmp_path / "a-fox-1-run3.png"),
                                                          str(tmp_path / "a-fox-2-run3.png")], None)
    assert target.paths("a fox", [5], grid=False) == ([str(tmp_path / "a-fox-5.png")], None)


def test_an_empty_negative_prompt_writes_no_negative_prompt_line():
    """Friction: `parameters` had an empty "Negative prompt: " line; A1111 writes none."""
    settings = {"prompt": "a fox", "steps": 2, "scheduler": "pndm", "sampler": "PLMS", "guidance_scale": 7.5,
                "seed": 3, "width": 64, "height": 64, "model": "m"}

    def parameters(negative):
        chunks = dict(c[1].split(b"\0", 1) for c in png_info({**settings, "negative_prompt": negative}).chunks)
        return chunks[b"parameters"].decode()

    assert parameters("") == "a fox\nSteps: 2, Sampler: PLMS, CFG scale: 7.5, Seed: 3, Size: 64x64, Model: m"
    assert parameters("blurry").startswith("a fox\nNegative prompt: blurry\nSteps: 2, ")


def test_height_and_width_help_says_what_they_do(capsys):
    """Friction: `--height H  pixels, H pixels` in generate's --help, and "cut down" for img2img's pictures,
    which are resized (as the warning says)."""
    text = {}
    for command in ("generate", "img2img", "inpaint"):
        assert main([command, "--help"]) == 0
        text[command] = " ".join(capsys.readouterr().out.split())
    assert "--height H image height in pixels, a multiple of the VAE scale factor" in text["generate"]
    assert "--width W image width in pixels (default: the model's own)" in text["generate"]
    for command in ("img2img", "inpaint"):
        assert ("--height H resize the picture to H pixels high, a multiple of the VAE scale factor (default: its "
                "height, rounded down to a multiple)") in text[command]
        assert "--width W resize the picture to W pixels wide" in text[command]
    assert not any("pixels, H pixels" in t or "cut down" in t for t in text.values())


def test_naming_helpers():
    assert slug("A photo, of an ASTRONAUT riding a horse on Mars!!") == "a-photo-of-an-astronaut-riding-a-horse"
    assert slug("!!!") == "image"
    assert [grid_shape(n) for n in (1, 2, 4, 6, 7, 8, 9)] == [(1, 1), (1, 2), (2, 2), (2, 3), (1, 7), (2, 4), (3, 3)]


def test_sdxl_checkpoint_through_generate(tmp_path):
    """An SDXL checkpoint picks StableDiffusionXL, guidance 5 and SDXL's zero negative embeddings by default: the PNG
    equals the Python API's image for the same seed."""
    import jax
    from builders import torch_xl_pipeline

    from sdflax import StableDiffusionXL

    torch_xl_pipeline().save_pretrained(tmp_path / "xl")
    result = run_cli(["generate", "a lighthouse", "--model", str(tmp_path / "xl"), "--steps", "2", "--seed", "7",
                      "--num-images", "1", "--no-progress", "--out", str(tmp_path / "xl.png")], tmp_path, devices=1)
    assert result.returncode == 0, result.stderr
    written = Image.open(tmp_path / "xl.png")
    assert written.text["guidance_scale"] == "5.0"

    pipe, params = StableDiffusionXL.from_pretrained(tmp_path / "xl")
    expected = pipe(pipe.prepare_inputs(["a lighthouse"]), params, jax.random.key(7), 2).images[0]
    assert written.size == (expected.shape[1], expected.shape[0])
    difference = np.abs(pixels(tmp_path / "xl.png").astype(int) - (expected * 255).round().astype(int))
    assert difference.max() <= 1  # 8-bit rounding of float32 results computed under pmap vs jit
    # (img2img, inpaint and the refiner with SDXL checkpoints: test_cli_xl.py)
