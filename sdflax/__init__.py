"""sdflax: Stable Diffusion inference in pure JAX/Flax."""

from .models import AutoencoderKL, CLIPTextModel, UNet2DConditionModel
from .parallel import replicate, shard, unshard
from .pipeline import StableDiffusion, StableDiffusionOutput
from .img2img import StableDiffusionImg2Img
from .utils import make_image_grid

__all__ = ["AutoencoderKL", "CLIPTextModel", "StableDiffusion", "StableDiffusionImg2Img",
           "StableDiffusionOutput", "UNet2DConditionModel",
           "make_image_grid", "replicate", "shard", "unshard"]
