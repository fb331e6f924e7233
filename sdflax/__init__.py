"""sdflax: Stable Diffusion inference in pure JAX/Flax."""

from .models import (AutoencoderKL, CLIPTextModel, CLIPTextModelWithProjection, CLIPVisionModelWithProjection,
                     ControlNetModel, SD3Transformer2DModel, T2IAdapter, T5EncoderModel,
                     UNet2DConditionModel)
from .parallel import replicate, shard, unshard
from .cache import enable_compile_cache
from .families.sd import (StableDiffusion, StableDiffusionAdapter, StableDiffusionControlNet,
                         StableDiffusionControlNetImg2Img, StableDiffusionControlNetInpaint, StableDiffusionImg2Img,
                         StableDiffusionInpaint)
from .families.sd3 import StableDiffusion3, StableDiffusion3Img2Img, StableDiffusion3Inpaint
from .families.sdxl import (StableDiffusionXL, StableDiffusionXLAdapter, StableDiffusionXLControlNet,
                           StableDiffusionXLControlNetImg2Img, StableDiffusionXLControlNetInpaint,
                           StableDiffusionXLImg2Img, StableDiffusionXLInpaint)
from .families import from_pretrained
from .pipeline import Inputs, Pipeline, Settings, StableDiffusionOutput, generate, random_draws
from .pipeline.clip_image import clip_image_inputs
from .utils import make_image_grid
from . import hooks



def __getattr__(name):
    """`sdflax.train` on first use: sampling never imports optax."""
    if name == "train":
        import importlib

        return importlib.import_module(".train", __name__)
    raise AttributeError(f"module 'sdflax' has no attribute {name!r}")


__all__ = ["AutoencoderKL", "CLIPTextModel", "CLIPTextModelWithProjection", "CLIPVisionModelWithProjection",
           "ControlNetModel", "Inputs", "Pipeline", "SD3Transformer2DModel", "Settings", "StableDiffusion",
           "StableDiffusion3", "StableDiffusion3Img2Img", "StableDiffusion3Inpaint", "StableDiffusionAdapter",
           "StableDiffusionControlNet", "StableDiffusionControlNetImg2Img", "StableDiffusionControlNetInpaint",
           "StableDiffusionImg2Img", "StableDiffusionInpaint", "StableDiffusionOutput", "StableDiffusionXL",
           "StableDiffusionXLAdapter", "StableDiffusionXLControlNet", "StableDiffusionXLControlNetImg2Img",
           "StableDiffusionXLControlNetInpaint", "StableDiffusionXLImg2Img", "StableDiffusionXLInpaint", "T2IAdapter",
           "T5EncoderModel", "UNet2DConditionModel", "clip_image_inputs", "enable_compile_cache", "from_pretrained",
           "generate", "hooks", "make_image_grid", "random_draws", "replicate", "shard", "unshard"]
