"""Small frozen model configs read from diffusers / transformers `config.json` files."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping


def _freeze(value):
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


def config_from_dict(cls, config: Mapping[str, Any], unsupported: Mapping[str, Any] = {}):
    """Build `cls` from the fields it declares; keys that do not change the computation are ignored.

    `unsupported` maps keys we do not implement to the only value we accept (their diffusers default), so a
    checkpoint that needs them fails loudly instead of computing something else.
    """
    for key, accepted in unsupported.items():
        value = _freeze(config.get(key, accepted))
        if value != accepted and not (accepted is None and value in ((), "")):
            raise ValueError(
                f"{cls.__name__}: config has {key}={value!r}, which sdflax does not support (only {accepted!r})"
            )
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: _freeze(v) for k, v in config.items() if k in names and v is not None})


def read_config_file(path) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}: is this a diffusers checkpoint folder?")
    with open(path) as f:
        return json.load(f)
