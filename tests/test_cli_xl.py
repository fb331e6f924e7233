"""SDXL on the command line: `generate --refiner` (base + refiner in one command), `img2img` and `inpaint` with an
SDXL checkpoint, `--prompt-2` / `--negative-prompt-2`, end to end on a small SDXL base and refiner written here: the
PNGs equal the library's images for the same inputs and keys, and record what made them; bad input is one line
and status 2, in process."""

import json

import numpy as np
import pytest
from PIL import Image
from test_cli import TINY, assert_help_lists, close_to, one_error_line, pixels, rows
from test_cli_controlnet import as_the_cli, run_cli_here

import jax

from sdflax.cli import main

SIZE = 32  # pixels; latents 16x16 (VAE scale factor 2)
COMMON = ["--height", str(SIZE), "--width", str(SIZE), "--seed", "7", "--num-images", "1", "--no-progress"]
PROMPT, PROMPT_2 = "a lighthouse at dusk", "an oil painting, dramatic light"
NEGATIVE, NEGATIVE_2 = "blurry", "grainy"
# Leading spacing: timesteps 751, 501 (the base, to 0.7: t >= 300) | 251, 1 (the refiner); SDXL img2img's default
# strength 0.3 runs int(4 * 0.3) = 1 step
STEPS = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small SDXL base and refiner (diffusers folders), an input picture and mask."""
    from builders import torch_xl_pipeline, torch_xl_refiner

    tmp = tmp_path_factory.mktemp("cli-xl")
    torch_xl_pipeline("euler").save_pretrained(tmp / "base")
    torch_xl_refiner("euler").save_pretrained(tmp / "refiner")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(tmp / "in.png")
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[6:22, 5:25] = 255
    Image.fromarray(mask).save(tmp / "mask.png")
    return tmp


def cli(files, name, *args):
    """The CLI in `files` (`run_cli_here`: the library calls below, made as the CLI makes them, load the programs it
    compiled); the path of the PNG it wrote."""
    result = run_cli_here([*args, "--model", "base", *COMMON, "--out", name], files, files)
    assert result.returncode == 0, result.stderr
    return files / name


def test_refiner_equals_the_library_two_stage_run(files):
    from sdflax import StableDiffusionXL, StableDiffusionXLImg2Img

    png = cli(files, "refined.png", "generate", PROMPT, "--prompt-2", PROMPT_2, "--negative-prompt", NEGATIVE,
              "--negative-prompt-2", NEGATIVE_2, "--refiner", "refiner", "--high-noise-frac", "0.7", "--steps",
              str(STEPS))
    pipe, params = StableDiffusionXL.from_pretrained(files / "base")
    refiner, refiner_params = StableDiffusionXLImg2Img.from_pretrained(files / "refiner")
    keys = as_the_cli(7)
    ids, neg = rows([pipe.prepare_inputs([PROMPT], [PROMPT_2]), pipe.prepare_inputs([NEGATIVE], [NEGATIVE_2])], keys)
    latents = pipe.generate_sharded(ids, params, keys, STEPS, height=SIZE, width=SIZE, neg_prompt_ids=neg,
                                    denoising_end=0.7, output_type="latent")
    ids, neg = rows([refiner.prepare_inputs([PROMPT]), refiner.prepare_inputs([NEGATIVE])], keys)
    expected = refiner.generate_sharded(ids, latents, refiner_params, keys, num_inference_steps=STEPS,
                                        neg_prompt_ids=neg, denoising_start=0.7)[0]
    close_to(png, expected)
    unrefined = jax.jit(pipe.decode_latents)(params, latents[:1])[0]  # one program, not the VAE's ops one by one
    assert np.abs(unrefined - expected).max() > 0.02  # the refiner's steps change the image (5 uint8 levels)

    text = Image.open(png).text
    assert {k: text[k] for k in ("prompt_2", "negative_prompt_2", "refiner", "high_noise_frac", "guidance_scale")} \
        == {"prompt_2": PROMPT_2, "negative_prompt_2": NEGATIVE_2, "refiner": "refiner", "high_noise_frac": "0.7",
            "guidance_scale": "5.0"}
    assert text["parameters"].endswith(", Model: base, Refiner: refiner, Refiner switch at: 0.7")


def test_img2img_with_sdxl_and_prompt_2_equal_the_library(files):
    from sdflax import StableDiffusionXLImg2Img

    args = ["img2img", PROMPT, "--image", "in.png", "--steps", str(STEPS)]
    plain = cli(files, "img2img.png", *args)
    second = cli(files, "img2img-2.png", *args, "--prompt-2", PROMPT_2)
    pipe, params = StableDiffusionXLImg2Img.from_pretrained(files / "base")
    picture, keys = Image.open(files / "in.png"), as_the_cli(7)
    for png, prompts_2 in ((plain, None), (second, [PROMPT_2])):
        ids, image = rows(pipe.prepare_inputs([PROMPT], [picture], prompts_2), keys)
        # diffusers' SDXL img2img defaults: strength 0.3, guidance 5.0
        close_to(png, pipe.generate_sharded(ids, image, params, keys, 0.3, STEPS)[0])
    assert np.abs(pixels(plain).astype(int) - pixels(second)).max() > 5  # --prompt-2 reaches the image
    text = Image.open(second).text
    assert (text["strength"], text["guidance_scale"], text["prompt_2"]) == ("0.3", "5.0", PROMPT_2)
    assert "prompt_2" not in Image.open(plain).text


def test_inpaint_with_sdxl_equals_the_library(files):
    from sdflax import StableDiffusionXLInpaint

    png = cli(files, "inpaint.png", "inpaint", PROMPT, "--image", "in.png", "--mask", "mask.png", "--steps",
              str(STEPS))
    pipe, params = StableDiffusionXLInpaint.from_pretrained(files / "base")
    keys = as_the_cli(7)
    ids, image, mask = rows(pipe.prepare_inputs([PROMPT], [Image.open(files / "in.png")],
                                                [Image.open(files / "mask.png")]), keys)
    # diffusers' SDXL inpaint defaults: strength 0.9999, guidance 7.5
    close_to(png, pipe.generate_sharded(ids, image, mask, params, keys, 0.9999, STEPS)[0])
    text = Image.open(png).text
    assert (text["strength"], text["guidance_scale"]) == ("0.9999", "7.5")


@pytest.mark.parametrize("args, expected", [
    (["--model", TINY, "--prompt-2", "x"], "--prompt-2 is for SDXL's second text encoder, but"),
    (["--model", TINY, "--negative-prompt-2", "x"], "--negative-prompt-2 is for SDXL's second text encoder"),
    (["--model", TINY, "--refiner", "refiner"], "--refiner refiner: a refiner finishes SDXL base images, but"),
    (["--refiner", TINY], f"--refiner {TINY} is a StableDiffusionPipeline checkpoint, not an SDXL refiner"),
    (["--refiner", "in.png"], "--refiner in.png is a file: sdflax takes a refiner as a hub id or diffusers folder"),
    (["--refiner", "refiner", "--high-noise-frac", "0"], "argument --high-noise-frac: must be in (0, 1), got 0"),
    (["--refiner", "refiner", "--high-noise-frac", "1.5"], "argument --high-noise-frac: must be in (0, 1), got 1.5"),
    (["--refiner", "refiner", "--high-noise-frac", "0.1", "--steps", "4"],
     "--high-noise-frac 0.1 with --steps 4 leaves the base no step"),
    (["--high-noise-frac", "0.7"], "--high-noise-frac applies with --refiner"),
])
def test_bad_input_is_one_line(args, expected, files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(files)
    assert main(["generate", "a fox", "--model", "base", *args, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


def test_refiner_of_other_latents(files, tmp_path, capsys, monkeypatch):
    """Checked from the configs, before any weight loads."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(files / "refiner", other, ignore=shutil.ignore_patterns("*.safetensors"))
    for part, key in (("vae", "latent_channels"), ("unet", "in_channels")):
        config = json.loads((other / part / "config.json").read_text())
        (other / part / "config.json").write_text(json.dumps({**config, key: 8}))
    monkeypatch.chdir(files)
    assert main(["generate", "a fox", "--model", "base", "--refiner", str(other), "--out", str(tmp_path / "o")]) == 2
    assert f"--refiner {other} takes other latents than base (8 channels, UNet input 8" in one_error_line(capsys)


@pytest.mark.parametrize("command, args, expected", [
    ("img2img", ["--model", TINY, "--prompt-2", "x"], "--prompt-2 is for SDXL's second text encoder"),
    ("inpaint", ["--model", TINY, "--negative-prompt-2", "x"], "--negative-prompt-2 is for SDXL's second text"),
])
def test_img2img_and_inpaint_bad_input(command, args, expected, files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(files)
    mask = ["--mask", "mask.png"] if command == "inpaint" else []
    assert main([command, "a fox", "--image", "in.png", *mask, *args, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


@pytest.mark.parametrize("command", ["img2img", "inpaint"])
def test_refiner_is_for_generate_only(command, files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(files)
    mask = ["--mask", "mask.png"] if command == "inpaint" else []
    assert main([command, "a fox", "--image", "in.png", *mask, "--model", "base", "--refiner", "refiner", "--out",
                 str(tmp_path / "out")]) == 2
    assert "unrecognized arguments: --refiner refiner" in one_error_line(capsys)


def test_help_lists_the_options(capsys):
    assert_help_lists(capsys, "--prompt-2 TEXT", "--negative-prompt-2 TEXT")
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--refiner ID_OR_DIR" in out and "--high-noise-frac F" in out
    assert main(["img2img", "--help"]) == 0
    assert "0.3 for SDXL" in " ".join(capsys.readouterr().out.split())
