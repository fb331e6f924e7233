"""Hostile and broken checkpoint files: each is refused with one line naming the file (and tensor), as a ValueError
(so the CLI prints it and exits 2), without tracebacks from deep inside and without allocating what the file claims."""

import collections
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from sdflax.loading.files import CheckpointFileError, read_checkpoint, read_safetensors, read_torch_bin
from sdflax.models.clip import CLIPTextConfig
from sdflax.models.config import ConfigError, read_config_file
from sdflax.models.unet import UNetConfig
from sdflax.models.vae import VAEConfig
from sdflax.schedulers.pndm import PNDMConfig
from sdflax.loading.embeddings import read_embedding
from sdflax.loading.weights import weight_files


def _refused(error_type, call, *needles):
    """Run `call`, expecting `error_type` (a ValueError) with a one-line message containing `needles`."""
    assert issubclass(error_type, ValueError)
    with pytest.raises(error_type) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert str(needle) in message, (needle, message)
    return message


# --- 1. config.json / model_index.json ------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["[]", "[1, 2]", '"a string"', "{not json", "[" * 100_000 + "]" * 100_000, "\xff"])
@pytest.mark.parametrize("file_name", ["config.json", "model_index.json"])
def test_config_file_that_is_not_an_object(tmp_path, file_name, text):
    path = tmp_path / file_name
    path.write_bytes(text.encode("latin-1"))
    _refused(ConfigError, lambda: read_config_file(str(path)), path)


@pytest.mark.parametrize("cls, key, value", [
    (UNetConfig, "layers_per_block", "two"),
    (UNetConfig, "block_out_channels", [32, "64"]),
    (UNetConfig, "block_out_channels", 64),
    (UNetConfig, "norm_eps", "1e-5"),
    (UNetConfig, "use_linear_projection", "yes"),
    (UNetConfig, "sample_size", 0),
    (UNetConfig, "freq_shift", -1),
    (CLIPTextConfig, "hidden_size", -5),
    (CLIPTextConfig, "layer_norm_eps", "small"),
    (CLIPTextConfig, "num_hidden_layers", 1.5),
    (CLIPTextConfig, "hidden_act", "swish"),
    (VAEConfig, "scaling_factor", 0),  # divides the latents by zero: a black image
    (VAEConfig, "scaling_factor", -0.18),
    (PNDMConfig, "num_train_timesteps", "1000"),
    (PNDMConfig, "num_train_timesteps", 0),
    (PNDMConfig, "beta_start", [0.1]),
    (PNDMConfig, "beta_schedule", "cosine"),
    (PNDMConfig, "trained_betas", ["a"]),
    (PNDMConfig, "trained_betas", [2.0]),
    (PNDMConfig, "skip_prk_steps", "no"),
])
def test_config_value_of_the_wrong_type_or_range(tmp_path, cls, key, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({key: value}))
    _refused(ConfigError, lambda: cls.from_dict(read_config_file(str(path))), path, key, repr(value)[:10])


def test_unknown_unet_block_type(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"down_block_types": ["FancyDownBlock2D"], "block_out_channels": [32]}))
    _refused(ValueError, lambda: UNetConfig.from_dict(read_config_file(str(path))), path, "FancyDownBlock2D")
    path.write_text(json.dumps({"down_block_types": "FancyDownBlock2D"}))  # a string, not a list
    _refused(ValueError, lambda: UNetConfig.from_dict(read_config_file(str(path))), path, "FancyDownBlock2D")


def test_good_config_still_loads(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"block_out_channels": [32, 64], "layers_per_block": 1, "norm_eps": 1,
                                "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
                                "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
                                "transformer_layers_per_block": [1, 2], "num_attention_heads": None}))
    cfg = UNetConfig.from_dict(read_config_file(str(path)))
    assert cfg.block_out_channels == (32, 64) and cfg.norm_eps == 1 and cfg.transformer_layers_per_block == (1, 2)


# --- 2. shard index ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [{}, {"weight_map": ["a.safetensors"]}, {"weight_map": {"w": 3}}, [],
                                   {"weight_map": {"w": "../elsewhere.safetensors"}}])
def test_shard_index_without_a_weight_map(tmp_path, index):
    path = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    path.write_text(json.dumps(index))
    _refused(CheckpointFileError, lambda: weight_files(str(tmp_path)), path)


# --- 3. safetensors ---------------------------------------------------------------------------------------------


def _safetensors(tmp_path, header: bytes, data=b"", length=None):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def test_safetensors_round_trip_still_works(tmp_path):
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(tmp_path / "model.safetensors"))
    np.testing.assert_array_equal(read_safetensors(tmp_path / "model.safetensors")["w"], np.arange(6).reshape(2, 3))


def test_safetensors_deeply_nested_header(tmp_path):
    path = _safetensors(tmp_path, b"[" * 100_000 + b"]" * 100_000)
    _refused(CheckpointFileError, lambda: read_safetensors(path), path, "JSON")


def test_safetensors_header_longer_than_the_file(tmp_path):
    path = _safetensors(tmp_path, b"{}", length=1 << 40)
    _refused(CheckpointFileError, lambda: read_safetensors(path), path, str(1 << 40))


def test_safetensors_header_over_the_cap(tmp_path):
    path = _safetensors(tmp_path, b"{}", length=150 << 20)
    with open(path, "r+b") as f:  # sparse: the file is long enough for the claim without using the disk
        f.truncate(200 << 20)
    _refused(CheckpointFileError, lambda: read_safetensors(path), path, str(150 << 20))


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]},  # wraps around to 0 elements in int64
    {"dtype": "F32", "shape": [2**63, 2], "data_offsets": [0, 0]},
    {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [-2, -1], "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]},
    {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.5]},
    {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]},
    [1, 2],
])
def test_safetensors_tensor_that_does_not_fit(tmp_path, entry):
    path = _safetensors(tmp_path, json.dumps({"bad.weight": entry}).encode(), data=bytes(8))
    _refused(CheckpointFileError, lambda: read_safetensors(path), path, "bad.weight")


# --- 4. PyTorch zip: sizes the file claims ----------------------------------------------------------------------


class _Storage:
    def __init__(self, numel):
        self.numel = numel


class _Tensor:
    """Pickles as torch does a float32 tensor of `numel` elements, without holding them."""

    def __init__(self, numel):
        self.storage = _Storage(numel)

    def __reduce__(self):
        numel = self.storage.numel
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, (numel,), (1,), False, collections.OrderedDict())


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", torch.FloatStorage, "0", "cpu", obj.numel) if isinstance(obj, _Storage) else None




def _zip_bomb(path, claimed_numel, member_bytes):
    info = zipfile.ZipInfo("archive/data/0")
    info.compress_type = zipfile.ZIP_DEFLATED
    pickled = io.BytesIO()
    _Pickler(pickled, protocol=2).dump({"bomb.weight": _Tensor(claimed_numel)})
    with zipfile.ZipFile(path, "w", compresslevel=9) as archive:
        archive.writestr("archive/data.pkl", pickled.getvalue())
        archive.writestr("archive/byteorder", "little")
        chunk = bytes(1 << 20)
        with archive.open(info, "w", force_zip64=True) as member:
            for _ in range(member_bytes >> 20):
                member.write(chunk)
    return path


def test_small_zip_that_inflates_to_a_gibibyte(tmp_path):
    # Two lies: the pickle's size disagrees with the member's, or both claim 1 GiB of a ~1 MB file.
    disagree = _zip_bomb(tmp_path / "disagree.bin", 4, 1 << 30)
    agree = _zip_bomb(tmp_path / "agree.bin", (1 << 30) // 4, 1 << 30)
    assert os.path.getsize(agree) < 4 << 20
    module = os.path.join(os.path.dirname(__file__), "..", "sdflax", "loading", "files.py")
    child = textwrap.dedent(f"""
        import importlib.util, sys
        # Loaded alone: importing the sdflax package would bring in jax, whose size hides the reader's.
        spec = importlib.util.spec_from_file_location("checkpoint_files", {module!r})
        checkpoint_files = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(checkpoint_files)
        for path in sys.argv[1:]:
            try:
                checkpoint_files.read_torch_bin(path)
                print("LOADED", path)
            except checkpoint_files.CheckpointFileError as e:
                assert isinstance(e, ValueError) and "\\n" not in str(e) and path in str(e), str(e)
                print("REFUSED", e)
        # VmHWM, not getrusage's ru_maxrss: Linux carries the latter over from the forking pytest process.
        print("MAXRSS_KIB", [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0])
    """)
    run = subprocess.run([sys.executable, "-c", child, str(disagree), str(agree)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["REFUSED", "REFUSED", "MAXRSS_KIB"], run.stdout
    assert "bytes" in lines[0] and "zip bomb" in lines[1], run.stdout
    assert int(lines[2].split()[1]) < 100 * 1024, run.stdout


# --- 5. a .pt embedding with a missing storage ------------------------------------------------------------------


def test_embedding_with_a_missing_storage(tmp_path):
    whole = tmp_path / "whole.pt"
    torch.save({"string_to_param": {"*": torch.zeros(2, 8)}, "name": "x"}, whole)
    broken = tmp_path / "broken.pt"
    with zipfile.ZipFile(whole) as source, zipfile.ZipFile(broken, "w") as target:
        for info in source.infolist():
            if "/data/" not in info.filename:
                target.writestr(info, source.read(info))
    _refused(CheckpointFileError, lambda: read_embedding(broken), broken, "storage")
    _refused(CheckpointFileError, lambda: read_torch_bin(broken), broken, "storage")
    _refused(CheckpointFileError, lambda: read_checkpoint(broken), broken, "storage")


def test_embedding_zip_bomb_is_refused_before_decompressing(tmp_path):
    """The textual-inversion reader bounds its storages as read_torch_bin does (a 64 MiB bomb: the checks come
    before any decompression, so a small one proves them)."""
    disagree = _zip_bomb(tmp_path / "disagree.pt", 4, 64 << 20)
    agree = _zip_bomb(tmp_path / "agree.pt", (64 << 20) // 4, 64 << 20)
    _refused(CheckpointFileError, lambda: read_embedding(disagree), disagree, "bytes")
    _refused(CheckpointFileError, lambda: read_embedding(agree), agree, "zip bomb")


# --- 6. NaN or inf in the weights ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, bad", [(np.float32, np.nan), (np.float32, -np.inf), (np.float16, np.inf),
                                        (np.float16, np.nan)])
def test_weights_with_nan_or_inf_are_refused_naming_the_tensor(tmp_path, dtype, bad):
    """Every loader's one path (`weights.convert_state_dict`) reads each tensor for NaN and inf as it copies it:
    a model folder, a pipeline, a single file, an adapter or an image encoder would draw black images."""
    from sdflax.loading.files import read_safetensors
    from sdflax.loading.weights import NonFiniteWeightsError
    from sdflax.models import AutoencoderKL
    from test_tiny_checkpoint import TINY

    written = read_safetensors(TINY / "vae" / "diffusion_pytorch_model.safetensors")
    tensors = {k: np.array(v, dtype) for k, v in written.items()}
    tensors["decoder.conv_out.weight"][1, 0, 2, 0] = bad
    tensors["encoder.conv_in.bias"][3] = bad
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_bytes((TINY / "vae" / "config.json").read_bytes())
    save_file(tensors, str(tmp_path / "vae" / "diffusion_pytorch_model.safetensors"))
    _refused(NonFiniteWeightsError, lambda: AutoencoderKL.from_pretrained(tmp_path, subfolder="vae"),
             "NaN or inf in decoder.conv_out.weight, encoder.conv_in.bias")
    tensors["decoder.conv_out.weight"][1, 0, 2, 0] = tensors["encoder.conv_in.bias"][3] = 3e4  # large, finite
    save_file(tensors, str(tmp_path / "vae" / "diffusion_pytorch_model.safetensors"))
    AutoencoderKL.from_pretrained(tmp_path, subfolder="vae")


def test_embedding_with_nan_is_refused(tmp_path):
    path = tmp_path / "diverged.safetensors"
    save_file({"emb_params": np.full((2, 8), np.nan, np.float32)}, str(path))
    _refused(ValueError, lambda: read_embedding(path), path, "NaN or inf")
