"""The pipeline layer: the values a call is made of (`types`), the pieces (`text`, `starts`, `controlnet`, `vae`),
the one computation (`generate`), its checks, its programs (`runner`), and the public classes (`table`)."""

from .core import Pipeline, StableDiffusionOutput
from .generate import generate
from .table import (StableDiffusion, StableDiffusionAdapter, StableDiffusionControlNet, StableDiffusionControlNetImg2Img,
                    StableDiffusionControlNetInpaint, StableDiffusionImg2Img, StableDiffusionInpaint, StableDiffusionXL,
                    StableDiffusionXLControlNet, StableDiffusionXLControlNetImg2Img, StableDiffusionXLControlNetInpaint,
                    StableDiffusionXLAdapter, StableDiffusionXLImg2Img, StableDiffusionXLInpaint, pipeline_class)
from .types import Inputs, Settings, Spec, random_draws
