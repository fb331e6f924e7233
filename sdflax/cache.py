"""What sdflax keeps between processes so that the second run starts fast: JAX's persistent compilation cache (the
compiled programs) and each model config's parameter shapes, both in one folder:

    $SDFLAX_CACHE_DIR, else ~/.cache/sdflax/jax (XDG_CACHE_HOME honoured)
        <JAX's compiled programs>
        param-shapes/<key>.json

`SDFLAX_CACHE_DIR=off` keeps nothing. A pipeline turns JAX's cache on for this folder when it builds its first
program, unless the process already chose (`jax_compilation_cache_dir` set, or `jax_enable_compilation_cache`
off). JAX has one such cache per process, so programs of your own that take over a second to compile are kept
there too.

A shapes file is keyed by the model's class and fields (its config), the source of `sdflax.models` and the JAX and
Flax versions, so a change to any of them traces the model again; an unreadable or edited file (it carries its
own checksum) is traced over.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

CACHE_ENV = "SDFLAX_CACHE_DIR"
OFF = "off"


def cache_dir() -> str | None:
    """The folder, or None with SDFLAX_CACHE_DIR=off."""
    value = os.environ.get(CACHE_ENV)
    if value:
        return None if value.strip().lower() == OFF else os.path.expanduser(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sdflax", "jax")


def enable_compile_cache(path: str | None = None) -> str | None:
    """Point JAX's persistent compilation cache at `path` (default `cache_dir()`) unless this process already chose
    a folder or turned the cache off. Returns the folder in use, or None."""
    import jax

    chosen = jax.config.jax_compilation_cache_dir
    if chosen or not jax.config.jax_enable_compilation_cache:
        return chosen or None
    path = path or cache_dir()
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
    return path


def param_shapes(module, trace=None):
    """`module.param_shapes()` (or `trace()`): the params tree of ShapeDtypeStructs, read from the cache when it
    was traced before. The loaders ask here; the models themselves keep nothing."""
    import jax
    import jax.numpy as jnp
    from flax import traverse_util

    trace = trace or module.param_shapes
    folder = cache_dir()
    if folder is None:
        return trace()
    path = Path(folder, "param-shapes", f"{_key(module)}.json")
    try:
        entry = json.loads(path.read_text())
        flat = entry["shapes"]
        if entry["digest"] != _digest(flat):
            raise ValueError("edited")  # a valid checkpoint would "not match the model config"
        return traverse_util.unflatten_dict({tuple(name.split("/")): jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
                                             for name, (shape, dtype) in flat.items()})
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        pass  # not there yet, not a shapes file, or edited: trace
    shapes = trace()
    flat = {"/".join(name): [list(leaf.shape), str(leaf.dtype)]
            for name, leaf in traverse_util.flatten_dict(shapes).items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump({"digest": _digest(flat), "shapes": flat}, f)
        os.replace(f.name, path)  # whole or not at all, whatever other processes read meanwhile
    except OSError:
        pass  # a read-only or full disk costs a trace next time, nothing more
    return shapes


def _digest(flat) -> str:
    """The shapes' own checksum, kept beside them: a file edited by hand (or damaged into other valid JSON) is
    traced over instead of making a valid checkpoint look wrong."""
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()


def _key(module) -> str:
    import jax

    text = "\n".join((type(module).__module__, type(module).__qualname__, repr(module), _models_source(),
                      jax.__version__, _flax_version()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.cache
def _models_source() -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.joinpath("models").glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _flax_version() -> str:
    import flax

    return flax.__version__
