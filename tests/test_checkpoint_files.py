"""Checkpoint readers against files written by torch, safetensors, diffusers and flax themselves."""

import builtins
import io
import json
import math
import os
import pickle
import struct
import subprocess
import sys
import zipfile

import ml_dtypes
import numpy as np
import pytest
import torch

from sdflax.loading.files import (
    UnsafeCheckpointError,
    read_checkpoint,
    read_flax_msgpack,
    read_torch_bin,
)


def _state_dict():
    torch.manual_seed(0)
    linear = torch.nn.Linear(5, 3)
    shared = torch.arange(24, dtype=torch.float32)
    return {
        "f32": torch.randn(4, 6),
        "f16": torch.randn(3, 7).half(),
        "bf16": torch.randn(2, 5, 3).to(torch.bfloat16),
        "i64": torch.arange(-5, 10, dtype=torch.int64).reshape(3, 5),
        "transposed": torch.randn(6, 4).t(),  # non-contiguous, saved as-is
        "shared_a": shared[2:14].view(3, 4),  # two views with storage offsets into one storage
        "shared_b": shared[10:],
        "scalar": torch.tensor(3.5),
        "linear.weight": linear.weight,  # torch.nn.Parameter
        "linear.bias": linear.bias,
    }


_NUMPY_DTYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.int64: np.int64,
}


def _assert_matches(ours, theirs):
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        array = ours[key]
        assert array.dtype == np.dtype(_NUMPY_DTYPES[tensor.dtype]), key
        assert array.shape == tuple(tensor.shape), key
        if tensor.dtype == torch.int64:
            np.testing.assert_array_equal(array, tensor.numpy(), err_msg=key)
        else:
            np.testing.assert_array_equal(array.astype(np.float32), tensor.detach().float().numpy(), err_msg=key)


def test_torch_zip_round_trip(tmp_path):
    state = _state_dict()
    path = tmp_path / "model.bin"
    torch.save(state, path)
    ours = read_torch_bin(path)
    _assert_matches(ours, state)
    assert ours["transposed"].flags.c_contiguous
    # Views, not copies: the two slices of one storage share memory, and nothing is writable.
    assert np.shares_memory(ours["shared_a"], ours["shared_b"])
    assert not any(a.flags.writeable for a in ours.values())
    for suffix in (".ckpt", ".pt", ".pth"):
        other = tmp_path / f"model{suffix}"
        other.write_bytes(path.read_bytes())
        _assert_matches(read_checkpoint(other), state)


def test_torch_ckpt_returns_state_dict_entry_and_drops_non_tensors(tmp_path):
    weights = {"w": torch.ones(2, 2), "step": 7, "name": "x"}
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": weights, "global_step": 5, "epoch": 1}, path)
    ours = read_checkpoint(path)
    assert list(ours) == ["w"]
    np.testing.assert_array_equal(ours["w"], np.ones((2, 2), np.float32))


def test_safetensors_round_trip(tmp_path):
    from safetensors.torch import save_file

    state = {k: v.detach().clone().contiguous() for k, v in _state_dict().items()}
    state["empty"] = torch.zeros(0, 3)
    state["mask"] = torch.tensor([True, False, True])
    path = tmp_path / "model.safetensors"
    save_file(state, path, metadata={"format": "pt"})
    ours = read_checkpoint(path)
    np.testing.assert_array_equal(ours.pop("mask"), [True, False, True])
    assert ours.pop("empty").shape == (0, 3)
    del state["empty"], state["mask"]
    _assert_matches(ours, state)
    assert not any(a.flags.writeable for a in ours.values())


def test_diffusers_save_pretrained_bin(tmp_path):
    from diffusers import AutoencoderKL

    model = AutoencoderKL(
        block_out_channels=(8,),
        norm_num_groups=4,
        latent_channels=4,
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
    )
    model.save_pretrained(tmp_path, safe_serialization=False)
    ours = read_checkpoint(tmp_path / "diffusion_pytorch_model.bin")
    _assert_matches(ours, model.state_dict())


def test_flax_msgpack_is_flattened(tmp_path):
    from flax.serialization import msgpack_serialize

    tree = {
        "down_blocks_0": {
            "attentions_0": {"proj_in": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}},
            "norm": {"scale": np.ones(4, ml_dtypes.bfloat16)},
        },
        "step": np.array(3, np.int64),
    }
    path = tmp_path / "flax_model.msgpack"
    path.write_bytes(msgpack_serialize(tree))
    ours = read_flax_msgpack(path)
    assert sorted(ours) == ["down_blocks_0.attentions_0.proj_in.kernel", "down_blocks_0.norm.scale", "step"]
    np.testing.assert_array_equal(ours["down_blocks_0.attentions_0.proj_in.kernel"], tree["down_blocks_0"]["attentions_0"]["proj_in"]["kernel"])
    assert ours["down_blocks_0.norm.scale"].dtype == ml_dtypes.bfloat16
    assert ours["step"].dtype == np.int64
    assert sorted(read_checkpoint(path)) == sorted(ours)


def _torch_like_zip(path, pickle_bytes, byteorder=b"little", storages=None):
    """A zip laid out like torch.save writes it, with an arbitrary data.pkl."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
        archive.writestr("archive/byteorder", byteorder)
        archive.writestr("archive/version", b"3\n")
        for key, data in (storages or {}).items():
            archive.writestr(f"archive/data/{key}", data)


class _CallsOnUnpickle:
    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def test_refuses_os_system(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"weight": _CallsOnUnpickle(os.system, f"touch {marker}")}, protocol=2)
    path = tmp_path / "evil.bin"
    _torch_like_zip(path, payload)
    with pytest.raises(UnsafeCheckpointError, match="system") as raised:
        read_checkpoint(path)
    assert "evil.bin" in str(raised.value) and "only tensor data is allowed" in str(raised.value)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 4])
def test_refuses_builtins_eval_and_subprocess(tmp_path, protocol):
    marker = tmp_path / "pwned"
    for function, args in [
        (builtins.eval, (f"open({str(marker)!r}, 'w')",)),
        (subprocess.Popen, (["touch", str(marker)],)),
    ]:
        path = tmp_path / "evil.pt"
        _torch_like_zip(path, pickle.dumps(_CallsOnUnpickle(function, *args), protocol=protocol))
        with pytest.raises(UnsafeCheckpointError, match=function.__name__):
            read_torch_bin(path)
        assert not marker.exists()


def test_refuses_bad_persistent_id(tmp_path):
    class WithPersistentId(pickle.Pickler):
        def persistent_id(self, obj):
            return ("module", "os") if obj == "x" else None

    buffer = io.BytesIO()
    WithPersistentId(buffer, protocol=2).dump({"w": "x"})
    path = tmp_path / "odd.bin"
    _torch_like_zip(path, buffer.getvalue())
    with pytest.raises(UnsafeCheckpointError, match="persistent id"):
        read_torch_bin(path)


def test_tensor_running_past_its_storage_is_refused(tmp_path):
    # Hand-built: a 100-element float view over a 4-element storage must not read out of bounds.
    path = tmp_path / "model.bin"
    torch.save({"w": torch.ones(4)}, path)
    with zipfile.ZipFile(path) as archive:
        prefix = archive.namelist()[0].split("/")[0]
        pkl = archive.read(f"{prefix}/data.pkl")
        data = archive.read(f"{prefix}/data/0")
    bad_pkl = pkl.replace(b"K\x04\x85", b"Kd\x85")  # size (4,) -> (100,)
    assert bad_pkl != pkl
    bad = tmp_path / "bad.bin"
    _torch_like_zip(bad, bad_pkl, storages={"0": data})
    with pytest.raises(ValueError, match="past the end"):
        read_torch_bin(bad)


@pytest.mark.parametrize("size, stride", [((20000, 20000), (0, 0)), ((131072, 131072), (0, 0)), ((5, 6), (1, 1))])
def test_views_that_repeat_elements_are_refused_before_allocating(tmp_path, size, stride):
    """A 1.7 KB file claimed 1.6 GB (stride 0), or a 64 GiB allocation; overlapping rows likewise."""
    path = tmp_path / "model.bin"
    torch.save({"x": torch.zeros(10).as_strided(size, stride)}, path)
    assert path.stat().st_size < 4096
    with pytest.raises(ValueError, match=rf"claims {math.prod(size)} elements from a storage of 10: views that "
                                         "repeat elements are not read"):
        read_torch_bin(path)


def test_big_endian_is_refused(tmp_path):
    path = tmp_path / "big.bin"
    _torch_like_zip(path, pickle.dumps({}), byteorder=b"big")
    with pytest.raises(ValueError, match="big-endian"):
        read_torch_bin(path)


def test_legacy_torch_format_gives_resave_advice(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="re-save it as safetensors") as raised:
        read_checkpoint(path)
    assert "old.pt" in str(raised.value)


def test_a_truncated_zip_bin_is_called_truncated_not_legacy(tmp_path):
    """A cut download of a torch.save file lost its zip directory: it was called the legacy (pre-1.6) format."""
    whole, cut = tmp_path / "whole.bin", tmp_path / "cut.bin"
    torch.save({"w": torch.ones(64)}, whole)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ValueError) as raised:
        read_checkpoint(cut)
    assert str(raised.value) == (f"{str(cut)!r} is a truncated or damaged zip-format PyTorch checkpoint (no zip "
                                 "directory at its end): download or copy it again")


def test_corrupt_safetensors_names_the_file(tmp_path):
    from safetensors.numpy import save_file

    good = tmp_path / "good.safetensors"
    save_file({"w": np.ones((64, 64), np.float32)}, good)
    blob = good.read_bytes()
    (header_size,) = struct.unpack("<Q", blob[:8])
    cases = {
        "tiny.safetensors": blob[:5],
        "cut_header.safetensors": blob[: 8 + header_size // 2],
        "cut_data.safetensors": blob[: len(blob) // 2],
        "not_json.safetensors": struct.pack("<Q", 4) + b"{{{{",
        "bad_dtype.safetensors": _safetensors_bytes({"w": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, 4),
        "bad_size.safetensors": _safetensors_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, 4),
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            read_checkpoint(path)


def _safetensors_bytes(header, data_size):
    header_bytes = json.dumps(header).encode()
    return struct.pack("<Q", len(header_bytes)) + header_bytes + b"\0" * data_size


def test_unknown_suffix(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.onnx"):
        read_checkpoint(path)


def test_runtime_module_does_not_import_torch():
    code = "import sys, sdflax.loading.files; print('torch' in sys.modules, 'diffusers' in sys.modules)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.split() == ["False", "False"]
