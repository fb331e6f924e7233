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

from sdflax.checkpoint_files import CheckpointFileError, read_flax_msgpack, read_safetensors, read_torch_bin
from sdflax.models.clip import CLIPTextConfig
from sdflax.models.config import ConfigError, read_config_file
from sdflax.models.unet import UNetConfig
from sdflax.models.vae import VAEConfig
from sdflax.schedulers.pndm import PNDMConfig
from sdflax.weights import weight_files

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
