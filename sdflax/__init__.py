"""sdflax: Stable Diffusion inference in pure JAX/Flax."""

from .models import AutoencoderKL, CLIPTextModel, UNet2DConditionModel
from .parallel import replicate, shard, unshard
from .pipeline import StableDiffusion, StableDiffusionOutput
from .utils import make_image_grid

__all__ = ["AutoencoderKL", "CLIPTextModel", "StableDiffusion", "StableDiffusionOutput", "UNet2DConditionModel",
           "make_image_grid", "replicate", "shard", "unshard"]
