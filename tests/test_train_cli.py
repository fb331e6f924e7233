"""`sdflax train` on weights/tiny-sd at 32 px, in this process (one device: --devices 1).

One real run of four updates (`trained`) is the reference: its LoRA equals the library's `Trainer` on the same
rows, loads in `sdflax generate --lora`, and a run killed (SIGKILL, in a subprocess) and stopped (SIGINT), each time
continued by the same command, ends with its file bit for bit. The library's LoRA loading in diffusers'
`load_lora_weights` (the same image at 1e-3) is tests/test_train.py's; the plumbing of the other methods, of the
data and of the cache runs with `Trainer.step` replaced by a recorder (no compile)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdflax.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "weights" / "tiny-sd")
CAPTIONS = ["a red square", "a blue circle", "a green field", "a grey sky"]
SEED = 3
RUN = ["--model", TINY, "--resolution", "32", "--devices", "1", "--no-progress", "--seed", str(SEED),
       "--max-train-steps", "4", "--train-batch-size", "2", "--checkpointing-steps", "2", "--learning-rate", "1e-3",
       "--validation-prompt", "a red fox", "--validation-steps", "2", "--validation-inference-steps", "2"]


def picture(i, size=(32, 32)):
    """A smooth picture (gradients in three colours), different for each i."""
    width, height = size
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    rgb = np.stack([np.sin(3 * x + i), np.cos(2 * y - i), np.sin(x * y * 4 + i / 2)], -1)
    return Image.fromarray(np.uint8((rgb + 1) * 127.5))


def make_data(folder, sizes=((32, 32),) * 4):
    folder.mkdir(parents=True)
    for i, size in enumerate(sizes):
        picture(i, size).save(folder / f"p{i}.png")
        (folder / f"p{i}.txt").write_text(CAPTIONS[i % len(CAPTIONS)] + "\n")
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("train-cli") / "data")


@pytest.fixture(scope="module")
def trained(data):
    out = data.parent / "run"
    assert main(["train", "lora", "--data", str(data), "--out", str(out), *RUN]) == 0
    return out


def relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def test_the_lora_is_the_library_trainers_on_the_same_rows_and_loads_in_generate(trained, data, tmp_path, capsys):
    from sdflax import StableDiffusion
    from sdflax.loading.files import read_safetensors
    from sdflax.train import TrainConfig, Trainer
    from sdflax.train.data import batch_at

    pipe, params = StableDiffusion.from_pretrained(TINY)
    trainer = Trainer(pipe, params, TrainConfig(method="lora", learning_rate=1e-3, max_train_steps=4), seed=SEED)
    pixels = np.stack([np.asarray(Image.open(data / f"p{i}.png"), np.float32).transpose(2, 0, 1) / 127.5 - 1
                       for i in range(4)])
    for step in range(4):
        rows = batch_at(step, [(32, 32)] * 4, [1] * 4, 2, SEED)  # the order sdflax train reads them in
        trainer.step({"pixel_values": pixels[rows], "input_ids": pipe.prepare_inputs([CAPTIONS[i] for i in rows])})
    trainer.save_lora(tmp_path / "library.safetensors")
    ours, library = (read_safetensors(path) for path in (trained / "pytorch_lora_weights.safetensors",
                                                         tmp_path / "library.safetensors"))
    assert sorted(ours) == sorted(library) and len(ours) == 4 * 2 * 14  # q, k, v, out of 14 attention layers
    assert max(relative(ours[name], library[name]) for name in ours) < 1e-6
    assert max(np.abs(ours[n]).max() for n in ours if "lora_B" in n) > 0  # B moved from zero

    png = tmp_path / "fox.png"  # as the last validation image: its prompt and seed, the file's LoRA
    assert main(["generate", "a red fox", "--model", TINY, "--lora", str(trained / "pytorch_lora_weights.safetensors"),
                 "--steps", "2", "--height", "32", "--width", "32", "--seed", str(SEED), "--num-images", "1",
                 "--no-progress", "--out", str(png)]) == 0
    validation = np.asarray(Image.open(trained / "samples" / "step-000004.png").convert("RGB"), np.float32)
    assert np.abs(np.asarray(Image.open(png), np.float32) - validation).max() <= 1
    capsys.readouterr()


def test_a_run_leaves_its_settings_log_samples_and_pictures_of_how_it_went(trained):
    from sdflax.cli.train_options import read_config
    from sdflax.train.plots import LABEL_WIDTH, SMOOTH

    settings = read_config(trained / "settings.toml")
    assert settings["method"] == "lora" and settings["seed"] == SEED and settings["learning_rate"] == 1e-3
    assert settings["validation_prompt"] == ["a red fox"] and settings["max_grad_norm"] == 1.0
    assert settings["snr_gamma"] is None and settings["lora_targets"] == ["to_q", "to_k", "to_v", "to_out.0"]
    records = [json.loads(line) for line in (trained / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) and r["learning_rate"] == pytest.approx(1e-3) for r in records)
    assert records[0]["smoothed"] == records[0]["loss"]
    assert sorted(os.listdir(trained / "checkpoints")) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(os.listdir(trained / "samples")) == ["step-000000.png", "step-000002.png", "step-000004.png"]

    loss = np.asarray(Image.open(trained / "loss.png").convert("RGB"))
    curve = np.all(loss == SMOOTH, axis=-1)
    assert curve.any(0).sum() > loss.shape[1] // 2  # the smoothed curve runs across the plot
    assert len(set(np.nonzero(curve)[0])) > 3  # and is not flat: the loss moved

    progress = np.asarray(Image.open(trained / "progress.png").convert("RGB"))
    assert progress.shape == (3 * 32, LABEL_WIDTH + 32, 3)  # a row per validation: before, at 2 and at 4
    rows = [np.asarray(Image.open(trained / "samples" / f"step-00000{s}.png").convert("RGB")) for s in (0, 2, 4)]
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(progress[32 * i:32 * (i + 1), LABEL_WIDTH:], row)
    assert (progress[:, :LABEL_WIDTH] < 128).any()  # the steps written beside the rows
    assert not np.array_equal(rows[0], rows[2])  # the LoRA changes the image


def test_killed_and_interrupted_runs_continue_to_the_same_lora_bit_for_bit(trained, data, tmp_path, monkeypatch,
                                                                         capsys):
    """kill -9 as update 3 begins (checkpoint-2 saved): the same command continues from update 2; SIGINT during
    update 3 of that run saves checkpoint-3 and exits 0; the same command again finishes. The LoRA is the
    uninterrupted run's, bit for bit, and log.jsonl lists each update once."""
    out = tmp_path / "run"
    command = ["train", "lora", "--data", str(data), "--out", str(out), *RUN]
    killed = subprocess.run([sys.executable, str(ROOT / "tests" / "train_cli_kill_worker.py"), "3", *command],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
                                "PYTHONPATH", "")])})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(os.listdir(out / "checkpoints")) == ["checkpoint-2"]
    assert not (out / "pytorch_lora_weights.safetensors").exists()

    from sdflax.train import Trainer

    step = Trainer.step

    def interrupted(self, batch, *args, **kwargs):
        if int(self.state.step) + 1 == 3:
            signal.raise_signal(signal.SIGINT)  # the handler notes it; the update goes on
        return step(self, batch, *args, **kwargs)

    monkeypatch.setattr(Trainer, "step", interrupted)
    assert main(command) == 0
    assert "stopped after update 3 of 4; checkpoints/checkpoint-3 saved" in capsys.readouterr().err
    assert sorted(os.listdir(out / "checkpoints")) == ["checkpoint-2", "checkpoint-3"]
    monkeypatch.setattr(Trainer, "step", step)
    assert main(command) == 0
    assert (out / "pytorch_lora_weights.safetensors").read_bytes() == \
        (trained / "pytorch_lora_weights.safetensors").read_bytes()
    assert [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert main(command) == 0  # finished: said so, nothing done
    assert "holds a finished run" in capsys.readouterr().err


def one_error_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flags, message", [
    (["--rank", "8"], "holds a run with rank 4, not 8: give the same settings"),
    (["--validation-prompt", "a cat"], "validation-prompt a red fox, not a red fox,a cat"),
    (["--seed", "4"], "holds a run with seed 3, not 4"),
])
def test_other_settings_on_a_runs_out_are_refused_naming_the_difference(trained, data, capsys, flags, message):
    before = {p: p.stat().st_mtime_ns for p in trained.rglob("*")}
    assert main(["train", "lora", "--data", str(data), "--out", str(trained), *RUN, *flags]) == 2
    assert message in one_error_line(capsys)
    assert {p: p.stat().st_mtime_ns for p in trained.rglob("*")} == before


def test_its_settings_file_repeats_the_run(trained, capsys):
    assert main(["train", "lora", "--config", str(trained / "settings.toml")]) == 0
    assert "holds a finished run" in capsys.readouterr().err


def png_header(width, height) -> bytes:
    """A PNG whose header claims width x height (its pixels are not there)."""
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def spoil(folder, how):
    if how == "empty":
        for path in folder.iterdir():
            path.unlink()
    elif how == "corrupt":
        (folder / "p1.png").write_bytes((folder / "p1.png").read_bytes()[:60])
    elif how == "binary caption":
        (folder / "p2.txt").write_bytes(bytes(range(256)))
    elif how == "huge header":
        (folder / "p3.png").write_bytes(png_header(30000, 30000))
    elif how == "link loop":
        os.symlink(folder, folder / "again")
    elif how == "file link loop":
        os.symlink("p9.png", folder / "p9.png")
    elif how == "10 MB caption":
        (folder / "p0.txt").write_bytes(b"a " * 5 * 2**20)
    elif how == "no caption":
        (folder / "p0.txt").unlink()
    elif how == "bad metadata":
        (folder / "metadata.jsonl").write_text('{"file_name": "p0.png", "text": "a fox"}\n{"file_name": "p1.png"}\n')


@pytest.mark.parametrize("how, message", [
    ("empty", "holds no picture"), ("corrupt", "p1.png: cannot read the picture"),
    ("binary caption", "p2.txt is not a caption"), ("huge header", "p3.png is more than 89478485 pixels, larger than sdflax reads"),
    ("link loop", "is a symbolic link to a folder it is in"), ("file link loop", "p9.png: cannot read it (Too many levels of symbolic links)"),
    ("10 MB caption", "p0.txt is 10485760 bytes"), ("no caption", "p0.png has no caption"),
    ("bad metadata", "metadata.jsonl line 2: no 'text' caption"),
])
def test_bad_data_is_one_line_before_anything_is_written(tmp_path, capsys, how, message):
    folder = make_data(tmp_path / "data")
    spoil(folder, how)
    out = tmp_path / "out"
    assert main(["train", "lora", "--data", str(folder), "--out", str(out), *RUN]) == 2
    assert message in one_error_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize("flags, message", [
    (["--rank", "0"], "argument --rank: must be at least 1, got 0"),
    (["--placeholder-token", "<t>"], "--placeholder-token and --initializer-token are for textual-inversion,"),
    (["--resolution", "36"], "--resolution 36 is not a multiple of 16"),
    (["--train-batch-size", "3", "--devices", "2"], "--train-batch-size 3 (3 rows a micro-batch) does not"),
])
def test_bad_flags_are_one_line(data, tmp_path, capsys, flags, message):
    args = ["train", "lora", "--data", str(data), "--out", str(tmp_path / "out"), *RUN, *flags]
    assert main(args) == 2
    assert message in one_error_line(capsys)


@pytest.fixture
def recorded(monkeypatch):
    """Trainer.step replaced by a recorder of the batches it is given (and the trainer's mesh): no compile."""
    from sdflax.train import Trainer

    batches = []

    def step(self, batch, *args, **kwargs):
        batches.append({"mesh": self.mesh, **{name: np.array(value) for name, value in batch.items()}})
        return {"loss": 1.0 / len(batches), "learning_rate": 1e-4}

    monkeypatch.setattr(Trainer, "step", step)
    return batches


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    from builders import torch_xl_pipeline

    folder = tmp_path_factory.mktemp("sdxl") / "model"
    torch_xl_pipeline().save_pretrained(folder)
    return str(folder)


def diffusers_size_ids(path, target):
    """train_text_to_image_sdxl.py's size conditioning of a row (--center_crop), its target (height, width) a
    bucket's: original (h, w), resized by torchvision's rules until it covers the target, the centre crop's corner."""
    with Image.open(path) as image:
        width, height = image.size
    th, tw = target
    if tw * height >= th * width:
        resized = (max(th, int(tw * height / width)), tw)
    else:
        resized = (th, max(tw, int(th * width / height)))
    corner = (max(0, int(round((resized[0] - th) / 2.0))), max(0, int(round((resized[1] - tw) / 2.0))))
    return (height, width), corner, target


def test_buckets_one_size_an_update_sdxl_size_ids_per_row_and_the_latent_cache(sdxl, tmp_path, recorded, capsys,
                                                                               monkeypatch):
    """4:3, 3:4 and 1:1 pictures on the SDXL stand-in with --buckets and --cache-latents: each update's rows are of
    one bucket, each row's size ids are the script's, its latents a sample of the cached posterior; a second run
    sharing the cache encodes nothing (no VAE call), a changed picture is encoded again."""
    from sdflax.cli.train_run import Run
    from sdflax.loading.files import read_safetensors
    from sdflax.train.data import bucket_sizes, nearest_bucket

    folder = make_data(tmp_path / "data", [(80, 60), (60, 80), (64, 64), (80, 60), (60, 80), (64, 64)])
    encoded = []
    encode = Run.encode
    monkeypatch.setattr(Run, "encode", lambda self, pixels: encoded.append(pixels.shape) or encode(self, pixels))
    args = ["train", "lora", "--model", sdxl, "--data", str(folder), "--resolution", "64", "--buckets",
            "--center-crop", "--cache-latents", "--latent-cache", str(tmp_path / "cache"), "--devices", "1",
            "--max-train-steps", "6", "--train-batch-size", "2", "--seed", "5"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert len(encoded) == 6 and "6 encoded, 0 read" in capsys.readouterr().err
    buckets = bucket_sizes(64, 4)  # the stand-in's VAE halves, its UNet halves once
    entries = {path.name: read_safetensors(path) for path in (tmp_path / "cache").iterdir()}
    assert len(entries) == 6 and len(recorded) == 6
    seen = set()
    for step, batch in enumerate(recorded):
        assert "pixel_values" not in batch and batch["input_ids"].shape[0] == 2
        (h, w), = {tuple(size) for size in batch["target_size"].astype(int)}  # one bucket an update
        assert batch["latents"].shape == (2, 4, h // 2, w // 2)
        noise = np.random.default_rng([5, step, 4]).standard_normal((2, 4, h // 2, w // 2), np.float32)
        for row in range(2):
            name = next(f"p{i}.png" for i in range(6) if Image.open(folder / f"p{i}.png").size[::-1] ==
                        tuple(batch["original_size"][row].astype(int)))
            original, corner, target = diffusers_size_ids(folder / name, (h, w))
            assert nearest_bucket(original[1], original[0], buckets)[::-1] == target
            np.testing.assert_array_equal(batch["crops_coords_top_left"][row], corner)
            seen.add(target)
            assert any(np.array_equal(batch["latents"][row], e["mean"] + e["std"] * noise[row])
                       for e in entries.values() if e["mean"].shape == noise[row].shape)  # a cached posterior's draw
    assert seen == {(56, 72), (72, 56), (64, 64)}  # 4:3 -> 72x56, 3:4 -> 56x72, 1:1 -> 64x64 (w x h)

    encoded.clear()
    assert main([*args, "--out", str(tmp_path / "b")]) == 0  # another run, the same cache: no VAE call
    assert encoded == [] and "0 encoded, 6 read" in capsys.readouterr().err
    for name in ("a", "b"):
        assert json.loads((tmp_path / name / "log.jsonl").read_text().splitlines()[-1])["step"] == 6
    picture(9, (80, 60)).save(folder / "p3.png")  # a changed picture: encoded again, the others read
    assert main([*args, "--out", str(tmp_path / "c")]) == 0
    assert len(encoded) == 1 and "1 encoded, 5 read" in capsys.readouterr().err


FAKE = ["--model", TINY, "--resolution", "32", "--devices", "1", "--no-progress", "--seed", "1", "--max-train-steps",
        "2", "--train-batch-size", "2"]


def test_textual_inversion_full_and_kohya_results_load(data, tmp_path, recorded, capsys):
    """Each method's result where it belongs, in the format asked for, loaded by the library (the updates are the
    core's, tests/test_train.py's; here they are recorded, not made)."""
    from sdflax import StableDiffusion
    from sdflax.loading.files import read_safetensors

    pipe, params = StableDiffusion.from_pretrained(TINY)
    tokens = tmp_path / "tokens"
    make_data(tokens)
    for i in range(4):
        (tokens / f"p{i}.txt").write_text(f"a photo of <fox> {CAPTIONS[i]}")
    for format, name in (("diffusers", "learned_embeds.safetensors"), ("kohya", "fox-token.safetensors")):
        out = tmp_path / format / "fox-token"
        assert main(["train", "textual-inversion", "--data", str(tokens), "--out", str(out), "--placeholder-token",
                     "<fox>", "--initializer-token", "fox", "--output-format", format, *FAKE]) == 0
        assert sorted(read_safetensors(out / name)) == (["<fox>"] if format == "diffusers" else ["emb_params"])
        with_token, _ = pipe.load_textual_inversion(params, out / name, token="<fox>")
        new = with_token.tokenizer.convert_tokens_to_ids("<fox>")
        assert all(new in ids for ids in recorded[-1]["input_ids"])  # every caption holds the new token
    assert main(["train", "full", "--data", str(data), "--out", str(tmp_path / "full"), *FAKE]) == 0
    _, tuned = StableDiffusion.from_pretrained(tmp_path / "full" / "model")
    assert relative(tuned["unet"]["conv_in"]["kernel"], params["unet"]["conv_in"]["kernel"]) == 0  # not trained
    kohya = tmp_path / "kohya" / "my-subject"
    assert main(["train", "lora", "--data", str(data), "--out", str(kohya), "--output-format", "kohya", *FAKE]) == 0
    tensors = read_safetensors(kohya / "my-subject.safetensors")
    assert len(tensors) == 3 * 4 * 14 and all(name.startswith("lora_unet_") for name in tensors)
    pipe.load_lora(params, kohya / "my-subject.safetensors")  # sdflax's kohya reader takes every name

    from diffusers import StableDiffusionPipeline

    theirs = StableDiffusionPipeline.from_pretrained(TINY, safety_checker=None)
    theirs.load_lora_weights(str(kohya), weight_name="my-subject.safetensors")  # and diffusers'
    capsys.readouterr()


def test_dreambooth_draws_its_class_pictures_and_pairs_them_in_every_micro_batch(data, tmp_path, recorded):
    classes = tmp_path / "classes"
    args = ["train", "dreambooth", "--data", str(data), "--out", str(tmp_path / "out"), "--instance-prompt",
            "a photo of sks pattern", "--class-prompt", "a photo of a pattern", "--class-data-dir", str(classes),
            "--num-class-images", "3", "--validation-inference-steps", "2", "--gradient-accumulation-steps", "2",
            *FAKE]
    args[args.index("--train-batch-size") + 1] = "1"
    assert main(args) == 0
    assert sorted(os.listdir(classes)) == ["class-00000.png", "class-00001.png", "class-00002.png"]
    from sdflax import StableDiffusion

    pipe, _ = StableDiffusion.from_pretrained(TINY)
    class_ids = np.asarray(pipe.prepare_inputs(["a photo of a pattern"]))[0]
    for batch in recorded:  # two micro-batches of [instance row; class row]
        assert batch["pixel_values"].shape == (4, 3, 32, 32)
        assert [np.array_equal(ids, class_ids) for ids in batch["input_ids"]] == [False, True, False, True]


def test_the_rows_are_split_over_the_devices_asked_for(data, tmp_path, recorded):
    for flags, axis in ((["--devices", "2"], "data"), (["--devices", "2", "--fsdp"], "fsdp")):
        out = tmp_path / axis
        assert main(["train", "lora", "--data", str(data), "--out", str(out), *FAKE, *flags]) == 0
        assert recorded[-1]["mesh"].shape == {axis: 2}


def test_a_full_disk_while_saving_keeps_the_last_checkpoint(data, tmp_path, recorded, monkeypatch, capsys):
    import errno

    import sdflax.train.trainer

    write = sdflax.train.trainer.write_safetensors

    def fills_the_disk(path, tensors, *args, **kwargs):
        if "checkpoint-2" in str(path):
            with open(str(path) + ".part", "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(path, tensors, *args, **kwargs)

    monkeypatch.setattr(sdflax.train.trainer, "write_safetensors", fills_the_disk)
    out = tmp_path / "out"
    args = ["train", "lora", "--data", str(data), "--out", str(out), *FAKE, "--checkpointing-steps", "1"]
    assert main(args) == 2
    err = one_error_line(capsys)
    assert f"cannot save {out / 'checkpoints' / 'checkpoint-2'} (No space left on device); " \
        f"{out / 'checkpoints' / 'checkpoint-1'} is kept: make room" in err
    assert sorted(os.listdir(out / "checkpoints")) == ["checkpoint-1"]
    monkeypatch.setattr(sdflax.train.trainer, "write_safetensors", write)
    assert main(args) == 0 and len(recorded) == 2 + 1  # the rerun made update 2 only


def test_the_options_are_the_cores_arguments_and_help_starts_without_jax(tmp_path):
    """Every TrainConfig argument is a flag with its default (written out, so that --help starts without JAX)."""
    import dataclasses

    from sdflax.cli import train_options
    from sdflax.train import TrainConfig, config

    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    derived = {"method", "max_train_steps", "with_prior_preservation"}  # the command, --max-train-steps, DreamBooth
    assert set(train_options.CORE) == set(fields) - derived
    for name, (_, default, *_) in train_options.CORE.items():
        assert (tuple(default) if isinstance(default, list) else default) == fields[name], name
    assert train_options.LR_SCHEDULERS == config.LR_SCHEDULERS and train_options.LORA_INITS == config.LORA_INITS
    assert train_options.MIXED_PRECISIONS == config.MIXED_PRECISIONS
    assert (None, *train_options.PREDICTION_TYPES) == config.PREDICTION_TYPES
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text('raise ImportError("jax is not to be imported here")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    for args, code, expected in ((["train", "--help"], 0, "--snr-gamma GAMMA"),
                                 (["train", "lora", "--rank", "x"], 2, "--rank: expected a whole number")):
        result = subprocess.run([sys.executable, "-m", "sdflax", *args], capture_output=True, text=True, env=env)
        assert result.returncode == code and expected in result.stdout + result.stderr, result.stderr
