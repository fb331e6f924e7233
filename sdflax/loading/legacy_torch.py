"""PyTorch's legacy file format (torch.save before 1.6, or `_use_new_zipfile_serialization=False`), read without
torch and without running its pickle: the format of older published weights.

The file is five pickles, then the storages' bytes: magic number, protocol version, system info, the object (its
storages named by persistent ids `("storage", type, key, location, numel, None)`), the list of storage keys; then,
for each key in that order, its element count (int64) and its bytes. The object is unpickled twice by `files`'
tensor-only unpickler (which refuses every global but tensor rebuilding): first to learn each storage's type and
size (the tensors are not built), which place the storages in the file, then to build the tensors as read-only
views of a memory map. The other pickles are read by one that resolves no global at all.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import zipfile

import numpy as np

from .files import CheckpointFileError, TensorOnlyUnpickler, UnsafeCheckpointError, read_torch_bin

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
MAX_HEADER_BYTES = 1 << 20  # the system-info pickles are ~100 bytes


class PlainUnpickler(pickle.Unpickler):
    """Numbers, strings, lists, tuples and dicts only."""

    def find_class(self, module, name):
        raise UnsafeCheckpointError(f"refusing a pickle that imports {module!s:.100}.{name!s:.100}")

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(f"unexpected persistent id {pid!r:.100}")


class LegacyUnpickler(TensorOnlyUnpickler):
    """The tensor-only unpickler, taking the legacy storage ids (a sixth item, a view of a storage, is never written
    by torch.save of a state dict: refused)."""

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage" and pid[5] is None:
            return super().persistent_load(pid[:5])
        raise UnsafeCheckpointError(f"refusing to load {self.checkpoint_name}: unknown persistent id {pid!r:.200}")


class StorageLister(LegacyUnpickler):
    """Records each storage's (type, element count) and builds no tensor (the same globals allowed and refused)."""

    def __init__(self, file, checkpoint_name):
        super().__init__(file, checkpoint_name=checkpoint_name, read_storage=None)
        self.declared = {}

    def find_class(self, module, name):
        found = super().find_class(module, name)
        if getattr(getattr(found, "func", None), "__name__", "").startswith("_rebuild"):
            return lambda *args, **kwargs: None
        return found

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage" and pid[5] is None):
            raise UnsafeCheckpointError(f"refusing to load {self.checkpoint_name}: unknown persistent id "
                                        f"{pid!r:.200}")
        _, storage_type, key, _, numel, _ = pid
        if not hasattr(storage_type, "dtype") or type(numel) is not int or numel < 0:
            raise CheckpointFileError(f"{self.checkpoint_name!r}: bad storage {pid!r:.200}")
        self.declared[str(key)] = (storage_type.dtype, numel)


def read_torch_any(path) -> dict[str, np.ndarray]:
    """A PyTorch file of either format -> {name: array}, as `files.read_torch_bin` returns it."""
    name = os.fspath(path)
    try:
        is_zip = zipfile.is_zipfile(name)
    except OSError:
        is_zip = False
    if is_zip:
        return read_torch_bin(name)
    try:
        obj = read_legacy(name)
    except CheckpointFileError:
        raise
    except (pickle.UnpicklingError, ValueError, EOFError, struct.error, IndexError, KeyError, TypeError,
            AttributeError, OverflowError, RecursionError, OSError) as e:
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise CheckpointFileError(f"corrupt PyTorch file {name!r}: {detail}") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise CheckpointFileError(f"{name!r} holds a {type(obj).__name__}, not a dict of tensors")
    return {str(k): v for k, v in obj.items() if isinstance(v, np.ndarray)}


def read_legacy(name: str):
    with open(name, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if f.read(1) != b"\x80":  # torch's pickles start with PROTO
            raise CheckpointFileError(f"{name!r} is neither a zip nor a legacy PyTorch file")
        f.seek(0)
        magic = PlainUnpickler(f).load()
        if magic != MAGIC_NUMBER:
            raise CheckpointFileError(f"{name!r} is not a PyTorch file (magic number {magic!r:.40})")
        protocol, info = PlainUnpickler(f).load(), PlainUnpickler(f).load()
        if protocol != PROTOCOL_VERSION or not isinstance(info, dict) or f.tell() > MAX_HEADER_BYTES:
            raise CheckpointFileError(f"{name!r}: legacy PyTorch file of protocol {protocol!r:.40}, sdflax reads "
                                      f"{PROTOCOL_VERSION}")
        if not info.get("little_endian", False):
            raise CheckpointFileError(f"{name!r} was saved big-endian; only little-endian checkpoints are supported")
        start = f.tell()
        lister = StorageLister(f, name)
        lister.load()
        keys = PlainUnpickler(f).load()
        if not isinstance(keys, list) or sorted(map(str, keys)) != sorted(lister.declared):
            raise CheckpointFileError(f"{name!r}: its storage list does not name the storages its tensors use")
        layout, offset = {}, f.tell()  # key -> (offset of its bytes, element count)
        for key in map(str, keys):
            dtype, numel = lister.declared[key]
            f.seek(offset)
            header = f.read(8)
            if len(header) != 8:
                raise CheckpointFileError(f"{name!r}: storage {key!r:.100} runs past the end of the file (truncated?)")
            count = struct.unpack("<q", header)[0]
            if count != numel:
                raise CheckpointFileError(f"{name!r}: storage {key!r:.100} holds {count} elements where its tensor "
                                          f"declares {numel} (truncated or damaged)")
            layout[key] = (offset + 8, dtype, numel)
            offset += 8 + numel * dtype.itemsize
            if offset > size:
                raise CheckpointFileError(f"{name!r}: storage {key!r:.100} runs past the end of the file (truncated?)")
        file_map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""

        def read_storage(key, dtype):
            start_byte, stored, numel = layout[key]
            if dtype != stored:
                raise CheckpointFileError(f"{name!r}: storage {key!r:.100} read as {dtype} and {stored}")
            return np.frombuffer(file_map, dtype=dtype, count=numel, offset=start_byte)

        f.seek(start)
        return LegacyUnpickler(f, checkpoint_name=name, read_storage=read_storage,
                               member_size=lambda key: layout[key][2] * layout[key][1].itemsize
                               if key in layout else None).load()
