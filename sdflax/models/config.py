"""Small frozen model configs read from diffusers / transformers `config.json` files."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from typing import Any, Mapping

# read_config_file records the file a dict came from under this key, so errors found later (when a model class
# builds its config) can name it; like diffusers' own "_"-prefixed keys, it is not a field of any config.
SOURCE_KEY = "_sdflax_config_file"

# Fields that count, size or scale something: a zero or negative value is a broken config, not a model (a VAE
# scaling_factor of 0 divides the latents by zero and decodes a black image).
_POSITIVE_FIELD = re.compile(r"(^num_|_size$|_dim$|_channels$|_groups$|^scaling_factor$)")


class ConfigError(ValueError):
    """A config file is not JSON, not an object, or holds a value of the wrong type or range."""


def config_source(config) -> str:
    """"<file>: " when `config` came from read_config_file, else "" (a prefix for error messages)."""
    source = config.get(SOURCE_KEY) if isinstance(config, Mapping) else None
    return f"{source}: " if source else ""


def _freeze(value):
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


def _scalar_ok(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:  # JSON writes 1.0 as 1 at times
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind)


def _value_problem(field: dataclasses.Field, hint, value) -> str | None:
    """Why `value` does not fit the field's annotation (int / float / bool / str / tuple, unions of them), or None.

    A bare `tuple` holds items of the default's item types; an `int | tuple` holds ints (nested tuples are left
    for the model to judge). Size-like fields must be positive, other ints non-negative.
    """
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    kinds = tuple(typing.get_origin(k) or k for k in kinds)  # tuple[float, ...] is a tuple
    scalars = tuple(k for k in kinds if k in (bool, int, float, str))
    if isinstance(value, tuple):
        if tuple not in kinds:
            return f"expected {' or '.join(k.__name__ for k in scalars)}, not a list"
        default = field.default if isinstance(field.default, tuple) else ()
        items = scalars or tuple({type(d) for d in default}) or (bool, int, float, str)
        flat = [w for v in value for w in (v if isinstance(v, tuple) else (v,))]
        bad = next((v for v in flat if not any(_scalar_ok(v, k) for k in items)), None)
        if bad is not None or any(isinstance(w, tuple) for w in flat):
            return f"expected a list of {' or '.join(k.__name__ for k in items)}"
        numbers = [v for v in flat if isinstance(v, (int, float)) and not isinstance(v, bool)]
    elif any(_scalar_ok(value, k) for k in scalars):
        numbers = [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []
    else:
        expected = [k.__name__ for k in scalars] + (["a list"] if tuple in kinds else [])
        return f"expected {' or '.join(expected)}"
    if _POSITIVE_FIELD.search(field.name) and any(n <= 0 for n in numbers):
        return "expected a positive value"
    if any(isinstance(n, int) and n < 0 for n in numbers):
        return "expected a non-negative value"
    return None


def config_from_dict(cls, config: Mapping[str, Any], unsupported: Mapping[str, Any] = {}):
    """Build `cls` from the fields it declares; keys that do not change the computation are ignored.

    `unsupported` maps keys we do not implement to the only value we accept (their diffusers default), so a
    checkpoint that needs them fails loudly instead of computing something else. Values are checked against
    the fields' types, so a wrong one fails here, naming the file and key, not deep inside the model.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"{cls.__name__}: the config is a {type(config).__name__}, not a JSON object")
    where = config_source(config)
    for key, accepted in unsupported.items():
        value = _freeze(config.get(key, accepted))
        if value != accepted and not (accepted is None and value in ((), "")):
            raise ConfigError(
                f"{where}{cls.__name__}: config has {key}={value!r:.200}, which sdflax does not support "
                f"(only {accepted!r})"
            )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {k: _freeze(v) for k, v in config.items() if k in fields and v is not None}
    for key, value in values.items():
        problem = _value_problem(fields[key], hints[key], value)
        if problem:
            raise ConfigError(f"{where}{cls.__name__}: {key}={config[key]!r:.200} is invalid ({problem})")
    return cls(**values)


def read_config_file(path) -> dict:
    """A config.json (or model_index.json) as a dict; bad JSON or a non-object is one error naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}: is this a diffusers checkpoint folder?")
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        # RecursionError: deeply nested brackets exhaust the JSON parser's stack.
        detail = " ".join(str(e).split())[:200]
        raise ConfigError(f"{path}: not valid JSON ({type(e).__name__}: {detail})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(config).__name__} {config!r:.100}")
    # Nested objects too: a full CLIPConfig keeps the text tower's fields under "text_config".
    for value in (config, *config.values()):
        if isinstance(value, dict):
            value.setdefault(SOURCE_KEY, os.fspath(path))
    return config
