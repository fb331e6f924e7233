"""`--lora`, `--embedding` and a single-file `--model` (with `--config`) on `sdflax generate`, end to end on
weights/tiny-sd with files written here: the PNGs equal the library's images for the same inputs and record
what made them; bad input is one line and status 2, in process."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from test_cli import TINY, assert_help_lists, one_error_line, pixels, run_cli
from test_lora import kohya_file
from test_single_file import to_single_file
from test_textual_inversion import write

from sdflax.cli import lora_argument as _lora, main

SIZE = ["--steps", "2", "--height", "64", "--width", "64", "--seed", "7", "--num-images", "1", "--no-progress"]
PROMPT = "a fox by charturner"  # charturner: the token of charturner.pt


def torch_tiny():
    """weights/tiny-sd's models in PyTorch (diffusers and transformers)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    return SimpleNamespace(unet=UNet2DConditionModel.from_pretrained(TINY, subfolder="unet"),
                           vae=AutoencoderKL.from_pretrained(TINY, subfolder="vae"),
                           text_encoder=CLIPTextModel.from_pretrained(TINY, subfolder="text_encoder"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """In one folder: two LoRAs for tiny-sd (UNet attention + text encoder, and UNet convolutions), a 2-vector
    embedding, tiny-sd as one LDM-layout file, a LoRA and an embedding for a wider text encoder, a file that is not
    SD and an SDXL refiner's names; and the compile cache the CLI runs share."""
    from builders import CONFIGS, torch_text_encoder, torch_unet

    tmp = tmp_path_factory.mktemp("cli-lora")
    theirs = torch_tiny()
    kohya_file(tmp / "a.safetensors", theirs, seed=1, keep=lambda c, name: c == "text_encoder" or "attn" in name)
    kohya_file(tmp / "b.safetensors", theirs, seed=2, keep=lambda c, name: c == "unet" and "attn" not in name)
    torch.manual_seed(0)
    write(tmp / "charturner.pt", "a1111.pt", torch.randn(2, 32), "ignored")
    save_file(to_single_file(theirs, "sd1"), tmp / "tiny.safetensors")

    wide = SimpleNamespace(unet=torch_unet(CONFIGS["sd2"]["unet"]),  # another model: text width 48, not 32
                           text_encoder=torch_text_encoder(CONFIGS["sd2"]["text_encoder"]))
    kohya_file(tmp / "wide-lora.safetensors", wide)
    write(tmp / "wide.pt", "a1111.pt", torch.randn(1, 48), "ignored")
    save_file({"encoder.weight": torch.zeros(2, 2)}, tmp / "other.safetensors")
    torch.save({"state_dict": {"encoder.weight": torch.zeros(2, 2)}, "epoch": 3}, tmp / "other.ckpt")
    save_file({"model.diffusion_model.out.2.bias": torch.zeros(4),
               "conditioner.embedders.0.model.ln_final.bias": torch.zeros(4)}, tmp / "refiner.safetensors")
    return tmp


LORAS = ["--lora", "a.safetensors:0.7", "--lora", "b.safetensors", "--embedding", "charturner.pt"]


def generate(files, out, *args):
    """The CLI in `files` (where the compile cache the runs share is): PROMPT, tiny-sd's size, the LoRAs."""
    result = run_cli(["generate", PROMPT, *LORAS, *SIZE, "--out", str(out), *args], files, devices=1)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def folder_png(files):
    """`--model weights/tiny-sd` with two LoRAs and an embedding."""
    generate(files, files / "folder.png", "--model", TINY)
    return files / "folder.png"


def test_loras_and_an_embedding_equal_the_library(files, folder_png):
    import jax

    from sdflax import StableDiffusion

    pipe, params = StableDiffusion.from_pretrained(TINY)
    pipe, params = pipe.load_textual_inversion(params, files / "charturner.pt")
    merged = pipe.load_lora(pipe.load_lora(params, files / "a.safetensors", 0.7), files / "b.safetensors", 1.0)
    ids, neg = pipe.prepare_inputs([PROMPT]), pipe.prepare_inputs([""])
    expected, without_loras = (pipe(ids, p, jax.random.key(7), 2, height=64, width=64, guidance_scale=7.5,
                                    neg_prompt_ids=neg).images[0] for p in (merged, params))
    # uint8 PNG pixels against the library's float image: rounding, and pmap vs jit (at most one level)
    assert np.abs(pixels(folder_png).astype(np.float32) - np.round(expected * 255)).max() <= 1
    assert np.abs(without_loras - expected).max() > 0.05  # the LoRAs change the image

    text = Image.open(folder_png).text
    assert json.loads(text["lora"]) == ["a.safetensors", "b.safetensors"]
    assert json.loads(text["lora_scale"]) == [0.7, 1.0]
    assert json.loads(text["embedding"]) == ["charturner.pt"]
    assert text["parameters"].startswith(f"{PROMPT} <lora:a:0.7> <lora:b:1.0>\nSteps: 2, ")  # no empty negative line


def test_single_file_model_with_config_equals_the_folder(files, folder_png):
    result = generate(files, files / "file.png", "--model", "tiny.safetensors", "--config", TINY)
    assert "(from the disk cache)" in result.stderr  # the same program as the folder's run
    np.testing.assert_array_equal(pixels(files / "file.png"), pixels(folder_png))
    text = Image.open(files / "file.png").text
    assert (text["model"], text["config"], text["revision"], text["commit"]) == ("tiny.safetensors", TINY, "", "")


def test_lora_scale_parsing():
    assert _lora("a.safetensors:0.7") == ("a.safetensors", 0.7)
    assert _lora("a.safetensors") == ("a.safetensors", 1.0)
    assert _lora("a.safetensors:-1e-1") == ("a.safetensors", -0.1)
    assert _lora(r"C:\loras\a.safetensors") == (r"C:\loras\a.safetensors", 1.0)  # a drive colon is a path
    assert _lora(r"C:\loras\a.safetensors:2") == (r"C:\loras\a.safetensors", 2.0)
    assert _lora("style:v2.safetensors") == ("style:v2.safetensors", 1.0)
    assert _lora("x:2:1") == ("x:2", 1.0)  # a name ending in :NUMBER, with its scale written out


@pytest.mark.parametrize("args, expected", [
    (["--lora", "missing.safetensors"], "--lora missing.safetensors: no such file"),
    (["--lora", "a.safetensors:strong"], "--lora a.safetensors:strong: the scale 'strong' is not a number"),
    (["--lora", "a.safetensors:nan"], "argument --lora: a.safetensors:nan: the scale must be a finite float32 "
     "number"),
    (["--lora", "a.safetensors:1e39"], "argument --lora: a.safetensors:1e39: the scale must be a finite float32"),
    (["--lora", "a.safetensors:1:2"], "--lora a.safetensors:1: no such file"),  # not "the scale '1' is not a number"
    (["--embedding", "missing.pt"], "--embedding missing.pt: no such file"),
    (["--embedding", "charturner.pt", "--embedding", "sub/charturner.pt"],
     "both give the token 'charturner' (the file name): rename one"),
    (["--model", "other.safetensors"], "--model other.safetensors: not a single-file Stable Diffusion checkpoint"),
    (["--model", "other.ckpt"], "--model other.ckpt: not a single-file Stable Diffusion checkpoint: no "
     "model.diffusion_model.* tensors (found encoder.weight)"),
    (["--model", "refiner.safetensors"], "--model refiner.safetensors is an SDXL refiner checkpoint"),
    (["--model", "charturner.pt"], "--model charturner.pt is a file but not a .safetensors or .ckpt checkpoint"),
    (["--model", "tiny.safetensors", "--revision", "main"], "--revision applies to hub ids, but tiny.safetensors "
     "is a file: drop --revision"),
    (["--config", TINY], f"--config applies to a single-file --model (.safetensors, .ckpt), but {TINY} is not a file"),
    (["--model", "tiny.safetensors", "--config", "."], "--config . is not a diffusers Stable Diffusion checkpoint"),
])
def test_bad_input_before_loading(args, expected, files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(files)
    (files / "sub").mkdir(exist_ok=True)
    (files / "sub" / "charturner.pt").write_bytes((files / "charturner.pt").read_bytes())
    assert main(["generate", "a fox", "--model", TINY, *args, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


@pytest.mark.parametrize("args, expected", [
    (["--lora", "wide-lora.safetensors"], "--lora wide-lora.safetensors is a LoRA for a model of 48-wide text "
     "states, this pipeline is SD 1.x/2.x"),
    (["--embedding", "wide.pt"], "--embedding wide.pt: the embedding has vectors of 48 dimensions but "
     "text_encoder's have 32"),
    (["--model", "tiny.safetensors"], "--model tiny.safetensors does not fit sdflax's bundled configs for its "
     "version (another architecture?): pass --config <a diffusers folder"),
])
def test_files_that_do_not_fit_the_model(args, expected, files, tmp_path, capsys, monkeypatch):
    """Found once the model is loaded (before compiling): still one line."""
    monkeypatch.chdir(files)
    assert main(["generate", "a fox", "--model", TINY, *args, *SIZE, "--out", str(tmp_path / "out")]) == 2
    err = one_error_line(capsys)
    assert expected in err, err


@pytest.mark.parametrize("command", ["img2img", "inpaint"])
def test_img2img_and_inpaint_take_the_options(command, files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(files)
    Image.new("RGB", (64, 64)).save(tmp_path / "in.png")
    Image.new("L", (64, 64)).save(tmp_path / "mask.png")
    pictures = ["--image", str(tmp_path / "in.png")] + (["--mask", str(tmp_path / "mask.png")] if command == "inpaint"
                                                        else [])
    for args, expected in ((["--lora", "a.safetensors:x"], "the scale 'x' is not a number"),
                           (["--embedding", "none.pt"], "--embedding none.pt: no such file"),
                           (["--model", "refiner.safetensors"], "is an SDXL refiner checkpoint")):
        assert main([command, "a fox", *pictures, "--model", TINY, *args, "--out", str(tmp_path / "out")]) == 2
        assert expected in one_error_line(capsys)


def test_help_lists_the_options(capsys):
    assert_help_lists(capsys, "--lora PATH[:SCALE]", "--embedding PATH", "--config ID_OR_DIR")
