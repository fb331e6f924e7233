"""Read checkpoint files into flat dicts of numpy arrays, without torch and without running pickled code.

Every reader returns arrays in the file's own dtype (bfloat16 as ``ml_dtypes.bfloat16``); the caller
casts tensor by tensor, so a half-precision load never holds a full float32 copy of the model.
Safetensors files and the storages of PyTorch zip files are memory-mapped and handed out as
read-only views, so "loading" costs page-table work, not copies.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import mmap
import os
import pickle
import struct
import zipfile
import zlib
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np

__all__ = [
    "CheckpointFileError",
    "UnsafeCheckpointError",
    "read_checkpoint",
    "read_flax_msgpack",
    "read_safetensors",
    "read_torch_bin",
]


class CheckpointFileError(ValueError):
    """A checkpoint file is corrupt, truncated or hostile; the message names the file (and tensor) in one line."""


class UnsafeCheckpointError(CheckpointFileError):
    """A pickled checkpoint asked for something other than tensor data."""


def _one_line(error: BaseException) -> str:
    # Messages from json, zipfile and pickle may span lines; the CLI prints exactly one.
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def read_checkpoint(path) -> dict[str, np.ndarray]:
    """Read any supported checkpoint file, choosing the reader by its suffix."""
    suffix = Path(path).suffix.lower()
    if suffix == ".safetensors":
        return read_safetensors(path)
    if suffix in (".bin", ".ckpt", ".pt", ".pth"):
        return read_torch_bin(path)
    if suffix == ".msgpack":
        return read_flax_msgpack(path)
    raise ValueError(
        f"don't know how to read {os.fspath(path)!r}: unknown suffix {suffix!r} "
        "(expected .safetensors, .bin, .ckpt, .pt, .pth or .msgpack)"
    )


# --------------------------------------------------------------------------------------------
# safetensors

SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


# Real headers are a few hundred bytes per tensor (about 1 MB for the largest models); a claim beyond this is
# corruption or an attempt to make the reader allocate it.
MAX_SAFETENSORS_HEADER_BYTES = 100 << 20


def _safetensors_header(f, name) -> tuple[dict, dict, int]:
    """(tensor entries, `__metadata__`, header size) of an open .safetensors file, bounded and type-checked."""
    file_size = os.fstat(f.fileno()).st_size
    if file_size < 8:
        raise CheckpointFileError(f"corrupt safetensors file {name!r}: {file_size} bytes, too short for a header")
    (header_size,) = struct.unpack("<Q", f.read(8))
    if header_size > file_size - 8:
        raise CheckpointFileError(
            f"corrupt safetensors file {name!r}: header claims {header_size} bytes "
            f"but the file has only {file_size - 8} after the length field (truncated?)"
        )
    if header_size > MAX_SAFETENSORS_HEADER_BYTES:
        raise CheckpointFileError(
            f"corrupt safetensors file {name!r}: header claims {header_size} bytes, more than the "
            f"{MAX_SAFETENSORS_HEADER_BYTES} sdflax accepts"
        )
    try:
        header = json.loads(f.read(header_size))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        # RecursionError: deeply nested brackets exhaust the JSON parser's stack.
        raise CheckpointFileError(
            f"corrupt safetensors file {name!r}: header is not valid JSON ({_one_line(e)})"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointFileError(f"corrupt safetensors file {name!r}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    # The format makes it a map of strings to strings; readers of it (LoRA configs) can then rely on that.
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFileError(f"corrupt safetensors file {name!r}: __metadata__ must map strings to strings, "
                                  f"got {metadata!r:.100}")
    return header, metadata, header_size


def safetensors_metadata(path) -> dict[str, str]:
    """The `__metadata__` of a .safetensors file ({} if none), checked as `read_safetensors` checks it."""
    name = os.fspath(path)
    with open(name, "rb") as f:
        return _safetensors_header(f, name)[1]


def read_safetensors(path) -> dict[str, np.ndarray]:
    """Read a .safetensors file as read-only numpy views on a memory map of it."""
    name = os.fspath(path)
    with open(name, "rb") as f:
        header, _, header_size = _safetensors_header(f, name)
        data_start = 8 + header_size
        data_size = os.fstat(f.fileno()).st_size - data_start
        # mmap refuses length 0; a file that holds only empty tensors needs no mapping anyway.
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if data_size > 0 else b""

    tensors = {}
    for key, info in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape, offsets = info["shape"], info["data_offsets"]
            # Strictly lists of ints: int() would also accept "12", 1.5 and true.
            if not (isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
                    and all(type(d) is int for d in shape + offsets)):
                raise TypeError(f"shape {shape!r:.100} and data_offsets {offsets!r:.100} must be lists of ints")
            shape, (begin, end) = tuple(shape), offsets
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFileError(
                f"corrupt safetensors file {name!r}: bad entry for {key!r:.200} ({_one_line(e)})"
            ) from None
        # Python ints: a shape such as [2**32, 2**32] would wrap around to 0 elements in int64.
        count = math.prod(shape)
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_size or end - begin != count * dtype.itemsize:
            raise CheckpointFileError(
                f"corrupt safetensors file {name!r}: {key!r:.200} ({info['dtype']} {list(shape)!s:.100}) has data "
                f"offsets [{begin}, {end}) that do not fit its size or the {data_size} data bytes (truncated?)"
            )
        if count == 0:
            tensors[key] = np.empty(shape, dtype)
            continue
        array = np.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + begin)
        tensors[key] = array.reshape(shape)
    return tensors


# --------------------------------------------------------------------------------------------
# PyTorch zip files (torch.save since 1.6)

_NUMPY_DTYPES = {name: np.dtype(t) for name, t in (
    ("float64", np.float64), ("float32", np.float32), ("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16),
    ("int64", np.int64), ("int32", np.int32), ("int16", np.int16), ("int8", np.int8), ("uint8", np.uint8),
    ("bool", np.bool_))}
_TORCH_STORAGE_DTYPES = {f"{storage}Storage": _NUMPY_DTYPES[name] for storage, name in (
    ("Double", "float64"), ("Float", "float32"), ("Half", "float16"), ("BFloat16", "bfloat16"), ("Long", "int64"),
    ("Int", "int32"), ("Short", "int16"), ("Char", "int8"), ("Byte", "uint8"), ("Bool", "bool"))}
# torch.float32-style globals: newer writers may put a dtype where a storage type used to be.
_TORCH_DTYPES = {**_NUMPY_DTYPES, **{alias: _NUMPY_DTYPES[name] for alias, name in (
    ("double", "float64"), ("float", "float32"), ("half", "float16"), ("long", "int64"), ("int", "int32"),
    ("short", "int16"))}}


class _TorchDtype(NamedTuple):
    """Stands in for a torch storage class or torch dtype: all the loader needs is the numpy dtype.

    Immutable, so a pickle's BUILD opcode cannot alter these shared instances.
    """

    torch_name: str
    dtype: np.dtype


def _rebuild_tensor(storage, storage_offset, size, stride, *, count_copy=None):
    if not isinstance(storage, np.ndarray) or storage.ndim != 1:
        raise ValueError(f"tensor refers to {type(storage).__name__}, not to a storage")
    size = tuple(int(s) for s in size)
    stride = tuple(int(s) for s in stride)
    storage_offset = int(storage_offset)
    if len(size) != len(stride) or min(size + stride, default=0) < 0 or storage_offset < 0:
        raise ValueError(f"bad tensor layout: offset {storage_offset}, size {size}, stride {stride}")
    # as_strided trusts its arguments blindly, so check the view stays inside the storage.
    if 0 not in size:
        last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= storage.size:
            raise ValueError(
                f"tensor (offset {storage_offset}, size {size}, stride {stride}) runs past the end "
                f"of its storage of {storage.size} elements"
            )
        # A view that repeats elements (stride 0, overlapping rows) would be copied out below: a few bytes of
        # file could claim gigabytes. Checkpoints hold none; refuse before allocating.
        count = math.prod(size)
        if count > storage.size:
            raise ValueError(f"tensor of size {size} (stride {stride}) claims {count} elements from a storage of "
                             f"{storage.size}: views that repeat elements are not read")
    base = storage[storage_offset:]
    itemsize = storage.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        base, shape=size, strides=tuple(s * itemsize for s in stride), writeable=False
    )
    if view.flags.c_contiguous:
        return view
    # Transposed tensors saved as-is are the one case that needs a copy; read-only like the views.
    if count_copy is not None:
        count_copy(view.nbytes)
    copy = np.ascontiguousarray(view)
    copy.flags.writeable = False
    return copy


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None,
                       *, count_copy=None):
    return _rebuild_tensor(storage, storage_offset, size, stride, count_copy=count_copy)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    return data


def _rebuild_parameter_with_state(data, requires_grad=False, backward_hooks=None, state=None):
    return data


MAX_VIEW_COPY_SLACK = 16 << 20  # bytes of copied views allowed beyond twice the storages (`count_copy`)

_ALLOWED_GLOBALS = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter_with_state,
    # Empty OrderedDicts carry backward hooks and state-dict metadata; constructing one runs no user code.
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{("torch", n): _TorchDtype(n, d) for n, d in _TORCH_STORAGE_DTYPES.items()},
    **{("torch", n): _TorchDtype(n, d) for n, d in _TORCH_DTYPES.items()},
}


class TensorOnlyUnpickler(pickle.Unpickler):
    """Unpickles a torch data.pkl, resolving only tensor-rebuilding globals to local stand-ins.

    find_class runs when the pickle names a global, before anything is called, so a refusal here
    means no code from the file has run. `member_size(key)`, when given, returns the uncompressed size the zip
    directory records for a storage (None if absent): the pickle's claim is checked against it before
    `read_storage` reads anything, so a lying file cannot make the reader allocate more than it declares.
    """

    def __init__(self, file, *, checkpoint_name: str, read_storage, member_size=None):
        super().__init__(file)
        self.checkpoint_name = checkpoint_name
        self.read_storage = read_storage
        self.member_size = member_size
        self.storage_bytes = {}  # key -> bytes of each storage read
        self.copied_bytes = 0

    def count_copy(self, nbytes):
        """Views that must be copied (transposed tensors) may copy each storage's bytes about twice in all: many
        views of one storage, a few bytes of pickle each, could otherwise claim gigabytes."""
        self.copied_bytes += nbytes
        stored = sum(self.storage_bytes.values())
        if self.copied_bytes > 2 * stored + MAX_VIEW_COPY_SLACK:
            raise ValueError(f"its non-contiguous tensors copy {self.copied_bytes} bytes out of storages of "
                             f"{stored}: views that repeat a storage are not read")

    def load(self):
        # Malformed pickles surface as any of these from deep inside; the caller gets one line naming the file.
        try:
            return super().load()
        except CheckpointFileError:
            raise
        except (pickle.UnpicklingError, ValueError, KeyError, IndexError, TypeError, AttributeError, EOFError,
                RecursionError, OverflowError, struct.error, zipfile.BadZipFile, zlib.error) as e:
            raise CheckpointFileError(f"corrupt PyTorch file {self.checkpoint_name!r}: {_one_line(e)}") from None

    def find_class(self, module, name):
        try:
            found = _ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise UnsafeCheckpointError(
                f"refusing to load {self.checkpoint_name}: it asks to import {module!s:.100}.{name!s:.100}; "
                "only tensor data is allowed"
            ) from None
        # A fresh wrapper per load: the pickle's BUILD opcode could otherwise set attributes
        # (e.g. __defaults__) on this module's functions and change later loads.
        if found in (_rebuild_tensor, _rebuild_tensor_v2):
            return functools.partial(found, count_copy=self.count_copy)
        return found if isinstance(found, _TorchDtype) else functools.partial(found)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafeCheckpointError(
                f"refusing to load {self.checkpoint_name}: unknown persistent id {pid!r:.200}"
            )
        _, storage_type, key, _location, numel = pid
        where = f"storage {str(key)!r:.100} in {self.checkpoint_name!r}"
        if not isinstance(storage_type, _TorchDtype):
            raise CheckpointFileError(f"bad storage type {storage_type!r:.100} for {where}")
        if type(numel) is not int or numel < 0:
            raise CheckpointFileError(f"{where}: bad element count {numel!r:.100}")
        if self.member_size is not None:
            size = self.member_size(str(key))
            if size is None:
                raise CheckpointFileError(f"{where}: the file has no data/{str(key):.100} member (truncated?)")
            # torch writes each storage as exactly numel * itemsize bytes.
            if numel * storage_type.dtype.itemsize != size:
                raise CheckpointFileError(
                    f"{where}: the pickle declares {numel} {storage_type.torch_name} elements "
                    f"({numel * storage_type.dtype.itemsize} bytes) but the stored member holds {size} bytes"
                )
        try:
            storage = self.read_storage(str(key), storage_type.dtype)
            self.storage_bytes[str(key)] = storage.nbytes
            return storage
        except KeyError:
            raise CheckpointFileError(f"{where}: the file has no data/{str(key):.100} member (truncated?)") from None


def _zip_member_offset(file, info: zipfile.ZipInfo) -> int:
    """Where the bytes of an uncompressed zip member start in the file (after its local header)."""
    file.seek(info.header_offset)
    local_header = file.read(30)
    if len(local_header) != 30 or local_header[:4] != b"PK\x03\x04":
        raise ValueError(f"bad zip local header for {info.filename!r}")
    name_length, extra_length = struct.unpack("<HH", local_header[26:30])
    return info.header_offset + 30 + name_length + extra_length


# Compressed members (torch never compresses, re-zipping tools may) are decompressed into memory. Tensor data
# compresses little, so a member that claims to grow more than this ratio (beyond a small size) is a zip bomb.
MAX_COMPRESSION_RATIO = 20
SMALL_MEMBER_BYTES = 16 << 20
# data.pkl holds structure only (names, shapes, storage keys); real ones are at most a few MB.
MAX_PICKLE_BYTES = 256 << 20


def check_member(name: str, info: zipfile.ZipInfo, limit: int | None = None) -> None:
    """Refuse a zip member whose uncompressed size is implausible, before anything is decompressed."""
    if limit is not None and info.file_size > limit:
        raise CheckpointFileError(
            f"{name!r}: zip member {info.filename!r:.200} claims {info.file_size} bytes, more than the {limit} allowed"
        )
    if (info.compress_type != zipfile.ZIP_STORED
            and info.file_size > max(SMALL_MEMBER_BYTES, MAX_COMPRESSION_RATIO * info.compress_size)):
        raise CheckpointFileError(
            f"{name!r}: zip member {info.filename!r:.200} inflates {info.compress_size} bytes to {info.file_size} "
            "(a zip bomb?); refusing to decompress it"
        )


def read_torch_bin(path) -> dict[str, np.ndarray]:
    """Read a PyTorch zip checkpoint (torch.save since 1.6) without torch and without running its pickle.

    Tensors come back as read-only views on a memory map of the file where the storage is stored
    uncompressed (torch always does that); tensors that share a storage share memory.
    If the pickled object is a dict with a "state_dict" dict entry (Lightning .ckpt files), that entry
    is returned; values that are not tensors (step counts, strings, nested dicts) are dropped.
    """
    name = os.fspath(path)
    obj = read_torch_object(name)
    if not isinstance(obj, dict):
        raise CheckpointFileError(f"{name!r} holds a {type(obj).__name__}, not a dict of tensors")
    if isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    return {str(k): v for k, v in obj.items() if isinstance(v, np.ndarray)}


def read_torch_object(path):
    """The whole pickled object of a PyTorch zip file (nested dicts, strings, numbers; tensors as in
    `read_torch_bin`), read by the tensor-only unpickler: what A1111's embeddings nest their vectors in."""
    name = os.fspath(path)
    try:
        is_zip = zipfile.is_zipfile(name)
    except (OSError, zipfile.BadZipFile) as e:  # a damaged zip64 end record: a seek before the file, "multi-disk"
        raise CheckpointFileError(f"corrupt PyTorch file {name!r}: {_one_line(e)}") from None
    if not is_zip:
        with open(name, "rb") as f:  # a zip begins with an entry and ends with its directory: a cut copy lacks that
            cut = f.read(4) == b"PK\x03\x04"
        raise CheckpointFileError(
            f"{name!r} is a truncated or damaged zip-format PyTorch checkpoint (no zip directory at its end): "
            "download or copy it again" if cut else f"{name!r} is not a zip-format PyTorch checkpoint; the legacy "
            "(pre-1.6) torch format is not supported: re-save it as safetensors (e.g. safetensors.torch.save_file("
            "torch.load(f), 'model.safetensors'))")
    try:
        return _read_torch_zip(name)
    except CheckpointFileError:
        raise
    # What damaged zip entries and pickle streams raise: encrypted or unknown-compression flags (RuntimeError,
    # NotImplementedError), a truncated or garbled pickle (UnpicklingError, EOFError, IndexError: a memo or stack
    # reference past the end), wrong-typed opcode arguments (TypeError), ids that are not text (UnicodeDecodeError),
    # offsets before the start of the file (OSError from seek).
    except (zipfile.BadZipFile, zlib.error, ValueError, EOFError, struct.error, RuntimeError, NotImplementedError,
            pickle.UnpicklingError, IndexError, KeyError, TypeError, OverflowError, OSError) as e:
        raise CheckpointFileError(f"corrupt PyTorch file {name!r}: {_one_line(e)}") from None


def _read_torch_zip(name: str):
    with open(name, "rb") as f, zipfile.ZipFile(f) as archive:
        members = {info.filename: info for info in archive.infolist()}
        pickles = [n for n in members if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise CheckpointFileError(f"{name!r} is a zip file but not a PyTorch checkpoint (no <archive>/data.pkl)")
        prefix = pickles[0][: -len("data.pkl")]
        byteorder = members.get(prefix + "byteorder")
        if byteorder is not None:
            check_member(name, byteorder, limit=16)
            if archive.read(byteorder).strip() != b"little":
                raise CheckpointFileError(f"{name!r} was saved big-endian; only little-endian checkpoints are supported")

        # One read-only mapping of the whole file; storages become views into it.
        file_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        storages: dict[str, np.ndarray] = {}

        def member_size(key: str) -> int | None:
            info = members.get(prefix + "data/" + key)
            return None if info is None else info.file_size

        def read_storage(key: str, dtype: np.dtype) -> np.ndarray:
            cached = storages.get(key)
            if cached is not None:
                return cached if cached.dtype == dtype else cached.view(dtype)
            info = members[prefix + "data/" + key]  # present: member_size checked it
            where = f"storage {key!r:.100} in {name!r}"
            if info.file_size % dtype.itemsize:
                raise CheckpointFileError(f"{where}: {info.file_size} bytes is not a whole number of {dtype}")
            count = info.file_size // dtype.itemsize
            if info.compress_type == zipfile.ZIP_STORED:
                start = _zip_member_offset(f, info)
                if start + info.file_size > len(file_map):
                    raise CheckpointFileError(f"{where} runs past the end of the file (truncated?)")
                storage = np.frombuffer(file_map, dtype=dtype, count=count, offset=start)
            else:  # not written by torch, but a re-zipped file may compress; then one read is unavoidable
                check_member(name, info)
                storage = np.frombuffer(archive.read(info), dtype=dtype, count=count)
            storages[key] = storage
            return storage

        check_member(name, members[pickles[0]], limit=MAX_PICKLE_BYTES)
        with archive.open(members[pickles[0]]) as pickle_file:
            unpickler = TensorOnlyUnpickler(
                pickle_file, checkpoint_name=name, read_storage=read_storage, member_size=member_size
            )
            return unpickler.load()


# --------------------------------------------------------------------------------------------
# Flax msgpack


def read_flax_msgpack(path) -> dict[str, np.ndarray]:
    """Read a Flax msgpack checkpoint; nested keys are joined with "." ("down_blocks_0.resnets_0.conv1.kernel")."""
    # msgpack_restore only decodes data (arrays are an ext type), so unlike pickle it cannot run code.
    # Imported here so that the other readers do not pay for importing jax.
    from flax.serialization import msgpack_restore

    name = os.fspath(path)
    with open(name, "rb") as f:
        data = f.read()
    try:
        tree = msgpack_restore(data)
    # msgpack's own errors are ValueErrors; a damaged array record fails in numpy (TypeError: an unknown dtype
    # name, ValueError: a shape that does not match its bytes) and a damaged map key in dict building.
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as e:
        raise CheckpointFileError(f"corrupt Flax msgpack file {name!r}: {_one_line(e)}") from None
    flat: dict[str, np.ndarray] = {}
    _flatten_into(flat, tree, "")
    return flat


def _flatten_into(flat: dict, node, prefix: str) -> None:
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        flat[prefix] = np.asarray(node)  # also turns jax arrays and python scalars into numpy
        return
    for key, value in items:
        _flatten_into(flat, value, f"{prefix}.{key}" if prefix else str(key))
