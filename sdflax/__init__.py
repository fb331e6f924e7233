"""sdflax: Stable Diffusion in pure JAX/Flax.

The public names below are imported on first use (PEP 562): `import sdflax` costs nothing, and the `sdflax`
command answers --help and argument errors without starting JAX. `from sdflax import StableDiffusion` imports
what that class needs, and `sdflax.train` brings optax only when training."""

from __future__ import annotations

from .lazy import exports

MODULES = {  # public name -> the module that defines it (a module itself where the name is the module's)
    **dict.fromkeys(("AutoencoderKL", "CLIPTextModel", "CLIPTextModelWithProjection", "CLIPVisionModelWithProjection",
                     "ControlNetModel", "SD3Transformer2DModel", "SiglipVisionModel", "T2IAdapter", "T5EncoderModel",
                     "UNet2DConditionModel"), ".models"),
    **dict.fromkeys(("replicate", "shard", "unshard"), ".parallel"),
    "enable_compile_cache": ".cache",
    **dict.fromkeys(("StableDiffusion", "StableDiffusionAdapter", "StableDiffusionControlNet",
                     "StableDiffusionControlNetImg2Img", "StableDiffusionControlNetInpaint", "StableDiffusionImg2Img",
                     "StableDiffusionInpaint"), ".families.sd"),
    **dict.fromkeys(("StableDiffusion3", "StableDiffusion3Img2Img", "StableDiffusion3Inpaint"), ".families.sd3"),
    **dict.fromkeys(("StableDiffusion3ControlNet", "StableDiffusion3ControlNetInpaint"), ".families.sd3"),
    "SD3ControlNetModel": ".models.sd3_controlnet",
    **dict.fromkeys(("Flux", "FluxFill", "FluxImg2Img", "FluxInpaint", "FluxKontext", "FluxControlNet",
                     "FluxControlNetImg2Img", "FluxControlNetInpaint", "FluxControl", "FluxControlImg2Img",
                     "FluxControlInpaint"), ".families.flux"),
    "FluxTransformer2DModel": ".models.flux",
    "FluxControlNetModel": ".models.flux_controlnet",
    "FluxPriorRedux": ".pipeline.redux",
    **dict.fromkeys(("StableDiffusionXL", "StableDiffusionXLAdapter", "StableDiffusionXLControlNet",
                     "StableDiffusionXLControlNetImg2Img", "StableDiffusionXLControlNetInpaint",
                     "StableDiffusionXLImg2Img", "StableDiffusionXLInpaint"), ".families.sdxl"),
    "from_pretrained": ".families",
    **dict.fromkeys(("Inputs", "Pipeline", "Settings", "StableDiffusionOutput", "generate", "random_draws"),
                    ".pipeline"),
    "clip_image_inputs": ".pipeline.clip_image",
    "make_image_grid": ".utils",
    "write_demo": ".demo",
    "hooks": ".hooks",
    "metrics": ".metrics",
    "train": ".train",
}


__getattr__, __dir__ = exports(__name__, MODULES)

__all__ = ["AutoencoderKL", "CLIPTextModel", "CLIPTextModelWithProjection", "CLIPVisionModelWithProjection",
           "ControlNetModel", "FluxPriorRedux", "Inputs", "Pipeline", "SD3ControlNetModel", "SD3Transformer2DModel",
           "Settings", "StableDiffusion", "StableDiffusion3", "StableDiffusion3ControlNet",
           "StableDiffusion3ControlNetInpaint", "StableDiffusion3Img2Img", "StableDiffusion3Inpaint",
           "StableDiffusionAdapter",
           "StableDiffusionControlNet", "StableDiffusionControlNetImg2Img", "StableDiffusionControlNetInpaint",
           "StableDiffusionImg2Img", "StableDiffusionInpaint", "StableDiffusionOutput", "StableDiffusionXL",
           "StableDiffusionXLAdapter", "StableDiffusionXLControlNet", "StableDiffusionXLControlNetImg2Img",
           "StableDiffusionXLControlNetInpaint", "StableDiffusionXLImg2Img", "StableDiffusionXLInpaint", "SiglipVisionModel",
           "T2IAdapter",
           "T5EncoderModel", "UNet2DConditionModel", "clip_image_inputs", "enable_compile_cache", "from_pretrained",
           "generate", "hooks", "make_image_grid", "metrics", "random_draws", "replicate", "shard", "unshard",
           "write_demo"]
