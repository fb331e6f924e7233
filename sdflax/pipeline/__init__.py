"""The pipeline layer: the values a call is made of (`types`), the pieces (`text`, `sd3_text`, `denoisers`,
`starts`, `controlnet`, `t2i_adapter`, `ip_adapter`, `vae`), the one computation (`generate`), its checks, its
programs (`runner`), and the public classes (`table`)."""

from .core import Pipeline, StableDiffusionOutput
from .generate import generate
from .table import (StableDiffusion, StableDiffusion3, StableDiffusion3Img2Img, StableDiffusion3Inpaint,
                    StableDiffusionAdapter, StableDiffusionControlNet,
                    StableDiffusionControlNetImg2Img, StableDiffusionControlNetInpaint, StableDiffusionImg2Img,
                    StableDiffusionInpaint, StableDiffusionXL, StableDiffusionXLAdapter, StableDiffusionXLControlNet,
                    StableDiffusionXLControlNetImg2Img, StableDiffusionXLControlNetInpaint, StableDiffusionXLImg2Img,
                    StableDiffusionXLInpaint, pipeline_class)
from .types import Inputs, Settings, Spec, random_draws
