"""SDXL (base and refiner): two CLIP text encoders and size conditioning (`pipeline.text.SDXLText`), and its
public pipeline classes."""

from __future__ import annotations

from ..pipeline.controlnet import ControlNet
from ..pipeline.t2i_adapter import T2IAdapters
from ..pipeline.starts import FromImage, FromImageMask, FromNoise
from ..pipeline.table import CONTROL, Row
from ..pipeline.text import SDXLText
from .base import Family

# argument orders, as the classes have always had them
XL_SIZES = "original_size crops_coords_top_left target_size"
XL_EMBEDS = "prompt_embeds neg_prompt_embeds pooled_prompt_embeds neg_pooled_prompt_embeds"
XL_TAIL = "jit callback guidance return_trajectory " + XL_EMBEDS
XL_IMAGE = (f"num_inference_steps guidance_scale height width noise neg_prompt_ids guidance_rescale {XL_SIZES} "
            "aesthetic_score negative_aesthetic_score")

ROWS = {
    "StableDiffusionXL": Row(
        FromNoise, (),
        f"prompt_ids params prng_seed num_inference_steps guidance_scale height width latents neg_prompt_ids "
        f"guidance_rescale {XL_SIZES} {XL_TAIL} denoising_end output_type", {"guidance_scale": 5.0},
        "SDXL text-to-image; `denoising_end` and `output_type=\"latent\"` hand the latents to a refiner."),
    "StableDiffusionXLImg2Img": Row(
        FromImage, (),
        f"prompt_ids image params prng_seed strength {XL_IMAGE} denoising_start denoising_end output_type {XL_TAIL}",
        {"strength": 0.3, "guidance_scale": 5.0},
        "SDXL image-to-image, and the SDXL refiner (`denoising_start` continues a base run)."),
    "StableDiffusionXLInpaint": Row(
        FromImageMask, (),
        f"prompt_ids image mask params prng_seed strength {XL_IMAGE} denoising_start denoising_end output_type "
        f"{XL_TAIL}", {"strength": 0.9999}, "SDXL inpainting: SDXL inpainting UNets (9 channels) or ordinary ones."),
    "StableDiffusionXLControlNet": Row(
        FromNoise, (ControlNet,),
        f"prompt_ids image params prng_seed num_inference_steps guidance_scale latents neg_prompt_ids "
        f"controlnet_conditioning_scale jit callback guidance_rescale guidance return_trajectory {XL_SIZES} "
        f"{XL_EMBEDS} {CONTROL} height width", {"guidance_scale": 5.0},
        "SDXL text-to-image steered by SDXL ControlNets (`image`: the control image)."),
    "StableDiffusionXLControlNetImg2Img": Row(
        FromImage, (ControlNet,),
        f"prompt_ids image control_image params prng_seed strength {XL_IMAGE} controlnet_conditioning_scale "
        f"output_type {XL_TAIL} {CONTROL}", {"strength": 0.8, "guidance_scale": 5.0,
                                             "controlnet_conditioning_scale": 0.8},
        "SDXL image-to-image steered by SDXL ControlNets."),
    "StableDiffusionXLControlNetInpaint": Row(
        FromImageMask, (ControlNet,),
        f"prompt_ids image mask control_image params prng_seed strength {XL_IMAGE} controlnet_conditioning_scale "
        f"denoising_start denoising_end output_type {XL_TAIL} {CONTROL}", {"strength": 0.9999, "guidance_scale": 5.0},
        "SDXL inpainting steered by SDXL ControlNets; the nets see the 4-channel latents."),
    "StableDiffusionXLAdapter": Row(
        FromNoise, (T2IAdapters,),
        f"prompt_ids image params prng_seed num_inference_steps guidance_scale height width latents neg_prompt_ids "
        f"adapter_conditioning_scale adapter_conditioning_factor guidance_rescale {XL_SIZES} {XL_TAIL}",
        {"guidance_scale": 5.0}, "SDXL text-to-image steered by SDXL T2I-Adapters (`image`: the adapter's picture)."),
}

FAMILY = Family("sdxl", "SDXL", SDXLText, ("StableDiffusionXL",), ROWS, module=__name__, single_file="sdflax.loading.single_file:UNetFiles")

StableDiffusionXL = FAMILY.classes["StableDiffusionXL"]
StableDiffusionXLImg2Img = FAMILY.classes["StableDiffusionXLImg2Img"]
StableDiffusionXLInpaint = FAMILY.classes["StableDiffusionXLInpaint"]
StableDiffusionXLControlNet = FAMILY.classes["StableDiffusionXLControlNet"]
StableDiffusionXLControlNetImg2Img = FAMILY.classes["StableDiffusionXLControlNetImg2Img"]
StableDiffusionXLControlNetInpaint = FAMILY.classes["StableDiffusionXLControlNetInpaint"]
StableDiffusionXLAdapter = FAMILY.classes["StableDiffusionXLAdapter"]
