"""Training on the pipelines' own models and params: LoRA, full fine-tuning, DreamBooth and textual inversion for
SD 1.x, 2.x and SDXL, each step as diffusers' training scripts compute it (docs/training.md)."""

from .config import TrainConfig
from .trainer import Trainer, TrainState

__all__ = ["TrainConfig", "TrainState", "Trainer"]
