"""`--ip-adapter / --ip-image / --ip-image-encoder` on `sdflax generate` and `batch`, end to end on a copy of
weights/tiny-sd with random IP-Adapters in h94's layout (its `models/` folder): the PNGs equal the library's images
and record the adapters; bad input in process (it fails before JAX starts). Two generate runs compile; the library
calls and the batch run (in process) load their programs from the session's cache."""

import json
import shutil

import numpy as np
import pytest
from builders import VISION, h94_file, write_ip_adapters
from PIL import Image
from test_cli import TINY, assert_help_lists, one_error_line
from test_cli_controlnet import assert_close_to, run_cli_here

from sdflax.cli import main

BASE, PLUS = "tiny/models/ip-adapter_base.safetensors", "tiny/models/ip-adapter_plus.safetensors"
SIZE = ["--steps", "2", "--height", "32", "--width", "32", "--no-progress"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """tiny/ (tiny-sd, its IP-Adapters and their image encoder in tiny/models/, as h94's repository), other/ (an
    adapter for a text width of 48, no encoder beside it) and two pictures of other sizes than the encoder's."""
    from diffusers import UNet2DConditionModel

    tmp = tmp_path_factory.mktemp("ip-adapter-cli")
    shutil.copytree(TINY, tmp / "tiny")
    unet = UNet2DConditionModel.from_pretrained(TINY, subfolder="unet")
    write_ip_adapters(tmp / "tiny" / "models", unet, {"base": 1, "plus": 3})
    (tmp / "other").mkdir()
    widths = [unet.get_submodule(name[: -len(".processor")]).to_k.out_features
              for name in unet.attn_processors if name.endswith("attn2.processor")]
    h94_file(tmp / "other" / "ip-adapter_wide.safetensors", "base", 48, widths, 5)
    rng = np.random.default_rng(0)
    for name, size in (("face.png", (40, 30)), ("style.png", (20, 36))):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(tmp / name)
    assert VISION["image_size"] not in (40, 30, 20, 36)  # the pictures are resized and cropped as CLIP takes them
    return tmp


@pytest.fixture(scope="module")
def library(folder):
    """images(names, scales, pictures, seeds): the library's images for the CLI's inputs, as the CLI makes them:
    tiny-sd with the adapters from one folder (`load_ip_adapter` with a list of names), CLIP pixels of each row's
    picture per adapter, a raw key per row (as `sample_rows` makes them), the empty negative prompt's ids, guidance
    7.5, 2 steps, 32x32, by `generate_sharded` over every device."""
    import jax

    from sdflax import StableDiffusion

    pipe, params = StableDiffusion.from_pretrained(folder / "tiny")

    def images(names, scales, pictures, seeds):
        ip_pipe, ip_params = pipe.load_ip_adapter(params, folder / "tiny", subfolder="models", weight_name=names)
        keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(seed))) for seed in seeds])
        n = len(keys)
        pixels = [np.concatenate([ip_pipe.prepare_ip_adapter_image(Image.open(folder / p).convert("RGB"))
                                  for p in row]) for row in pictures]
        ids, neg = pipe.prepare_inputs(["a house"] * n), pipe.prepare_inputs([""] * n)
        return ip_pipe.generate_sharded(ids, ip_params, keys, 2, guidance_scale=7.5, neg_prompt_ids=neg, height=32,
                                        width=32, ip_adapter_image=pixels, ip_adapter_scale=scales)
    return images


def generate(folder, tmp_path, *flags):
    result = run_cli_here(["generate", "a house", "--model", "tiny", *SIZE, "--seed", "7", *flags, "--out",
                           str(tmp_path / "out")], tmp_path, cwd=folder)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_one_adapter_at_a_scale_and_a_batch_of_image_prompts_equal_the_library(folder, tmp_path, library, capsys,
                                                                                monkeypatch):
    import jax

    paths = generate(folder, tmp_path, "--ip-adapter", f"{BASE}:0.6", "--ip-image", "face.png")
    n = jax.local_device_count()
    expected = library(["ip-adapter_base.safetensors"], [0.6], [["face.png"] * n], range(7, 7 + n))
    assert expected.std() > 0.05  # not a blank image: the comparison means something
    for path, image in zip(paths, expected):
        assert_close_to(path, image)
        text = Image.open(path).text
        assert (json.loads(text["ip_adapter"]), json.loads(text["ip_adapter_scale"]),
                json.loads(text["ip_image"])) == ([BASE], [0.6], ["face.png"])
        assert "ip_image_encoder" not in text
        assert text["parameters"].endswith(f", Size: 32x32, Model: tiny, IP-Adapter: {BASE} (0.6), IP-Adapter "
                                           "image: face.png")
    # the adapter steers: the same seed at scale 0 differs (a traced scale: the same program)
    off = library(["ip-adapter_base.safetensors"], [0.0], [["face.png"] * n], range(7, 7 + n))
    assert np.abs(off[0] - expected[0]).max() > 0.02

    # sdflax batch, in process: a line's own ip_image beside the command's --ip-image, one batch of every device
    # (the last line repeated), the program of the run above
    monkeypatch.chdir(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a house"}\n{"prompt": "a house", "ip_image": "style.png"}\n')
    assert main(["batch", str(prompts), "--out", str(tmp_path / "batch"), "--model", "tiny", *SIZE, "--seed", "7",
                 "--ip-adapter", f"{BASE}:0.6", "--ip-image", "face.png", "--num-processes", "1"]) == 0, \
        capsys.readouterr().err
    expected = library(["ip-adapter_base.safetensors"], [0.6], [["face.png"] + ["style.png"] * (n - 1)],
                       [7] + [8] * (n - 1))
    records = [json.loads(line) for line in (tmp_path / "batch" / "manifest.jsonl").read_text().splitlines()]
    assert [(r["line"], r["settings"]["ip_image"]) for r in records] == [(1, ["face.png"]), (2, ["style.png"])]
    for record, image in zip(records, expected):
        path = tmp_path / "batch" / record["file"]
        assert_close_to(path, image)
        assert Image.open(path).text["parameters"].endswith(f"IP-Adapter image: {record['settings']['ip_image'][0]}")
    assert np.abs(expected[0] - expected[1]).max() > 0.02  # each line its own image prompt


def test_two_adapters_with_their_encoder_given_equal_the_library(folder, tmp_path, library):
    import jax

    paths = generate(folder, tmp_path, "--ip-adapter", BASE, "--ip-image", "face.png", "--ip-adapter",
                     f"{PLUS}:0.5", "--ip-image", "style.png", "--ip-image-encoder", "tiny/models/image_encoder")
    n = jax.local_device_count()
    expected = library(["ip-adapter_base.safetensors", "ip-adapter_plus.safetensors"], [1.0, 0.5],
                       [["face.png"] * n, ["style.png"] * n], range(7, 7 + n))
    for path, image in zip(paths, expected):
        assert_close_to(path, image)
        text = Image.open(path).text
        assert (json.loads(text["ip_adapter"]), json.loads(text["ip_adapter_scale"]), json.loads(text["ip_image"]),
                text["ip_image_encoder"]) == ([BASE, PLUS], [1.0, 0.5], ["face.png", "style.png"],
                                              "tiny/models/image_encoder")
        assert text["parameters"].endswith(f', IP-Adapter: "{BASE} (1.0), {PLUS} (0.5)", IP-Adapter image: '
                                           '"face.png, style.png"')
    # the second adapter steers: without it (scale 0) the image differs
    alone = library(["ip-adapter_base.safetensors", "ip-adapter_plus.safetensors"], [1.0, 0.0],
                    [["face.png"] * n, ["style.png"] * n], range(7, 7 + n))
    assert np.abs(alone[0] - expected[0]).max() > 0.02


ADAPTER = ["--ip-adapter", BASE]


@pytest.mark.parametrize("args, expected", [
    (["--ip-image", "face.png"], "--ip-image applies with --ip-adapter (the image prompt's adapter): add "
     "--ip-adapter ID_OR_FILE, or leave it out"),
    (["--ip-image-encoder", "tiny/models/image_encoder"], "--ip-image-encoder applies with --ip-adapter"),
    (ADAPTER, "1 --ip-adapter and 0 --ip-image: give one --ip-image per --ip-adapter, in the same order"),
    ([*ADAPTER, "--ip-image", "face.png", "--ip-image", "style.png"], "1 --ip-adapter and 2 --ip-image: give one"),
    ([*ADAPTER, "--ip-image", "nowhere.png"], "--ip-image nowhere.png: cannot read it (No such file or directory)"),
    (["--ip-adapter", f"{BASE}:strong", "--ip-image", "face.png"], f"argument --ip-adapter: {BASE}:strong: the "
     f"scale 'strong' is not a number: write ID_OR_FILE:SCALE with a number, e.g. {BASE}:0.6"),
    (["--ip-adapter", f"{BASE}:nan", "--ip-image", "face.png"], "the scale must be a finite float32 number"),
    (["--ip-adapter", "tiny/models", "--ip-image", "face.png"], "argument --ip-adapter: 'tiny/models' is not an "
     "IP-Adapter file (.safetensors or .bin)"),
    (["--ip-adapter", "tiny/models/none.safetensors", "--ip-image", "face.png"],
     "--ip-adapter tiny/models/none.safetensors: no such file: give the path of an IP-Adapter file"),
    (["--ip-adapter", "nobody/none/models/x.safetensors", "--ip-image", "face.png"],
     "--ip-adapter nobody/none/models/x.safetensors: nobody/none is not in the Hugging Face cache"),
    ([*ADAPTER, "--ip-image", "face.png", "--ip-adapter", "other/ip-adapter_wide.safetensors", "--ip-image",
      "face.png"], f"--ip-adapter {BASE} and --ip-adapter other/ip-adapter_wide.safetensors are in different "
     "places: several IP-Adapters load from one folder"),
    (["--ip-adapter", "other/ip-adapter_wide.safetensors", "--ip-image", "face.png"],
     "--ip-adapter other/ip-adapter_wide.safetensors: no image encoder beside it (image_encoder/config.json, as in "
     "h94's repository): give its folder with --ip-image-encoder"),
    ([*ADAPTER, "--ip-image", "face.png", "--ip-image-encoder", "./nowhere"],
     "--ip-image-encoder ./nowhere: no such folder"),
    ([*ADAPTER, "--ip-image", "face.png", "--ip-image-encoder", "tiny/models"],
     "--ip-image-encoder tiny/models: no config.json in it"),
    (["--ip-adapter", "other/ip-adapter_wide.safetensors", "--ip-image", "face.png", "--ip-image-encoder",
      "tiny/models/image_encoder"], "--ip-adapter other/ip-adapter_wide.safetensors was made for another model "
     "family than tiny (text width 48 vs 32): use an IP-Adapter made for this base model"),
])
def test_bad_input_is_one_line_and_status_2(args, expected, folder, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(folder)
    assert main(["generate", "a house", "--model", "tiny", *args, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


def test_an_image_prompt_the_encoder_cannot_resize_names_its_file(folder, tmp_path, capsys, monkeypatch):
    """A strip far from square (the encoder's resize would grow it without bound) was refused without naming
    --ip-image (issue 59's hostile cases, cause 2)."""
    monkeypatch.chdir(folder)
    strip = tmp_path / "strip.png"
    Image.new("L", (100000, 1)).save(strip)
    assert main(["generate", "a house", "--model", "tiny", "--no-progress", *ADAPTER, "--ip-image", str(strip),
                 "--out", str(tmp_path / "out")]) == 2
    assert f"--ip-image {strip}: an image of 100000x1 pixels, resized to 28 on its short side" in \
        one_error_line(capsys)


@pytest.mark.parametrize("lines, flags, expected", [
    (['{"prompt": "a fox", "ip_image": "face.png"}'], [], "line 1: ip_image applies with --ip-adapter"),
    (['{"prompt": "a fox", "ip_image": ["face.png", "style.png"]}'], ADAPTER,
     "line 1: 2 ip_image for 1 --ip-adapter: give a list of one per adapter, in their order"),
    (['{"prompt": "a fox", "ip_image": 3}'], ADAPTER, "line 1: ip_image must be a path or a list of paths, got 3"),
    (['{"prompt": "a fox", "ip_image": "face.png"}', '{"prompt": "a cat"}'], ADAPTER,
     'line 2: no ip_image and no --ip-image: give the line an "ip_image" or the command an --ip-image per '
     "--ip-adapter"),
    (['{"prompt": "a fox"}', '{"prompt": "a cat", "ip_image": "nowhere.png"}'], [*ADAPTER, "--ip-image", "face.png"],
     "line 2: ip_image nowhere.png: cannot read it"),
    (['{"prompt": "a fox", "cfg": 3}'], ADAPTER, "unknown key 'cfg': a line may set prompt, negative_prompt, seed, "
     "guidance, steps, width, height, ip_image"),
])
def test_bad_batch_lines_are_one_line_naming_the_line(lines, flags, expected, folder, tmp_path, capsys,
                                                      monkeypatch):
    monkeypatch.chdir(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    assert main(["batch", str(prompts), "--out", str(tmp_path / "out"), "--model", "tiny", *flags]) == 2
    err = one_error_line(capsys)
    assert f"PROMPTS {prompts} " in err and expected in err


def test_help_lists_the_ip_adapter_options(capsys):
    options = "--ip-adapter ID_OR_FILE[:SCALE]", "--ip-image IMG", "--ip-image-encoder ID_OR_DIR"
    assert_help_lists(capsys, *options)
    assert main(["batch", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(option in out for option in options) and "ip_image with --ip-adapter" in out
