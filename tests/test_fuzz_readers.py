"""Property-based fuzzing of the checkpoint and config readers (hypothesis): small real files, mutated byte by byte
or in their JSON structure, are either read (to arrays no bigger than the file allows) or refused with one of
sdflax's error types in one line, within a memory bound. Never another exception, never a pickle run.

CI runs a fixed number of examples from a fixed seed (derandomized); `SDFLAX_FUZZ_EXAMPLES=20000 pytest
tests/test_fuzz_readers.py` runs longer."""

import io
import json
import os
import struct
import tracemalloc
import zipfile

import numpy as np
import pytest
import torch
from flax.serialization import msgpack_serialize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from sdflax.loading.files import CheckpointFileError, read_flax_msgpack, read_safetensors, read_torch_bin
from sdflax.models.clip import CLIPTextConfig
from sdflax.models.config import ConfigError, read_config_file
from sdflax.models.unet import UNetConfig
from sdflax.models.vae import VAEConfig
from sdflax.schedulers.pndm import PNDMConfig
from sdflax.loading.weights import weight_files

EXAMPLES = int(os.environ.get("SDFLAX_FUZZ_EXAMPLES", 150))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
MEMORY_BOUND = 64 << 20  # bytes a reader may allocate for one of these (kilobyte-sized) files
TENSORS = {"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4), "b.bias": np.ones(5, np.float16),
           "c.emb": np.arange(6, dtype=np.int64).reshape(2, 3)}


def files(tmp):
    """A small real file of every format the readers take."""
    out = {}
    save_file(TENSORS, tmp / "model.safetensors", metadata={"format": "pt"})
    torch.save({k: torch.from_numpy(v.copy()) for k, v in TENSORS.items()}, tmp / "model.bin")
    (tmp / "model.msgpack").write_bytes(msgpack_serialize({"a": {"weight": TENSORS["a.weight"]},
                                                           "b": {"bias": TENSORS["b.bias"]}}))
    for name in ("model.safetensors", "model.bin", "model.msgpack"):
        out[name] = (tmp / name).read_bytes()
    return out


class Originals(dict):
    def __repr__(self):  # hypothesis prints the arguments of a failing example: the names suffice
        return f"Originals({sorted(self)})"


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    return Originals(files(tmp_path_factory.mktemp("fuzz")))


def mutate(data: bytes, draw) -> bytes:
    """Byte flips, a truncation or an insertion, as a damaged download or a hostile edit would do."""
    data = bytearray(data)
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "flip"]))
    if kind == "flip":
        for position, value in draw(st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)),
                                             min_size=1, max_size=8)):
            data[position] = value
    elif kind == "truncate":
        del data[draw(st.integers(0, len(data) - 1)):]
    else:
        position = draw(st.integers(0, len(data)))
        data[position:position] = draw(st.binary(min_size=1, max_size=64))
    return bytes(data)


def bounded(read, path, errors=(CheckpointFileError,)):
    """`read(path)`: arrays, or one of `errors` with a one-line message; at most MEMORY_BOUND bytes allocated."""
    tracemalloc.start()
    try:
        result = read(path)
    except errors as e:
        assert "\n" not in str(e), str(e)
        result = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, peak
    if result is not None:
        assert all(isinstance(v, np.ndarray) for v in result.values())
        assert sum(v.nbytes for v in result.values()) <= max(os.path.getsize(path), 1) * 64
    return result


def test_unmutated_files_read_back_exactly(originals, tmp_path):
    for name, reader in (("model.safetensors", read_safetensors), ("model.bin", read_torch_bin)):
        (tmp_path / name).write_bytes(originals[name])
        got = reader(tmp_path / name)
        assert sorted(got) == sorted(TENSORS)
        for key, value in TENSORS.items():
            np.testing.assert_array_equal(got[key], value)
    (tmp_path / "model.msgpack").write_bytes(originals["model.msgpack"])
    got = read_flax_msgpack(tmp_path / "model.msgpack")
    np.testing.assert_array_equal(got["a.weight"], TENSORS["a.weight"])


@pytest.mark.parametrize("name, reader", [("model.safetensors", read_safetensors), ("model.bin", read_torch_bin),
                                          ("model.msgpack", read_flax_msgpack)])
@FUZZ
@given(data=st.data())
def test_mutated_checkpoint_files(originals, tmp_path, name, reader, data):
    path = tmp_path / name
    path.write_bytes(mutate(originals[name], data.draw))
    bounded(reader, path)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=4), max_leaves=12)


@FUZZ
@given(data=st.data())
def test_safetensors_headers_with_any_json(originals, tmp_path, data):
    """The header's entries replaced by arbitrary JSON: dtype, shape and offsets of any type and size."""
    header_size = struct.unpack("<Q", originals["model.safetensors"][:8])[0]
    header = json.loads(originals["model.safetensors"][8:8 + header_size])
    key = data.draw(st.sampled_from(sorted(header)))
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
    if field is None:
        header[key] = data.draw(JSON)
    elif isinstance(header[key], dict):
        header[key][field] = data.draw(JSON | st.lists(st.integers(-2**66, 2**66), max_size=5))
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + originals["model.safetensors"][8 + header_size:])
    bounded(read_safetensors, path)


CONFIGS = [(UNetConfig, {"block_out_channels": [32, 64], "layers_per_block": 1, "cross_attention_dim": 32,
                         "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
                         "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "norm_num_groups": 8}),
           (VAEConfig, {"block_out_channels": [16, 32], "latent_channels": 4, "scaling_factor": 0.18215}),
           (CLIPTextConfig, {"hidden_size": 32, "num_hidden_layers": 2, "hidden_act": "gelu"}),
           (PNDMConfig, {"num_train_timesteps": 1000, "beta_schedule": "scaled_linear", "skip_prk_steps": True,
                         "steps_offset": 1, "trained_betas": None})]


@pytest.mark.parametrize("cls, config", CONFIGS, ids=[c.__name__ for c, _ in CONFIGS])
@FUZZ
@given(data=st.data())
def test_configs_with_any_json(tmp_path, cls, config, data):
    """A config's values replaced by arbitrary JSON (or the file's bytes damaged): a config, or a ConfigError."""
    config = dict(config)
    for key in data.draw(st.lists(st.sampled_from(sorted(config)), min_size=1, max_size=3)):
        config[key] = data.draw(JSON)
    raw = json.dumps(config).encode()
    if data.draw(st.booleans()):
        raw = mutate(raw, data.draw)
    path = tmp_path / "config.json"
    path.write_bytes(raw)
    try:
        cls.from_dict(read_config_file(str(path)))
    except ConfigError as e:
        assert "\n" not in str(e) and str(path) in str(e), str(e)


@FUZZ
@given(index=JSON)
def test_shard_indexes_with_any_json(tmp_path, index):
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    try:
        weight_files(str(tmp_path))
    except CheckpointFileError as e:
        assert "\n" not in str(e)


def test_a_pickle_that_would_run_code_is_refused_in_any_mutation(tmp_path):
    """The restricted unpickler never imports what it does not know, damaged file or not."""
    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    buffer = io.BytesIO()
    torch.save({"a": torch.ones(2), "boom": Boom()}, buffer)
    (tmp_path / "evil.bin").write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointFileError):
        read_torch_bin(tmp_path / "evil.bin")
    assert not (tmp_path / "pwned").exists()
    assert zipfile.is_zipfile(tmp_path / "evil.bin")


# ---- embeddings, pickled views, LoRA metadata, prompt files, manifests ------------------------------------------

@pytest.fixture(scope="module")
def embedding(tmp_path_factory):
    """An A1111 textual-inversion .pt: the vectors nested in a dict with strings and numbers."""
    buffer = io.BytesIO()
    torch.save({"string_to_param": {"*": torch.arange(8.0).reshape(2, 4)}, "name": "fox", "step": 3}, buffer)
    return buffer.getvalue()


@FUZZ
@given(data=st.data())
def test_mutated_embedding_files(embedding, tmp_path, data):
    """Zip damage in an embedding .pt was a BadZipFile or RuntimeError traceback."""
    from sdflax.loading.embeddings import read_embedding

    path = tmp_path / "fox.pt"
    path.write_bytes(mutate(embedding, data.draw))
    result = bounded(lambda p: {"vectors": read_embedding(p)[1]}, path, errors=(ValueError,))
    if path.read_bytes() == embedding:  # a flip may write the byte that was there
        np.testing.assert_array_equal(result["vectors"], np.arange(8.0).reshape(2, 4))


@FUZZ
@given(size=st.lists(st.integers(0, 40000), max_size=3), stride=st.lists(st.integers(0, 7), max_size=3),
       offset=st.integers(0, 8), copies=st.integers(1, 300))
def test_pickled_views_of_any_layout(tmp_path, size, stride, offset, copies):
    """Views of one small storage with any size, stride and offset, repeated: read as torch made them, or refused
    (a view that repeats elements, or copies that repeat a storage: 1.7 KB of file claimed 1.6 GB)."""
    stride = (stride + [1] * len(size))[:len(size)]
    storage = torch.arange(64, dtype=torch.float32)
    try:
        view = storage.as_strided(size, stride, offset)
    except RuntimeError:  # torch refuses a view past its storage: nothing to save
        return
    tensors = {f"t{i}": view for i in range(copies)}
    torch.save(tensors, tmp_path / "views.bin")
    result = bounded(read_torch_bin, tmp_path / "views.bin")
    if result is not None:
        for value in result.values():
            np.testing.assert_array_equal(value, view.numpy())


def test_copies_of_one_storage_are_bounded(tmp_path):
    """Forty transposed views of one 1 MB storage: each a copy, 40 MB from a 1 MB file; refused past twice the
    storages (and a slack), before the memory is taken."""
    storage = torch.arange(2**18, dtype=torch.float32).reshape(512, 512)
    torch.save({"a": storage.T, "b": storage.T}, tmp_path / "two.bin")  # twice: a real file may do that
    np.testing.assert_array_equal(read_torch_bin(tmp_path / "two.bin")["b"], storage.T.numpy())
    torch.save({f"t{i}": storage.T for i in range(40)}, tmp_path / "forty.bin")
    assert os.path.getsize(tmp_path / "forty.bin") < 2**21
    tracemalloc.start()
    with pytest.raises(CheckpointFileError, match="non-contiguous tensors copy .* views that repeat a storage"):
        read_torch_bin(tmp_path / "forty.bin")
    assert tracemalloc.get_traced_memory()[1] < 24 << 20
    tracemalloc.stop()


@FUZZ
@given(meta=st.dictionaries(st.sampled_from(["unet.lora_alpha", "unet.alpha_pattern", "unet.use_rslora",
                                             "text_encoder.lora_alpha", "text_encoder.alpha_pattern", "other"]),
                            JSON | st.dictionaries(st.text(max_size=12), JSON, max_size=3), max_size=4)
       | JSON, raw=st.booleans())
def test_lora_metadata_with_any_json(tmp_path, meta, raw):
    """diffusers' lora_adapter_metadata of any JSON (or any text): alphas that are finite numbers, or a
    LoraMismatchError in one line (a pattern "(" was a re.error, a huge int an OverflowError)."""
    from sdflax.loading.lora import LoraMismatchError, peft_alphas

    text = json.dumps(meta) if not raw else json.dumps(meta)[::-1]
    save_file({"x": np.zeros(1, np.float32)}, tmp_path / "lora.safetensors", metadata={"lora_adapter_metadata": text})
    try:
        alphas = peft_alphas(tmp_path / "lora.safetensors")
    except LoraMismatchError as e:
        assert "\n" not in str(e), str(e)
        return
    for alpha, pattern, _ in alphas.values():
        assert np.isfinite([alpha, *pattern.values()]).all()


LINE = st.fixed_dictionaries({}, optional={"prompt": JSON | st.text(max_size=20), "seed": JSON, "guidance": JSON,
                                           "steps": JSON, "width": JSON, "height": JSON, "negative_prompt": JSON,
                                           "other": JSON})


@FUZZ
@given(text=st.text(max_size=200) | st.lists(LINE | JSON, max_size=5).map(lambda lines: "\n".join(
    json.dumps(line) for line in lines)), jsonl=st.booleans())
def test_prompt_files_of_any_text(tmp_path, text, jsonl):
    """A prompt file of any text (form feeds, U+2028, CRLF, NUL) or JSON lines of any values: one Line per line
    that holds a prompt, numbered by "\\n" alone, or a UserError in one line."""
    from types import SimpleNamespace

    from sdflax.cli.batch import read_prompts
    from sdflax.cli.request import UserError

    path = tmp_path / ("prompts.jsonl" if jsonl else "prompts.txt")
    path.write_text(text, encoding="utf-8", newline="")
    defaults = SimpleNamespace(negative_prompt="", guidance=None, steps=2, height=None, width=None)
    try:
        lines = read_prompts(str(path), defaults)
    except UserError as e:
        assert "\n" not in str(e), str(e)
        return
    raw = text.split("\n")
    assert [line.number for line in lines] == [n for n, r in enumerate(raw, 1) if r.removesuffix("\r").strip()]
    for line in lines:
        assert isinstance(line.prompt, str) and line.prompt.strip() and type(line.steps) is int and line.steps > 0
        assert line.seed is None or (type(line.seed) is int and 0 <= line.seed < 2**32)


RECORD = st.fixed_dictionaries({"line": st.integers(-2, 4) | JSON, "file": st.text(max_size=12) | JSON,
                                "seed": st.integers(0, 9) | JSON, "settings": st.dictionaries(
                                    st.sampled_from(["prompt", "seed", "steps", "sampler", "lora"]), JSON) | JSON},
                               optional={"batch_seed": JSON, "process": JSON})


@FUZZ
@given(records=st.lists(RECORD | JSON, max_size=4), tail=st.text(max_size=30))
def test_manifests_of_any_records(tmp_path, records, tail):
    """A manifest of records of any types and any last line: read and checked against the prompts, or refused
    as not sdflax's in one line; never a traceback, never written to."""
    from types import SimpleNamespace

    from sdflax.cli.batch import read_prompts
    from sdflax.cli.manifest import check_records, image_key, read_manifests
    from sdflax.cli.request import UserError

    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (tmp_path / "manifest.jsonl").write_text(text, encoding="utf-8", newline="")
    (tmp_path / "prompts.txt").write_text("a fox\na cat\n")
    lines = read_prompts(str(tmp_path / "prompts.txt"), SimpleNamespace(negative_prompt="", guidance=None, steps=2,
                                                                       height=None, width=None))
    keys = {line.number: image_key({"prompt": line.prompt, "seed": line.number}) for line in lines}
    try:
        check_records(read_manifests(str(tmp_path)), lines, keys, "out", str(tmp_path))
    except UserError as e:
        assert "\n" not in str(e), str(e)
    assert (tmp_path / "manifest.jsonl").read_bytes() == text.encode()
