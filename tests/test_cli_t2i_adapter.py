"""`--t2i-adapter / --adapter-image / --adapter-scale / --adapter-factor` on `sdflax generate`, `img2img` and
`batch`, end to end on weights/tiny-sd with small random diffusers T2IAdapters made for its UNet: the PNGs equal the
library's images made from the pictures as diffusers' `_preprocess_adapter_image` makes them (Lanczos to the output
size, / 255), and record the adapters; bad input in process (it fails before JAX starts). Two generate runs compile;
the library calls and the batch run (in process) load their programs from the session's cache."""

import json
import shutil

import numpy as np
import pytest
from PIL import Image
from test_cli import TINY, assert_help_lists, one_error_line
from test_cli_controlnet import as_the_cli, assert_close_to, run_cli_here
from test_t2i_adapter_pipelines import XL_ADAPTER, torch_adapter

from sdflax.cli import main

# tiny-sd's UNet adds a feature 32 wide at 1/4 of the picture (its latents), 64 at 1/8 and 64 at 1/16
TINY_ADAPTER = dict(in_channels=3, channels=[32, 64, 64], num_res_blocks=1, downscale_factor=4,
                    adapter_type="full_adapter")
FLAGS = ["--model", TINY, "--steps", "2", "--no-progress"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """sketch/ (RGB) and grey/ (one channel): adapters for tiny-sd; sketch.png (33x34: the output size it sets is
    32x32), depth.png (grey) and in.png (32x32); adapters that do not fit (wide/, coarse/, rgba/)."""
    tmp = tmp_path_factory.mktemp("t2i-adapter-cli")
    torch_adapter(TINY_ADAPTER, 1).save_pretrained(tmp / "sketch")
    torch_adapter({**TINY_ADAPTER, "in_channels": 1}, 2).save_pretrained(tmp / "grey")
    for name, change in (("wide", {"channels": [64, 64, 64]}), ("coarse", {"downscale_factor": 8}),
                         ("rgba", {"in_channels": 4})):
        shutil.copytree(tmp / "sketch", tmp / name)
        config = json.loads((tmp / name / "config.json").read_text())
        (tmp / name / "config.json").write_text(json.dumps({**config, **change}))
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (34, 33, 3), dtype=np.uint8)).save(tmp / "sketch.png")
    Image.fromarray(rng.integers(0, 256, (32, 32), dtype=np.uint8)).save(tmp / "depth.png")
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp / "in.png")
    return tmp


def adapter_picture(folder, name, mode):
    """diffusers' `_preprocess_adapter_image`: the picture in the adapter's mode, Lanczos to 32x32, / 255, NCHW."""
    picture = Image.open(folder / name).convert(mode).resize((32, 32), Image.LANCZOS)
    array = np.asarray(picture, np.float32) / np.float32(255)
    return (array[None, None] if array.ndim == 2 else array.transpose(2, 0, 1)[None]).astype(np.float32)


def library(folder, kind, names):
    """(pipeline, params) of tiny-sd with the adapters, as the CLI loads them (a list, also of one)."""
    from sdflax import T2IAdapter

    loaded = [T2IAdapter.from_pretrained(folder / name) for name in names]
    pipe, params = kind.from_pretrained(TINY, adapter=[adapter for adapter, _ in loaded])
    params["adapter"] = [p for _, p in loaded]
    return pipe, params


def generate(folder, tmp_path, *flags):
    result = run_cli_here([*flags, *FLAGS, "--out", str(tmp_path / "out")], tmp_path, cwd=folder)
    assert result.returncode == 0, result.stderr
    return result


def test_generate_with_an_adapter_at_a_scale_equals_the_library(folder, tmp_path, capsys, monkeypatch):
    """StableDiffusionAdapter (diffusers' StableDiffusionAdapterPipeline), the picture setting the output size; the
    same command as `sdflax batch` makes the same image, and its manifest refuses other adapter settings."""
    from sdflax import StableDiffusionAdapter

    def flags(scale):
        return ["--t2i-adapter", "sketch", "--adapter-image", "sketch.png", "--adapter-scale", scale, "--seed", "7"]

    result = generate(folder, tmp_path, "generate", "a house", *flags("0.7"))
    assert result.stderr.splitlines()[0] == ("sdflax: warning: --adapter-image sketch.png is 33x34: resized to "
                                             "32x32, a multiple of 4 (the VAE scale factor)")
    pipe, params = library(folder, StableDiffusionAdapter, ["sketch"])
    keys = as_the_cli(7)
    n = len(keys)
    ids, neg = pipe.prepare_inputs(["a house"] * n), pipe.prepare_inputs([""] * n)
    picture = np.repeat(adapter_picture(folder, "sketch.png", "RGB"), n, 0)

    def images(scale):
        return pipe.generate_sharded(ids, [picture], params, keys, num_inference_steps=2, guidance_scale=7.5,
                                     neg_prompt_ids=neg, height=32, width=32, adapter_conditioning_scale=[scale])

    expected = images(0.7)
    assert expected.std() > 0.05  # not a blank image: the comparison means something
    paths = result.stdout.split()
    for path, image in zip(paths, expected):
        assert_close_to(path, image)
        text = Image.open(path).text
        assert (json.loads(text["t2i_adapter"]), json.loads(text["adapter_image"]),
                json.loads(text["adapter_scale"])) == (["sketch"], ["sketch.png"], [0.7])
        assert "adapter_factor" not in text  # SD's adapters steer every step
        assert text["parameters"].endswith(", Size: 32x32, Model: " + TINY + ", T2I-Adapter: sketch (0.7), "
                                           "T2I-Adapter image: sketch.png")
    assert np.abs(images(0.0)[0] - expected[0]).max() > 0.02  # the adapter steers (a traced scale: one program)

    # sdflax batch, in process: line 1 (seed 7) in one batch of every device, the program of the run above
    monkeypatch.chdir(folder)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a house\n")
    def batch(scale):
        return main(["batch", str(prompts), "--out", str(tmp_path / "batch"), *flags(scale), *FLAGS,
                     "--num-processes", "1"])

    assert batch("0.7") == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "batch" / "manifest.jsonl").read_text())
    assert (record["settings"]["t2i_adapter"], record["settings"]["adapter_scale"]) == (["sketch"], [0.7])
    assert_close_to(tmp_path / "batch" / record["file"], expected[0])
    capsys.readouterr()
    assert batch("0.5") == 2  # the same-settings check, before anything loads
    warning, error = capsys.readouterr().err.splitlines()  # the size warning, then one line
    assert warning.startswith("sdflax: warning: --adapter-image sketch.png is 33x34") and (
        f"holds {record['file']} of line 1 made with adapter_scale [0.7], not [0.5]: use another --out for other "
        "settings") in error


def test_img2img_with_two_adapters_one_grey_equals_the_library(folder, tmp_path):
    """StableDiffusionImg2Img given the adapters (adapter=, adapter_image=): diffusers' MultiAdapter, a scale each;
    the one-channel adapter reads the picture grey."""
    from sdflax import StableDiffusionImg2Img
    from sdflax.pipeline.images import preprocess_images

    generate(folder, tmp_path, "img2img", "a house", "--image", "in.png", "--strength", "0.75", "--seed", "3",
             "--t2i-adapter", "sketch", "--adapter-image", "sketch.png", "--t2i-adapter", "grey", "--adapter-image",
             "depth.png", "--adapter-scale", "0.8", "--adapter-scale", "0.5", "--num-images", "1")
    pipe, params = library(folder, StableDiffusionImg2Img, ["sketch", "grey"])
    keys = as_the_cli(3)
    n = len(keys)
    ids, neg = pipe.prepare_inputs(["a house"] * n), pipe.prepare_inputs([""] * n)
    image = np.repeat(preprocess_images([Image.open(folder / "in.png")], pipe.vae_scale_factor), n, 0)
    pictures = [np.repeat(adapter_picture(folder, name, mode), n, 0)
                for name, mode in (("sketch.png", "RGB"), ("depth.png", "L"))]

    def images(scales):
        return pipe.generate_sharded(ids, image, params, keys, num_inference_steps=2, guidance_scale=7.5,
                                     neg_prompt_ids=neg, strength=0.75, adapter_image=pictures,
                                     adapter_conditioning_scale=scales)

    expected = images([0.8, 0.5])
    out = tmp_path / "out"
    path = next(out.iterdir())
    assert_close_to(path, expected[0])
    text = Image.open(path).text
    assert (json.loads(text["t2i_adapter"]), json.loads(text["adapter_image"]),
            json.loads(text["adapter_scale"])) == (["sketch", "grey"], ["sketch.png", "depth.png"], [0.8, 0.5])
    assert text["parameters"].endswith(', Denoising strength: 0.75, T2I-Adapter: "sketch (0.8), grey (0.5)", '
                                       'T2I-Adapter image: "sketch.png, depth.png"')
    assert np.abs(images([0.8, 0.0])[0] - expected[0]).max() > 0.02  # the grey adapter steers too


def test_sdxl_takes_its_adapter_class_and_factor(tmp_path, capsys, monkeypatch):
    """Configs only: an SDXL checkpoint's adapter (features after its first, plain, block and at its mid block)
    fits, generate takes StableDiffusionXLAdapter, the factor is recorded; --refiner with it is refused."""
    from builders import torch_xl_pipeline

    from sdflax import StableDiffusionXLAdapter, StableDiffusionXLImg2Img
    from sdflax.cli import Request, build_parser, png_info
    from sdflax.cli.output import image_settings
    from sdflax.cli.preflight import check_checkpoint

    torch_xl_pipeline("euler").save_pretrained(tmp_path / "xl")
    torch_adapter(XL_ADAPTER, 5).save_pretrained(tmp_path / "adapter")
    Image.new("L", (32, 32), 128).save(tmp_path / "edges.png")
    monkeypatch.chdir(tmp_path)

    def checked(command, *flags):
        request = Request.from_args(build_parser().parse_args([command, "a house", "--model", "xl", "--t2i-adapter",
                                                               "adapter", "--adapter-image", "edges.png", *flags]))
        return request, check_checkpoint(request, {"image": Image.open("edges.png").convert("RGB")}
                                         if command == "img2img" else {})[0]

    request, checkpoint = checked("generate", "--adapter-factor", "0.5")
    assert checkpoint.pipeline is StableDiffusionXLAdapter and (checkpoint.width, checkpoint.height) == (32, 32)
    adapters = checkpoint.features["t2i_adapter"]
    assert (adapters.scales, adapters.factor) == ((1.0,), 0.5)
    settings = {**image_settings(request, checkpoint.scheduler, checkpoint, "float32"), "seed": 1}
    assert settings["adapter_factor"] == 0.5
    assert png_info(settings).chunks[-1][1].decode().endswith(
        ", T2I-Adapter: adapter (1.0), T2I-Adapter image: edges.png, T2I-Adapter factor: 0.5")
    _, checkpoint = checked("img2img", "--image", "edges.png")
    assert checkpoint.pipeline is StableDiffusionXLImg2Img
    assert checkpoint.features["t2i_adapter"].factor == 1.0  # the default
    capsys.readouterr()
    assert main(["generate", "a house", "--model", "xl", "--t2i-adapter", "adapter", "--adapter-image", "edges.png",
                 "--refiner", "xl", "--out", str(tmp_path / "out")]) == 2
    assert "--refiner xl with --t2i-adapter is not supported: drop one of them" in one_error_line(capsys)


ADAPTER = ["--t2i-adapter", "sketch", "--adapter-image", "sketch.png"]


@pytest.mark.parametrize("args, expected", [
    (["--adapter-image", "sketch.png"], "--adapter-image applies with --t2i-adapter (the picture's adapter): add "
     "--t2i-adapter ID_OR_DIR, or leave it out"),
    (["--adapter-scale", "0.5"], "--adapter-scale applies with --t2i-adapter"),
    (["--adapter-factor", "0.5"], "--adapter-factor applies with --t2i-adapter"),
    (["--t2i-adapter", "sketch"], "1 --t2i-adapter and 0 --adapter-image: give one --adapter-image per "
     "--t2i-adapter, in the same order"),
    ([*ADAPTER, "--adapter-image", "depth.png"], "1 --t2i-adapter and 2 --adapter-image"),
    ([*ADAPTER, "--adapter-scale", "1", "--adapter-scale", "2"], "2 --adapter-scale for 1 --t2i-adapter: give one "
     "for all adapters or one per adapter"),
    ([*ADAPTER, "--adapter-scale", "nan"], "argument --adapter-scale: must be a finite number"),
    ([*ADAPTER, "--adapter-factor", "2"], "argument --adapter-factor: must be in [0, 1], got 2.0"),
    (["--t2i-adapter", "sketch", "--adapter-image", "nowhere.png"], "--adapter-image nowhere.png: cannot read it "
     "(No such file or directory)"),
    ([*ADAPTER, "--adapter-factor", "0.5"], f"--adapter-factor is for SDXL's T2I-Adapters, but {TINY} is not an "
     "SDXL checkpoint (its adapters steer every step): drop --adapter-factor"),
    (["--t2i-adapter", "nobody/none", "--adapter-image", "sketch.png"], "--t2i-adapter nobody/none: nobody/none is "
     "not in the Hugging Face cache"),
    (["--t2i-adapter", "./nowhere", "--adapter-image", "sketch.png"], "--t2i-adapter ./nowhere: ./nowhere: no such "
     "folder"),
    (["--t2i-adapter", "sketch/config.json", "--adapter-image", "sketch.png"], "--t2i-adapter sketch/config.json is "
     "a file: give the folder of a diffusers T2IAdapter"),
    (["--t2i-adapter", f"{TINY}/unet", "--adapter-image", "sketch.png"], f"--t2i-adapter {TINY}/unet is a "
     "UNet2DConditionModel, not a T2IAdapter"),
    (["--t2i-adapter", "wide", "--adapter-image", "sketch.png"], f"--t2i-adapter wide does not fit {TINY}: its "
     "features are 64 wide at 1/4, 64 wide at 1/8, 64 wide at 1/16 of the picture, the UNet's down blocks take 32 "
     "wide at 1/4, 64 wide at 1/8, 64 wide at 1/16: use a T2I-Adapter made for this base model"),
    (["--t2i-adapter", "coarse", "--adapter-image", "sketch.png"], "--t2i-adapter coarse does not fit"),
    (["--t2i-adapter", "rgba", "--adapter-image", "sketch.png"], "--t2i-adapter rgba takes pictures of 4 channels: "
     "sdflax gives a T2I-Adapter RGB (3) or grey (1) pictures"),
    ([*ADAPTER, "--height", "40", "--width", "32"], "--t2i-adapter sketch needs an output size of multiples of 16 "
     "(its total downscale factor), not 32x40: give --width and --height multiples of 16, e.g. --width 32 --height "
     "32"),
])
def test_bad_input_is_one_line_and_status_2(args, expected, folder, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(folder)
    assert main(["generate", "a house", "--model", TINY, *args, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


def test_help_lists_the_t2i_adapter_options(capsys):
    options = "--t2i-adapter ID_OR_DIR", "--adapter-image IMG", "--adapter-scale S", "--adapter-factor F"
    assert_help_lists(capsys, *options)
    assert main(["batch", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(option in out for option in options), out
