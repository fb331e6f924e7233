"""The model families as values (`base.Family`), and the registry that finds one by name or by a checkpoint's
`model_index.json`.

sdflax's own (`sd`, `sdxl`, `sd3`, `flux`) are modules of this package, imported on first lookup; `register` adds a family
from anywhere, so a user's module can add one without editing sdflax.
"""

from __future__ import annotations

import importlib
import os

from .base import Family, Row

BUILT_IN = ("sd", "sdxl", "sd3", "flux")  # modules of this package, each with a FAMILY
FALLBACK = "sd"  # the family of a checkpoint whose pipeline class no family claims (LCM, AltDiffusion: SD UNets)
_added: dict = {}


def register(family: Family) -> Family:
    """Make `family` known by its name and its checkpoints' class names; returns it (a family's module ends with
    `FAMILY = register(Family(...))`)."""
    if not isinstance(family, Family):
        raise TypeError(f"register takes an sdflax.families.Family, not {type(family).__name__}")
    known = registered()
    if family.name in known and known[family.name] is not family:
        raise ValueError(f"a family named {family.name!r} is registered already")
    _added[family.name] = family
    return family


def registered() -> dict:
    """Every known family by name: sdflax's own, then those registered."""
    own = {name: importlib.import_module(f"{__name__}.{name}").FAMILY for name in BUILT_IN}
    return {**own, **_added}


def named(name: str) -> Family:
    known = registered()
    if name not in known:
        raise ValueError(f"no model family named {name!r}; known: {', '.join(known)}")
    return known[name]


def for_index(index: dict) -> Family:
    """The family of a diffusers folder from its model_index.json's `_class_name` (the longest claimed prefix)."""
    class_name = str(index.get("_class_name", ""))
    claims = {family: family.claims(class_name) for family in registered().values()}
    best = max(claims, key=claims.get)
    return best if claims[best] else named(FALLBACK)


def for_single_file(state_dict) -> tuple[Family, str]:
    """(family, pipeline class name) of a single file from its tensor names: the first family whose layout
    (`Family.single_file`) names the pipeline class the file is, as a folder's model_index.json would."""
    from ..loading.single_file import layout_of, not_a_single_file

    for family in registered().values():
        name = family.single_file and layout_of(family.single_file).pipeline_name(state_dict)
        if name:
            return for_index({"_class_name": name}), name
    raise not_a_single_file(state_dict)


def from_pretrained(path_or_repo_id, revision=None, start="noise", controlnet=False, **kwargs):
    """(pipeline, params) of the class a checkpoint's family has for `start` ("noise", "image", "image_mask") and
    `controlnet`, chosen by a diffusers folder's model_index.json, as diffusers' AutoPipelineForText2Image, or by a
    single file's tensor names: the other arguments are the class's `from_pretrained`'s (`from_single_file`'s)."""
    from ..loading.files import read_checkpoint
    from ..loading.folders import read_index
    from ..loading.hub import resolve_folder

    path = os.path.expanduser(str(path_or_repo_id))
    if os.path.isfile(path):
        family, class_name = for_single_file(read_checkpoint(path))
        cls = family.pipeline_class(start, controlnet, class_name)
        return cls.from_single_file(path, revision=revision, **kwargs)

    index = read_index(resolve_folder(path_or_repo_id, revision, allow_patterns=["model_index.json"]))
    cls = for_index(index).pipeline_class(start, controlnet, index.get("_class_name"))
    return cls.from_pretrained(path_or_repo_id, revision=revision, **kwargs)


__all__ = ["Family", "Row", "for_index", "for_single_file", "from_pretrained", "named", "register", "registered"]
