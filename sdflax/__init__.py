"""sdflax: Stable Diffusion inference in pure JAX/Flax."""

from .models import AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, ControlNetModel, UNet2DConditionModel
from .parallel import replicate, shard, unshard
from .generate import Inputs, Settings, generate, random_draws
from .pipeline import StableDiffusion, StableDiffusionOutput
from .img2img import StableDiffusionImg2Img
from .pipeline_xl import StableDiffusionXL, StableDiffusionXLImg2Img, StableDiffusionXLInpaint
from .pipeline_controlnet import (StableDiffusionControlNet, StableDiffusionControlNetImg2Img,
                                  StableDiffusionControlNetInpaint, StableDiffusionXLControlNet)
from .inpaint import StableDiffusionInpaint
from .utils import make_image_grid
from . import hooks

__all__ = ["AutoencoderKL", "CLIPTextModel", "CLIPTextModelWithProjection", "ControlNetModel", "Inputs", "Settings",
           "StableDiffusion", "StableDiffusionControlNet", "StableDiffusionControlNetImg2Img",
           "StableDiffusionControlNetInpaint",
           "StableDiffusionImg2Img", "StableDiffusionInpaint", "StableDiffusionOutput", "StableDiffusionXL",
           "StableDiffusionXLControlNet", "StableDiffusionXLImg2Img", "StableDiffusionXLInpaint",
           "UNet2DConditionModel", "generate", "hooks", "make_image_grid", "random_draws", "replicate", "shard",
           "unshard"]
