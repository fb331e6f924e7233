"""Files training writes: safetensors written atomically (LoRAs, embeddings, models, checkpoints).

Written to a temporary file beside the target, flushed to disk and renamed onto it, so a killed write never leaves a
truncated file under the name; an existing file is replaced only when asked. `sdflax.loading.files` reads them back.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

from ..loading.files import SAFETENSORS_DTYPES


def write_safetensors(path, tensors: dict, metadata: dict | None = None, overwrite: bool = False) -> None:
    """Write `tensors` ({name: array}, any numpy-convertible arrays) as a .safetensors file, atomically: the data
    goes to a temporary file beside `path`, is flushed to disk and renamed onto `path`, so a killed write never
    leaves a truncated file under the name. An existing `path` is an error unless `overwrite`."""
    name = os.fspath(path)
    if os.path.lexists(name) and not overwrite:
        raise FileExistsError(f"{name} exists: choose another path, or pass overwrite=True to replace it")
    codes = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
    header, arrays, offset = {}, [], 0
    for key in sorted(tensors):
        array = np.asarray(tensors[key])
        array = np.ascontiguousarray(array).reshape(array.shape)  # ascontiguousarray makes a 0-d array 1-d
        if array.dtype not in codes:
            raise TypeError(f"{key}: dtype {array.dtype} has no safetensors code")
        header[key] = {"dtype": codes[array.dtype], "shape": list(array.shape),
                       "data_offsets": [offset, offset + array.nbytes]}
        arrays.append(array)
        offset += array.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    atomic_write(name, [struct.pack("<Q", len(encoded)), encoded, *(a.data for a in arrays)])


def atomic_write(path: str, chunks) -> None:
    """Write `chunks` (bytes-like) to `path` through a temporary file in the same folder, fsync'd and renamed."""
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(temporary, "xb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)
    fsync_folder(folder)


def fsync_folder(folder: str) -> None:
    """Make a rename in `folder` durable (where the platform lets a folder be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
