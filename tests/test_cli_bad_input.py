"""Input a hostile tester found: files that would be overwritten, pictures whose header claims 30000x30000, values
that run and give garbage, 16-bit and transparent pictures. The CLI refuses in one line with status 2, in process
(before loading); the library reads 16-bit pictures at their bit depth."""

import contextlib
import json
import shutil
import io
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image
from test_cli import TINY, one_error_line

from sdflax.cli import main, read_picture as _read_picture
from sdflax.pipeline.images import preprocess_images
from sdflax.pipeline.images import preprocess_masks


def generate(*args):
    return main(["generate", "a fox", "--model", TINY, "--steps", "2", "--no-progress", *map(str, args)])


def test_out_never_overwrites_a_file(tmp_path, capsys):
    one = tmp_path / "existing.png"
    one.write_bytes(b"the user's picture")
    assert generate("--num-images", "1", "--out", one) == 2
    err = one_error_line(capsys)
    assert f"--out {one}: {one} exists: sdflax never overwrites a file; choose another --out, or a folder" in err
    assert one.read_bytes() == b"the user's picture"

    # The grid is NAME.png, the images NAME-SEED.png: all are checked once the seeds are known, before loading.
    grid, first, second = (tmp_path / n for n in ("k2.png", "k2-5.png", "k2-6.png"))
    for path in (first, second):
        path.write_bytes(path.name.encode())
    assert generate("--seed", 5, "--num-images", 2, "--grid", "--out", grid) == 2
    assert f"{first}, {second} exist: sdflax never overwrites" in one_error_line(capsys)
    assert [first.read_bytes(), second.read_bytes(), grid.exists()] == [b"k2-5.png", b"k2-6.png", False]
    grid.write_bytes(b"grid")  # the grid name alone is known before JAX starts
    assert generate("--num-images", 2, "--grid", "--out", grid) == 2
    assert f"{grid} exists" in one_error_line(capsys)
    assert grid.read_bytes() == b"grid"


def test_num_images_is_bounded_before_loading(capsys):
    """--num-images 100000000 loaded the model, then died with a MemoryError while tokenizing."""
    assert generate("--num-images", 100000000) == 2
    assert "argument --num-images: must be at most 1024, got 100000000 (one call makes them all: `sdflax batch` " \
           "makes any number, a batch at a time)" in one_error_line(capsys)


def test_a_full_disk_leaves_no_partial_png(tmp_path, monkeypatch):
    """generate wrote straight to the final name: a full disk left a 0-byte NAME.png that the next run refused."""
    import errno

    from sdflax.cli.output import write_png

    image = Image.new("RGB", (8, 8))

    def full_disk(self, f, *args, **kwargs):
        f.write(b"\x89PNG partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        write_png(tmp_path / "fox.png", image, None)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    (tmp_path / "taken.png").write_bytes(b"mine")
    with pytest.raises(FileExistsError) as info:
        write_png(tmp_path / "taken.png", image, None)
    assert info.value.filename == tmp_path / "taken.png" and (tmp_path / "taken.png").read_bytes() == b"mine"
    write_png(tmp_path / "fox.png", image, None)
    assert Image.open(tmp_path / "fox.png").size == (8, 8) and sorted(p.name for p in tmp_path.iterdir()) == \
        ["fox.png", "taken.png"]


def test_float_pictures_are_read_from_0_to_1(tmp_path):
    """An all-1.0 float TIFF mask acted as black, as a control image almost black (read as 0..255 values)."""
    path = tmp_path / "mask.tif"
    Image.fromarray(np.array([[1.0, 0.5], [0.0, 2.0]], np.float32)).save(path)
    assert Image.open(path).mode == "F"
    picture = _read_picture("--mask", path)
    assert picture.mode == "L" and np.asarray(picture).tolist() == [[255, 128], [0, 255]]


def test_out_that_is_a_folder_named_png_or_a_file(tmp_path, capsys):
    (tmp_path / "x.png").mkdir()
    assert generate("--out", tmp_path / "x.png") == 2
    assert f"--out {tmp_path / 'x.png'} is a folder: write {tmp_path / 'x.png'}/ to put the images in it" in \
        one_error_line(capsys)
    (tmp_path / "x.txt").write_text("notes")
    assert generate("--out", tmp_path / "x.txt") == 2
    assert "is a file, not a folder" in one_error_line(capsys)
    assert (tmp_path / "x.txt").read_text() == "notes"


def png_claiming(path, width, height):
    """A PNG of a few bytes whose header says width x height (its IHDR rewritten, CRC fixed)."""
    buffer = io.BytesIO()
    Image.new("L", (8, 8)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("size", [(30000, 30000), (10000, 10000), (9000, 9000)])  # Pillow: error, warning, none
def test_pictures_whose_header_claims_too_many_pixels(size, tmp_path, capsys):
    bomb = png_claiming(tmp_path / "bomb.png", *size)
    small = tmp_path / "small.png"
    Image.new("RGB", (32, 32)).save(small)
    runs = {"--image": ["img2img", "x", "--image", bomb],
            "--mask": ["inpaint", "x", "--image", small, "--mask", bomb],
            "--control-image": ["generate", "x", "--controlnet", "some/net", "--control-image", bomb]}
    for flag, args in runs.items():
        with no_bomb_warning():
            assert main([*map(str, args), "--model", TINY, "--out", str(tmp_path / "out")]) == 2
        err = one_error_line(capsys)
        assert f"{flag} {bomb}: the picture is " in err and "larger than sdflax reads (8192x8192 at most)" in err
        if size == (9000, 9000):
            assert "is 9000x9000 pixels" in err


@contextlib.contextmanager
def no_bomb_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [w for w in caught if "DecompressionBomb" in w.category.__name__], caught


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e39"])  # 1e39: finite, but inf in float32
def test_guidance_must_be_finite(value, tmp_path, capsys):
    assert generate(f"--guidance={value}", "--out", tmp_path / "out") == 2  # = lets argparse read -inf
    assert (f"argument --guidance: must be a finite number (as float32, the type the programs compute in), got "
            f"'{value}'") in one_error_line(capsys)


@pytest.mark.parametrize("flag", ["--guidance", "--adapter-scale", "--slg-scale", "--true-cfg"])
def test_scales_past_float32s_safe_range_are_refused(flag, tmp_path, capsys):
    """--guidance 3e38 (finite in float32) was refused by the library without naming the flag; --adapter-scale 3e38
    drew a NaN image (issue 59's hostile cases)."""
    from sdflax.cli.parse import SCALE_BOUND
    from sdflax.guiders.base import NUMBER_BOUND

    assert SCALE_BOUND == NUMBER_BOUND
    assert generate(f"{flag}=-3e38", "--out", tmp_path / "out") == 2
    assert f"argument {flag}: must be at most 1e+08 in magnitude (past it float32 arithmetic overflows into a black " \
           "image), got '-3e38'" in one_error_line(capsys)


@pytest.mark.parametrize("steps, expected", [
    (1001, "num_inference_steps must be in [1, 1000] (num_train_timesteps), got 1001"),
    (1000, "puts the first step at t=1000, past the last training timestep 999"),  # tiny-sd: leading, offset 1
])
def test_steps_the_scheduler_cannot_take_fail_before_loading(steps, expected, tmp_path, capsys):
    for scheduler in ([], ["--scheduler", "pndm"], ["--scheduler", "ddim"]):
        assert generate("--steps", steps, *scheduler, "--out", tmp_path / "out") == 2
        assert expected in one_error_line(capsys)


def sixteen_bit(path, values):
    Image.fromarray(np.asarray(values, np.uint16)).save(path)
    assert Image.open(path).mode in ("I;16", "I")
    return path


def test_sixteen_bit_pictures_keep_their_values(tmp_path):
    ramp = np.tile(np.linspace(0, 65535, 16).round(), (8, 1))  # black to white
    picture = _read_picture("--image", sixteen_bit(tmp_path / "grey16.png", ramp))
    assert picture.mode == "L"
    np.testing.assert_array_equal(np.asarray(picture), (ramp / 257).round())

    image = Image.open(tmp_path / "grey16.png")
    x = preprocess_images([image], 4)[0]  # (3, H, W) in [-1, 1]
    np.testing.assert_allclose(x[0], (ramp / 257).round() / 255 * 2 - 1, atol=1e-6)
    np.testing.assert_allclose(preprocess_images([ramp[..., None].astype(np.uint16)], 4)[0, 1], x[1], atol=1e-6)

    mask = np.zeros((8, 16))
    mask[:, 8:] = 40000  # 0.61: repainted
    mask[:, :4] = 30000  # 0.46: kept
    expected = (mask >= 32768).astype(np.float32)
    np.testing.assert_array_equal(preprocess_masks([Image.open(sixteen_bit(tmp_path / "m.png", mask))], 4)[0, 0],
                                  expected)
    np.testing.assert_array_equal(preprocess_masks([mask.astype(np.uint16)], 4)[0, 0], expected)


def test_masks_with_transparency_are_refused(tmp_path, capsys):
    rgba = np.full((8, 8, 4), 255, np.uint8)
    rgba[:4, ..., 3] = 0  # the region to repaint drawn as transparency
    with pytest.raises(ValueError, match="the mask has transparency"):
        preprocess_masks([Image.fromarray(rgba)], 4)
    with pytest.raises(ValueError, match="the mask has transparency"):
        preprocess_masks([rgba], 4)
    rgba[..., 3] = 255  # opaque: read as before
    assert preprocess_masks([Image.fromarray(rgba)], 4).shape == (1, 1, 8, 8)

    rgba[:4, ..., 3] = 0
    Image.fromarray(rgba).save(tmp_path / "mask.png")
    Image.new("RGBA", (8, 8), (10, 20, 30, 0)).save(tmp_path / "in.png")  # an image's alpha is dropped (diffusers)
    assert main(["inpaint", "x", "--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "mask.png"),
                 "--model", TINY, "--out", str(tmp_path / "out")]) == 2
    assert f"--mask {tmp_path / 'mask.png'}: the mask has transparency" in one_error_line(capsys)


@pytest.mark.parametrize("file_name, edit, expected", [
    ("model_index.json", lambda config: [], "model_index.json: expected a JSON object"),
    ("vae/config.json", lambda config: {**config, "scaling_factor": 0}, "scaling_factor=0 is invalid"),
    ("scheduler/scheduler_config.json", lambda config: {**config, "num_train_timesteps": "1000"},
     "num_train_timesteps='1000' is invalid"),
    ("scheduler/scheduler_config.json", lambda config: {**config, "beta_schedule": "cosine"},
     "beta_schedule='cosine' is not supported"),
])
def test_checkpoint_configs_of_the_wrong_kind_are_one_line(file_name, edit, expected, tmp_path, capsys):
    """Each config a command reads is checked as it is read, and the message names the file."""
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    path = model / file_name
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    assert main(["generate", "a fox", "--model", str(model), "--steps", "2", "--no-progress",
                 "--out", str(tmp_path / "out.png")]) == 2
    err = one_error_line(capsys)
    assert str(path) in err and expected in err, err
    assert not (tmp_path / "out.png").exists()


def test_sizes_beyond_what_memory_can_hold(tmp_path, capsys, monkeypatch):
    """A side over 8192 px is refused before loading; running out of device memory is one line, not XLA's dump."""
    assert generate("--height", 16384, "--out", tmp_path / "a.png") == 2
    assert "--height 16384 is larger than sdflax makes (8192 pixels at most)" in one_error_line(capsys)

    import jax

    import sdflax.cli.run

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0TiB.")

    prepare = sdflax.cli.run.prepare
    monkeypatch.setattr(sdflax.cli.run, "prepare", lambda *a: (prepare(*a)[0], exhausted))
    assert generate("--out", tmp_path / "b.png") == 2
    assert "out of memory making 8 image(s) of 128x128 on 8 CPU devices: use fewer --num-images" in \
        one_error_line(capsys)
    assert not (tmp_path / "b.png").exists()


@pytest.mark.parametrize("file_name", ["vocab.json", "merges.txt", "tokenizer_config.json"])
def test_damaged_tokenizer_files_are_one_line(file_name, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(TINY, model)
    (model / "tokenizer" / file_name).write_bytes(b"\xff\xfe{[")
    assert main(["generate", "a fox", "--model", str(model), "--steps", "2", "--no-progress",
                 "--out", str(tmp_path / "out.png")]) == 2
    assert f"{model / 'tokenizer'}: cannot build a CLIP tokenizer from its files" in one_error_line(capsys)
