"""Packages whose public names are imported on first use (PEP 562): a package's `__init__` lists each name with the
submodule that defines it, and importing the package imports none of them. `from sdflax import StableDiffusion`
then loads the models, schedulers and guiders a Stable Diffusion pipeline uses, not all of them."""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Mapping


def by_module(modules: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """{".clip": ("CLIPTextModel", ...)} -> {"CLIPTextModel": ".clip", ...}."""
    return {name: module for module, names in modules.items() for name in names}


def exports(package: str, modules: Mapping[str, str]) -> tuple[Callable, Callable]:
    """`__getattr__, __dir__ = exports(__name__, {name: ".submodule"})`: a name is imported from its submodule (or is
    the submodule, where the two are spelled alike) when first read, then kept in the package. No public name may
    equal a submodule's that defines something else: importing that submodule binds the module to the name."""

    def __getattr__(name):
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(modules[name], package)
        value = module if module.__name__ == f"{package}.{name}" else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted({*vars(sys.modules[package]), *modules})

    return __getattr__, __dir__
