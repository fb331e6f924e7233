"""Training on the pipelines' own models and params: LoRA, full fine-tuning, DreamBooth and textual inversion for
SD 1.x, 2.x and SDXL, each step as diffusers' training scripts compute it (docs/training.md). Its names load on first
use, so that `sdflax.train.data` (the command line's checks of a folder) starts without JAX."""

import importlib

MODULES = {"TrainConfig": ".config", "TrainState": ".trainer", "Trainer": ".trainer"}
__all__ = ["TrainConfig", "TrainState", "Trainer"]


def __getattr__(name):
    if name not in MODULES:
        raise AttributeError(f"module 'sdflax.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(MODULES[name], __name__), name)
    globals()[name] = value  # found here from now on
    return value


def __dir__():
    return sorted({*globals(), *__all__})
