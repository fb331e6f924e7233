"""`sdflax train`'s text-encoder cache (--cache-text-encoder-outputs), its TensorBoard events (--report-to
tensorboard) and DreamBooth's prior preservation with --buckets, on weights/tiny-sd.

The reference is a run that encodes every caption in its update (`uncached`); a cached run trains to its LoRA, and
the same cache serves another run without a text-encoder call."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
from PIL import Image
from test_train_cli import TINY, make_data, picture, relative

from sdflax.__main__ import main

SEED = 9
FLAGS = ["--model", TINY, "--resolution", "32", "--devices", "1", "--no-progress", "--seed", str(SEED),
         "--max-train-steps", "2", "--train-batch-size", "2", "--checkpointing-steps", "2", "--learning-rate", "1e-3",
         "--caption-dropout", "0.5", "--adam-epsilon", "1e-4"]
# A text state encoded in a batch of one differs in its last bits from the same state in the update's batch of two.
# Adam's epsilon above the smallest gradients: at 1e-8 an update of a weight whose gradient is near zero is +-lr on
# that rounding, and a few of the 21504 LoRA weights differ by 1e-5 (1.8e-6 over all); at 1e-4, 4e-8 over all
# (the cross-attention's B, fed by the states, 6e-6 a tensor)


@pytest.fixture(scope="module")
def uncached(tmp_path_factory):
    """Two updates encoding every caption in the step, with TensorBoard events and a validation image at 0 and 2."""
    folder = tmp_path_factory.mktemp("train-caches")
    data = make_data(folder / "data")
    out = folder / "uncached"
    assert main(["train", "lora", "--data", str(data), "--out", str(out), *FLAGS, "--report-to", "tensorboard",
                 "--validation-prompt", "a red fox", "--validation-steps", "2", "--validation-inference-steps",
                 "2"]) == 0
    return out, data


def events(folder):
    """The records of TensorBoard event files (TFRecord: length, its CRC, the Event proto, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    found = []
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        while data:
            length, = struct.unpack("<Q", data[:8])
            found.append(Event.FromString(data[12:12 + length]))
            data = data[12 + length + 4:]
    return found


def test_tensorboard_holds_the_logs_scalars_and_the_validation_images(uncached):
    out, _ = uncached
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    scalars, images = {}, {}
    for event in events(out / "logs"):
        for value in event.summary.value:
            if value.HasField("image"):
                images[event.step] = np.asarray(Image.open(io.BytesIO(value.image.encoded_image_string)))
            else:
                scalars[value.tag, event.step] = value.simple_value
    assert len(scalars) == 3 * 2
    for record in records:
        for name in ("loss", "smoothed", "learning_rate"):
            assert scalars["train/" + name, record["step"]] == np.float32(record[name])  # float32 in the events
    assert sorted(images) == [0, 2]
    for step, image in images.items():
        np.testing.assert_array_equal(image, np.asarray(Image.open(out / "samples" / f"step-{step:06d}.png")
                                                        .convert("RGB")))


def test_cached_text_states_train_to_the_same_lora_and_serve_the_next_run_without_an_encoder(uncached, tmp_path,
                                                                                              monkeypatch, capsys):
    """The captions' states (and the empty caption's: rows of both updates drop theirs) encoded once into the
    cache: the LoRA is the uncached run's; a second run on the same cache calls no text encoder; a changed caption
    is the only one encoded again."""
    from sdflax.cli.train_run import Run
    from sdflax.loading.files import read_safetensors
    from sdflax.pipeline.text import SDText
    from sdflax.train.data import row_draws

    assert all(row_draws(SEED, step, 2, 0.5)[0].any() for step in (0, 1))  # the empty caption in each update
    reference, data = uncached
    encode, trace = Run.encode_text, SDText.encode_prompt
    calls, traces = [], []  # the cache's text-encoder runs; the programs traced with a text encoder in them
    monkeypatch.setattr(Run, "encode_text", lambda self, ids: calls.append(1) or encode(self, ids))
    monkeypatch.setattr(SDText, "encode_prompt", lambda self, *args: traces.append(1) or trace(self, *args))
    cached = [*FLAGS, "--cache-text-encoder-outputs", "--latent-cache", str(tmp_path / "cache"), "--progress"]
    assert main(["train", "lora", "--data", str(data), "--out", str(tmp_path / "a"), *cached]) == 0
    assert "5 encoded, 0 read" in capsys.readouterr().err and len(calls) == 5  # 4 captions and the empty one
    ours, theirs = (read_safetensors(out / "pytorch_lora_weights.safetensors") for out in (tmp_path / "a", reference))
    assert sorted(ours) == sorted(theirs)
    assert relative(*(np.concatenate([np.ravel(lora[name]) for name in sorted(ours)]) for lora in (ours, theirs))) \
        < 1e-6
    assert max(relative(ours[name], theirs[name]) for name in ours) < 1e-4

    calls.clear()
    traces.clear()  # the cache's encoder, traced once
    assert main(["train", "lora", "--data", str(data), "--out", str(tmp_path / "b"), *cached]) == 0
    assert "0 encoded, 5 read" in capsys.readouterr().err and calls == traces == []
    assert (tmp_path / "b" / "pytorch_lora_weights.safetensors").read_bytes() == \
        (tmp_path / "a" / "pytorch_lora_weights.safetensors").read_bytes()
    (data / "p1.txt").write_text("a yellow triangle")
    assert main(["train", "lora", "--data", str(data), "--out", str(tmp_path / "c"), *cached]) == 0
    assert "1 encoded, 4 read" in capsys.readouterr().err and len(calls) == 1
    (data / "p1.txt").write_text("a blue circle")


@pytest.mark.parametrize("flags, message", [
    (["--train-text-encoder"], "--cache-text-encoder-outputs is for frozen text encoders: drop it, or "
                               "--train-text-encoder"),
])
def test_a_text_cache_of_trained_encoders_is_refused(tmp_path, capsys, flags, message):
    data = make_data(tmp_path / "data")
    assert main(["train", "lora", "--data", str(data), "--out", str(tmp_path / "o"), *FLAGS,
                 "--cache-text-encoder-outputs", *flags]) == 2
    assert message in capsys.readouterr().err


def test_dreambooth_with_buckets_pairs_each_update_in_one_bucket(tmp_path, monkeypatch):
    """4:3 and 1:1 pictures with square class pictures, --buckets: each update's instance and class rows are of the
    instance rows' bucket, both buckets are trained, and the trainer's prior-preservation loss on an update's rows
    is the instance row's loss plus prior_loss_weight times the class row's."""
    from sdflax import StableDiffusion
    from sdflax.train import TrainConfig, Trainer

    batches = []
    monkeypatch.setattr(Trainer, "step", lambda self, batch: batches.append(batch) or {"loss": 1.0,
                                                                                       "learning_rate": 1e-4})
    data = make_data(tmp_path / "data", [(80, 60), (64, 64), (80, 60), (64, 64)])
    classes = tmp_path / "classes"
    classes.mkdir()
    for i in range(2):
        picture(10 + i, (64, 64)).save(classes / f"c{i}.png")
    assert main(["train", "dreambooth", "--data", str(data), "--out", str(tmp_path / "out"), "--model", TINY,
                 "--resolution", "64", "--buckets", "--instance-prompt", "a photo of sks pattern", "--class-prompt",
                 "a photo of a pattern", "--class-data-dir", str(classes), "--num-class-images", "2", "--devices", "1",
                 "--no-progress", "--seed", "3", "--max-train-steps", "4", "--train-batch-size", "1"]) == 0
    pipe, params = StableDiffusion.from_pretrained(TINY)
    class_ids = np.asarray(pipe.prepare_inputs(["a photo of a pattern"]))[0]
    assert {batch["pixel_values"].shape for batch in batches} == {(2, 3, 48, 80), (2, 3, 64, 64)}
    for batch in batches:
        assert [np.array_equal(ids, class_ids) for ids in batch["input_ids"]] == [False, True]
    wide = next(batch for batch in batches if batch["pixel_values"].shape[-1] == 80)
    g, shape = np.random.default_rng(0), (2, 4, 48 // pipe.vae_scale_factor, 80 // pipe.vae_scale_factor)
    draws = {"noise": g.standard_normal(shape, np.float32), "timesteps": np.array([100, 700]),
             "latent_noise": g.standard_normal(shape, np.float32)}
    prior = Trainer(pipe, params, TrainConfig(with_prior_preservation=True, prior_loss_weight=0.5))
    plain = Trainer(pipe, params, TrainConfig())
    rows = [plain.loss({name: value[i:i + 1] for name, value in wide.items()},
                       **{name: value[i:i + 1] for name, value in draws.items()}) for i in range(2)]
    assert float(prior.loss(wide, **draws)) == pytest.approx(float(rows[0]) + 0.5 * float(rows[1]), rel=1e-5)
    assert 0.5 * float(rows[1]) > 1e-2 * float(rows[0])  # the class row's share moves the loss
