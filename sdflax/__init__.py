"""sdflax: Stable Diffusion inference in pure JAX/Flax."""

from .models import AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, UNet2DConditionModel
from .parallel import replicate, shard, unshard
from .pipeline import StableDiffusion, StableDiffusionOutput
from .img2img import StableDiffusionImg2Img
from .pipeline_xl import StableDiffusionXL
from .inpaint import StableDiffusionInpaint
from .utils import make_image_grid

__all__ = ["AutoencoderKL", "CLIPTextModel", "CLIPTextModelWithProjection", "StableDiffusion", "StableDiffusionImg2Img",
           "StableDiffusionInpaint", "StableDiffusionOutput", "StableDiffusionXL", "UNet2DConditionModel",
           "make_image_grid", "replicate", "shard", "unshard"]
