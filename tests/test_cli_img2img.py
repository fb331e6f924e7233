"""`sdflax img2img` and `sdflax inpaint` end to end on weights/tiny-sd, in subprocesses on one device; bad input
in process (it fails before JAX starts)."""

import json
import re
import shutil

import numpy as np
import pytest
from PIL import Image
from test_cli import TINY, one_error_line, pixels, run_cli

from sdflax.cli import main

SETTINGS = ("prompt", "negative_prompt", "seed", "steps", "scheduler", "guidance_scale", "width", "height", "model",
            "dtype", "strength", "image")


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """A 34x30 picture (not a multiple of tiny-sd's VAE scale factor 4) and a mask of its size."""
    tmp = tmp_path_factory.mktemp("pictures")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (30, 34, 3), dtype=np.uint8)).save(tmp / "in.png")
    mask = np.zeros((30, 34), np.uint8)
    mask[8:22, 6:28] = 255
    Image.fromarray(mask).save(tmp / "mask.png")
    return tmp


def test_img2img_writes_pngs_with_their_settings_and_a_seed_gives_its_image_back(pictures, tmp_path):
    common = ["img2img", "a red fox, watercolor", "--image", "in.png", "--model", TINY, "--steps", "2",
              "--strength", "0.75", "--negative-prompt", "blurry", "--no-progress"]
    first = run_cli([*common, "--seed", "3", "--num-images", "2", "--out", str(tmp_path / "a")], tmp_path,
                    devices=1, cwd=pictures)
    assert first.returncode == 0, first.stderr
    written = first.stdout.split()
    assert written == [str(tmp_path / "a" / f"a-red-fox-watercolor-{s}.png") for s in (3, 4)]
    lines = first.stderr.splitlines()
    assert lines[0] == ("sdflax: warning: --image in.png is 34x30: resized to 32x28, a multiple of 4 (the VAE scale "
                        "factor)")
    assert re.fullmatch(r"seed 3: load [\d.]+ s, compile [\d.]+ s.*, generate [\d.]+ s for 2 image\(s\)", lines[1])
    assert len(lines) == 2
    for path, seed in zip(written, (3, 4)):
        image = Image.open(path)
        assert image.size == (32, 28) and image.mode == "RGB"
        assert {k: image.text[k] for k in SETTINGS} == {
            "prompt": "a red fox, watercolor", "negative_prompt": "blurry", "seed": str(seed), "steps": "2",
            "scheduler": "pndm", "guidance_scale": "7.5", "width": "32", "height": "28", "model": TINY,
            "dtype": "float32", "strength": "0.75", "image": "in.png"}
        assert "mask" not in image.text
        assert image.text["parameters"].endswith(", Denoising strength: 0.75")
    assert not np.array_equal(pixels(written[0]), pixels(written[1]))

    # Image i draws from seed S+i alone: seed 4, the second image of the first run, is the first of this one.
    second = run_cli([*common, "--seed", "4", "--num-images", "2", "--out", str(tmp_path / "b")], tmp_path,
                     devices=1, cwd=pictures)
    assert second.returncode == 0, second.stderr
    assert pixels(tmp_path / "b" / "a-red-fox-watercolor-4.png").tobytes() == pixels(written[1]).tobytes()
    assert "(from the disk cache)" in second.stderr  # another seed, the same program


def test_inpaint_writes_pngs_with_their_settings(pictures, tmp_path):
    result = run_cli(["inpaint", "a lighthouse", "--image", "in.png", "--mask", "mask.png", "--model", TINY,
                      "--steps", "2", "--seed", "5", "--height", "32", "--width", "36", "--scheduler", "ddim",
                      "--progress", "--out", str(tmp_path / "out")], tmp_path, devices=1, cwd=pictures)
    assert result.returncode == 0, result.stderr
    [path] = result.stdout.split()
    assert path == str(tmp_path / "out" / "a-lighthouse-5.png")
    image = Image.open(path)
    assert image.size == (36, 32)  # resized to the size asked for, without a warning
    assert {k: image.text[k] for k in (*SETTINGS, "mask")} == {
        "prompt": "a lighthouse", "negative_prompt": "", "seed": "5", "steps": "2", "scheduler": "ddim",
        "guidance_scale": "7.5", "width": "36", "height": "32", "model": TINY, "dtype": "float32",
        "strength": "1.0", "image": "in.png", "mask": "mask.png"}
    assert "warning" not in result.stderr
    assert "Compiling for 2 steps (strength 1.0) at 36x32" in result.stderr
    assert "denoising: " in result.stderr  # the step bar (--progress): the program's first run counts seconds


def test_help():
    assert main(["img2img", "--help"]) == 0
    assert main(["inpaint", "--help"]) == 0


@pytest.mark.parametrize("args, expected", [
    (["img2img", "a fox"], "the following arguments are required: --image"),
    (["inpaint", "a fox", "--image", "in.png"], "the following arguments are required: --mask"),
    (["img2img", "a fox", "--image", "in.png", "--strength", "0"], "argument --strength: must be in (0, 1], got 0.0"),
    (["img2img", "a fox", "--image", "in.png", "--strength", "1.5"], "must be in (0, 1], got 1.5"),
    (["inpaint", "a fox", "--image", "in.png", "--mask", "mask.png", "--strength", "strong"],
     "argument --strength: expected a number, got 'strong'"),
    (["img2img", "a fox", "--image", "in.png", "--strength", "0.1", "--steps", "4"],
     "--strength 0.1 with --steps 4 runs no denoising step: raise --strength to at least 0.25 or --steps"),
    (["img2img", "a fox", "--image", "missing.png"], "--image missing.png: cannot read it (No such file"),
    (["img2img", "a fox", "--image", "notes.txt"],
     "--image notes.txt: cannot read it (not an image file PIL can read)"),
    (["inpaint", "a fox", "--image", "in.png", "--mask", "small.png"],
     "--mask small.png is 16x16 but --image in.png is 34x30: give a mask of the image's size"),
    (["inpaint", "a fox", "--image", "in.png", "--mask", "in.png"],
     "--mask in.png has colours (its red, green and blue differ): give a greyscale mask"),
    (["img2img", "a fox", "--image", "in.png", "--height", "30"],
     "--height 30 is not a multiple of 4, the VAE scale factor of"),
    (["img2img", "a fox", "--image", "in.png", "--out", "x.jpg"], "sdflax writes PNG files"),
])
def test_bad_input_is_one_line_and_status_2(args, expected, pictures, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(pictures)
    (pictures / "notes.txt").write_text("not a picture")
    Image.new("L", (16, 16)).save(pictures / "small.png")
    out = ["--out", str(tmp_path / "out")] if "--out" not in args else []
    assert main([*args, "--model", TINY, *out]) == 2
    assert expected in one_error_line(capsys)


def test_an_inpainting_checkpoint_is_for_inpaint_only(pictures, tmp_path, capsys, monkeypatch):
    """The UNet's config decides (9 input channels: latents, mask, masked image), before any weight is read."""
    folder = tmp_path / "inpainting"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "unet" / "config.json").read_text())
    (folder / "unet" / "config.json").write_text(json.dumps({**config, "in_channels": 9}))
    monkeypatch.chdir(pictures)
    for command in (["generate", "a fox"], ["img2img", "a fox", "--image", "in.png"]):
        assert main([*command, "--model", str(folder), "--out", str(tmp_path / "out")]) == 2
        assert "is an inpainting checkpoint (its UNet takes a mask): use sdflax inpaint" in one_error_line(capsys)
    config["in_channels"] = 5
    (folder / "unet" / "config.json").write_text(json.dumps(config))
    assert main(["inpaint", "a fox", "--image", "in.png", "--mask", "mask.png", "--model", str(folder), "--out",
                 str(tmp_path / "out")]) == 2
    assert "its UNet takes 5 input channels; inpainting needs an ordinary (4) or an inpainting (9) UNet" in \
        one_error_line(capsys)
