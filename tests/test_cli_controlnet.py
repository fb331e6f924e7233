"""`--controlnet / --control-image / --control-scale` on `sdflax generate`, `img2img` and `inpaint`, end to end on
weights/tiny-sd with small random ControlNets made for it: the PNGs equal the library's images and record the nets;
bad input in process (it fails before JAX starts)."""

import json
import os
import shutil

import numpy as np
import pytest
from builders import torch_controlnet
from PIL import Image
from test_cli import TINY, assert_help_lists, one_error_line, pixels, run_cli

import jax

from sdflax.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Two ControlNets for tiny-sd (condition scale 4, its VAE's), a 34x30 control image each (not a multiple of
    4), and a 32x28 picture with its mask."""
    from diffusers import UNet2DConditionModel

    tmp = tmp_path_factory.mktemp("controlnet-cli")
    unet = UNet2DConditionModel.from_pretrained(TINY, subfolder="unet")
    for k in (1, 2):
        torch_controlnet(unet, channels=(8, 16, 16), seed=k).save_pretrained(tmp / f"net{k}")
    rng = np.random.default_rng(0)
    for name, size in (("edges.png", (30, 34)), ("depth.png", (30, 34)), ("in.png", (28, 32))):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(tmp / name)
    mask = np.zeros((28, 32), np.uint8)
    mask[6:20, 4:26] = 255
    Image.fromarray(mask).save(tmp / "mask.png")
    return tmp


def as_the_cli(seed):
    """The CLI's keys on this session's devices: it fills every device (a row each, seeds seed, seed + 1, ...) and
    gives each row a raw key (numpy, as `sample_rows` makes them)."""
    keys = [np.asarray(jax.random.key_data(jax.random.key(seed + i))) for i in range(jax.local_device_count())]
    return np.stack(keys)


def run_cli_here(args, tmp, cwd):
    """run_cli on this session's devices and with its compile cache: the library calls below, made as the CLI
    makes them (`generate_sharded` over every device, its keys and settings), then load the programs the CLI
    compiled instead of compiling them again (a cached program is one of a device count)."""
    return run_cli(args, tmp, devices=jax.local_device_count(), cwd=cwd,
                   env={"SDFLAX_CACHE_DIR": os.environ["SDFLAX_CACHE_DIR"]})


def library(folder, kind, nets):
    """(pipeline, params) of tiny-sd with the nets, as the CLI loads them."""
    from sdflax import ControlNetModel

    loaded = [ControlNetModel.from_pretrained(folder / net) for net in nets]
    pipe, params = kind.from_pretrained(TINY, controlnet=[net for net, _ in loaded])
    params["controlnet"] = [p for _, p in loaded]
    return pipe, params


def library_images(folder, pipe, params, seed, scales, controls, pictures=(), strength=None):
    """What the library makes for the CLI's inputs, as the CLI makes them: control images resized to 32x28 as the
    CLI does, the CLI's keys (`as_the_cli`), the empty negative prompt's ids, guidance 7.5, 2 steps, by
    `generate_sharded` over every device. The CLI's first images are the first rows."""
    from sdflax.pipeline.images import preprocess_images
    from sdflax.pipeline.images import preprocess_images_and_masks
    from sdflax.pipeline.images import preprocess_control_images

    keys = as_the_cli(seed)
    n = len(keys)
    control = [np.repeat(preprocess_control_images(Image.open(folder / c).convert("RGB").resize(
        (32, 28), Image.LANCZOS), pipe.vae_scale_factor), n, 0) for c in controls]
    ids, neg = pipe.prepare_inputs(["a house"] * n), pipe.prepare_inputs([""] * n)
    if not pictures:
        return pipe.generate_sharded(ids, control, params, keys, 2, guidance_scale=7.5, neg_prompt_ids=neg,
                                     controlnet_conditioning_scale=scales, height=28, width=32)
    image = Image.open(folder / pictures[0]).convert("RGB")
    if len(pictures) == 2:
        images = preprocess_images_and_masks([image], [Image.open(folder / pictures[1])], pipe.vae_scale_factor)
    else:
        images = [preprocess_images([image], pipe.vae_scale_factor)]
    images = [np.repeat(x, n, 0) for x in images]
    return pipe.generate_sharded(ids, *images, control, params, keys, strength, 2, guidance_scale=7.5,
                                 neg_prompt_ids=neg, controlnet_conditioning_scale=scales)


def assert_close_to(path, expected):
    """uint8 PNG pixels against the library's float image (rounding: at most one level)."""
    assert np.abs(pixels(path).astype(np.float32) - np.round(expected * 255)).max() <= 1


def test_generate_with_two_nets(folder, tmp_path):
    from sdflax import StableDiffusionControlNet

    result = run_cli_here(["generate", "a house", "--model", TINY, "--steps", "2", "--seed", "7", "--num-images",
                           "2", "--controlnet", "net1", "--control-image", "edges.png", "--controlnet", "net2",
                           "--control-image", "depth.png", "--control-scale", "1.0", "--control-scale", "0.5",
                           "--no-progress", "--out", str(tmp_path / "out")], tmp_path, cwd=folder)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[0] == ("sdflax: warning: --control-image edges.png is 34x30: resized to "
                                             "32x28, a multiple of 4 (the VAE scale factor)")
    paths = result.stdout.split()
    pipe, params = library(folder, StableDiffusionControlNet, ["net1", "net2"])
    controls = ["edges.png", "depth.png"]
    expected = library_images(folder, pipe, params, 7, [1.0, 0.5], controls)
    for path, image in zip(paths, expected):
        assert_close_to(path, image)
        text = Image.open(path).text
        assert json.loads(text["controlnet"]) == ["net1", "net2"]
        assert json.loads(text["control_image"]) == ["edges.png", "depth.png"]
        assert json.loads(text["control_scale"]) == [1.0, 0.5]
        assert text["parameters"].endswith(', Size: 32x28, Model: ' + TINY + ', ControlNet 0: "Model: net1, '
                                           'Weight: 1.0", ControlNet 1: "Model: net2, Weight: 0.5"')
    # the nets steer: the same seed with the second net off differs (a traced scale: the same program)
    other = library_images(folder, pipe, params, 7, [1.0, 0.0], controls)
    assert np.abs(other[0] - expected[0]).max() > 0.02


@pytest.mark.parametrize("command, pictures, strength, scale", [
    ("img2img", ["in.png"], 0.75, 0.8),
    ("inpaint", ["in.png", "mask.png"], 1.0, 0.5),
])
def test_img2img_and_inpaint_with_a_net_and_diffusers_default_scales(folder, tmp_path, command, pictures, strength,
                                                                    scale):
    from sdflax import StableDiffusionControlNetImg2Img, StableDiffusionControlNetInpaint

    flags = ["--image", "in.png"] + (["--mask", "mask.png"] if command == "inpaint" else [])
    result = run_cli_here([command, "a house", *flags, "--model", TINY, "--steps", "2", "--seed", "3",
                           "--strength", str(strength), "--controlnet", "net1", "--control-image", "edges.png",
                           "--num-images", "1", "--no-progress", "--out", str(tmp_path / "out.png")], tmp_path,
                          cwd=folder)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr  # the control image is resized to --image's size, as diffusers does
    kind = {"img2img": StableDiffusionControlNetImg2Img, "inpaint": StableDiffusionControlNetInpaint}[command]
    pipe, params = library(folder, kind, ["net1"])
    expected = library_images(folder, pipe, params, 3, [scale], ["edges.png"], pictures, strength)[0]
    assert_close_to(tmp_path / "out.png", expected)
    assert json.loads(Image.open(tmp_path / "out.png").text["control_scale"]) == [scale]


@pytest.mark.parametrize("args, expected", [
    (["--controlnet", "net1"], "1 --controlnet and 0 --control-image: give one --control-image per --controlnet"),
    (["--control-image", "edges.png"], "0 --controlnet and 1 --control-image"),
    (["--controlnet", "net1", "--control-image", "edges.png", "--control-scale", "1", "--control-scale", "2"],
     "2 --control-scale for 1 --controlnet: give one for all nets or one per net"),
    (["--controlnet", "net1", "--control-image", "edges.png", "--control-scale", "nan"],
     "--control-scale nan: give a finite float32 number"),
    (["--controlnet", "net1", "--control-image", "edges.png", "--control-scale", "1e39"],
     "--control-scale 1e+39: give a finite float32 number"),
    (["--control-scale", "0.5"], "--control-scale without --controlnet: it says how strongly the nets steer"),
    (["--controlnet", "net1", "--control-image", "mask.txt"], "--control-image mask.txt: cannot read it"),
    (["--controlnet", "nowhere/none", "--control-image", "edges.png"], "--controlnet nowhere/none:"),
    (["--controlnet", "wide", "--control-image", "edges.png"],
     "--controlnet wide was made for another model family than"),
    (["--controlnet", "coarse", "--control-image", "edges.png"],  # was a ValueError at compile, once loaded
     "--controlnet coarse: a ControlNet whose condition encoder makes 1/8 of the picture's size (4 "
     "conditioning_embedding_out_channels), but the VAE's latents are 1/4 of it: use a ControlNet trained for this "
     "base model"),
    (["--controlnet", "net1", "--control-image", "edges.png", "--controlnet-config", "net2"],
     "--controlnet-config applies to original-layout --controlnet files (.safetensors, .pth), but no --controlnet "
     "is one: drop --controlnet-config"),
])
def test_bad_input_is_one_line_and_status_2(args, expected, folder, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (folder / "mask.txt").write_text("not a picture")
    if not (folder / "wide").exists():  # a net for a text encoder of another width
        shutil.copytree(folder / "net1", folder / "wide")
        config = json.loads((folder / "wide" / "config.json").read_text())
        (folder / "wide" / "config.json").write_text(json.dumps({**config, "cross_attention_dim": 768}))
    if not (folder / "coarse").exists():  # a net whose condition encoder has one level more than the VAE
        shutil.copytree(folder / "net1", folder / "coarse")
        config = json.loads((folder / "coarse" / "config.json").read_text())
        (folder / "coarse" / "config.json").write_text(json.dumps({**config, "conditioning_embedding_out_channels":
                                                                   [8, 8, 8, 8]}))
    assert main(["generate", "a house", "--model", TINY, *args, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


def test_inpaint_with_a_unet_controlnet_needs_its_control_image(folder, tmp_path, capsys, monkeypatch):
    """A UNet's nets read --control-image in inpaint too (only SD 3.x's inpainting net reads --image and --mask)."""
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["inpaint", "a house", "--image", "in.png", "--mask", "mask.png", "--model", TINY, "--controlnet",
                 "net1", "--out", str(tmp_path / "out")]) == 2
    assert "1 --controlnet and 0 --control-image: give one --control-image per --controlnet" in one_error_line(capsys)


def test_help_lists_the_controlnet_options(capsys):
    assert_help_lists(capsys, "--controlnet ID_OR_PATH", "--controlnet-config ID_OR_DIR", "--control-image IMG",
                      "--control-scale S")


def test_an_original_layout_net_takes_its_config_from_controlnet_config(folder, tmp_path, capsys, monkeypatch):
    """Friction: an original-layout ControlNet file whose architecture its tensors do not tell (here a 32-wide
    test net) could not be used from the command line, and the error said "pass config=", a Python argument.
    --controlnet-config gives its config; the net loads (in process: no compile) with the folder's params."""
    from diffusers import ControlNetModel as TorchControlNet
    from flax import traverse_util
    from safetensors.torch import save_file
    from test_controlnet_model import controlnet_to_ldm

    from sdflax import ControlNetModel
    from sdflax.cli import Request, build_parser
    from sdflax.cli.batch import add_command
    from sdflax.cli.preflight import check_checkpoint
    from sdflax.cli.run import load

    monkeypatch.chdir(folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    theirs = TorchControlNet.from_pretrained(folder / "net1")
    net_file = str(tmp_path / "net1.safetensors")
    save_file(controlnet_to_ldm(theirs.state_dict(), dict(theirs.config)), net_file)
    args = ["generate", "a house", "--model", TINY, "--controlnet", net_file, "--control-image", "edges.png",
            "--height", "28", "--width", "32", "--no-progress", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = one_error_line(capsys)
    assert f"--controlnet {net_file}: " in err and "cannot tell the base model of this ControlNet" in err
    assert "pass --controlnet-config <the diffusers folder or hub id of a ControlNet" in err and "config=" not in err
    assert main([*args, "--controlnet-config", "net1", "--controlnet-config", "net2"]) == 2
    assert "2 --controlnet-config for 1 original-layout --controlnet files: give one per file" in one_error_line(
        capsys)

    request = Request.from_args(build_parser(add_command).parse_args([*args, "--controlnet-config", "net1"]))
    checkpoint, _ = check_checkpoint(request, {})
    _, params = load(request, checkpoint, "float32")
    _, expected = ControlNetModel.from_pretrained(folder / "net1")
    flat, expected = traverse_util.flatten_dict(params["controlnet"][0]), traverse_util.flatten_dict(expected)
    assert flat.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_array_equal(flat[path], value, err_msg="/".join(path))


@pytest.fixture(scope="module")
def xl_folder(tmp_path_factory):
    """A small SDXL base and an SDXL ControlNet made for it, a 32x32 picture, its mask and a control image."""
    from builders import torch_xl_pipeline

    tmp = tmp_path_factory.mktemp("controlnet-cli-xl")
    base = torch_xl_pipeline("euler")
    base.save_pretrained(tmp / "xl")
    torch_controlnet(base.unet, seed=4).save_pretrained(tmp / "net")
    rng = np.random.default_rng(1)
    for name in ("in.png", "edges.png"):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp / name)
    mask = np.zeros((32, 32), np.uint8)
    mask[6:22, 5:25] = 255
    Image.fromarray(mask).save(tmp / "mask.png")
    return tmp


@pytest.mark.parametrize("command", ["img2img", "inpaint"])
def test_sdxl_img2img_and_inpaint_with_a_net_equal_the_library_with_its_defaults(xl_folder, tmp_path, command):
    """The strength, guidance and net scale left out: the pipeline class's own defaults, in the CLI as in the
    library (which is given the default scale as the CLI passes scales, one per net: a list of one is another
    program than a number). 3 steps, as tests/test_controlnet_xl_images.py: its sharded programs are these."""
    from sdflax import ControlNetModel, StableDiffusionXLControlNetImg2Img, StableDiffusionXLControlNetInpaint

    mask = ["--mask", "mask.png"] if command == "inpaint" else []
    result = run_cli_here([command, "a house", "--image", "in.png", *mask, "--model", "xl", "--steps", "3", "--seed",
                           "3", "--controlnet", "net", "--control-image", "edges.png", "--num-images", "1",
                           "--no-progress", "--out", str(tmp_path / "out.png")], tmp_path, cwd=xl_folder)
    assert result.returncode == 0, result.stderr
    kind = {"img2img": StableDiffusionXLControlNetImg2Img, "inpaint": StableDiffusionXLControlNetInpaint}[command]
    net, net_params = ControlNetModel.from_pretrained(xl_folder / "net")
    pipe, params = kind.from_pretrained(xl_folder / "xl", controlnet=net)
    params["controlnet"] = net_params
    pictures = [[Image.open(xl_folder / "in.png")]] + ([[Image.open(xl_folder / "mask.png")]] if mask else [])
    arrays = pipe.prepare_inputs(["a house"], *pictures, [Image.open(xl_folder / "edges.png")])
    keys = as_the_cli(3)
    arrays = [jax.tree.map(lambda x: np.repeat(x, len(keys), 0), x) for x in arrays]  # the CLI's rows
    defaults = kind.defaults
    expected = pipe.generate_sharded(*arrays, params, keys, num_inference_steps=3,
                                     controlnet_conditioning_scale=[defaults["controlnet_conditioning_scale"]])[0]
    assert expected.std() > 0.05  # not a blank image: the comparison means something
    assert_close_to(tmp_path / "out.png", expected)
    text = Image.open(tmp_path / "out.png").text
    assert (text["strength"], text["guidance_scale"], json.loads(text["control_scale"])) == (
        str(defaults["strength"]), str(defaults["guidance_scale"]), [defaults["controlnet_conditioning_scale"]])
