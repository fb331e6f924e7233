"""A model's config.json named by a flag (a diffusers folder or hub id: only the config is fetched), checked to be
the class the flag takes, before its weights load."""

from __future__ import annotations

import os

from ..request import UserError


def model_config(flag, name, class_name, config_class, what, example):
    """`config_class` of `name`'s config.json; `what` ("a T2I-Adapter") and `example` (a hub id) for messages."""
    from ...loading.hub import ModelNotFoundError, resolve_folder
    from ...models.config import read_config_file

    if os.path.isfile(os.path.expanduser(name)):
        raise UserError(f"{flag} is a file: give the folder of a diffusers {class_name} (config.json beside its "
                        f"weights) or a hub id, e.g. {example}")
    try:
        folder = resolve_folder(name, None, allow_patterns=["config.json"])
        config = read_config_file(os.path.join(folder, "config.json"))
        kind = config.get("_class_name", class_name)
        if kind != class_name:
            article = "an" if class_name[0] in "AEIOU" else "a"
            raise UserError(f"{flag} is a {kind}, not {article} {class_name}: give the folder or hub id of {what}, "
                            f"e.g. {example}")
        return config_class.from_dict(config)
    except (ModelNotFoundError, ValueError, TypeError, OSError) as e:
        raise UserError(f"{flag}: {e}") from e
