"""SD 1.x / 2.x: one CLIP text encoder (`pipeline.text.SDText`), a UNet predicting ε or v, and their public
pipeline classes."""

from __future__ import annotations

from ..pipeline.controlnet import ControlNet
from ..pipeline.t2i_adapter import T2IAdapters
from ..pipeline.starts import FromImage, FromImageMask, FromNoise
from ..pipeline.table import CONTROL, Row
from ..pipeline.text import SDText
from .base import Family

# argument orders, as the classes have always had them (the SD ones follow diffusers' old Flax pipelines)
SD = "num_inference_steps height width guidance_scale"
SD_TAIL = "jit callback guidance_rescale guidance return_trajectory prompt_embeds neg_prompt_embeds"

ROWS = {
    "StableDiffusion": Row(
        FromNoise, (), f"prompt_ids params prng_seed {SD} latents neg_prompt_ids {SD_TAIL} output_type", {},
        "Text-to-image with SD 1.x / 2.x checkpoints; `output_type=\"latent\"` returns the latents (hires fix)."),
    "StableDiffusionImg2Img": Row(
        FromImage, (), f"prompt_ids image params prng_seed strength {SD} noise neg_prompt_ids {SD_TAIL}",
        {"strength": 0.8}, "Image-to-image (SDEdit) with SD 1.x / 2.x checkpoints."),
    "StableDiffusionInpaint": Row(
        FromImageMask, (),
        f"prompt_ids image mask params prng_seed strength {SD} noise neg_prompt_ids {SD_TAIL}", {},
        "Inpainting with SD 1.x / 2.x checkpoints: inpainting UNets (9 channels) or ordinary ones."),
    "StableDiffusionControlNet": Row(
        FromNoise, (ControlNet,),
        f"prompt_ids image params prng_seed num_inference_steps guidance_scale latents neg_prompt_ids "
        f"controlnet_conditioning_scale {SD_TAIL} {CONTROL} height width", {},
        "Text-to-image steered by ControlNets (`image`: the control image, as diffusers' old Flax pipeline)."),
    "StableDiffusionControlNetImg2Img": Row(
        FromImage, (ControlNet,),
        f"prompt_ids image control_image params prng_seed strength {SD} noise neg_prompt_ids "
        f"controlnet_conditioning_scale {SD_TAIL} {CONTROL}", {"strength": 0.8, "controlnet_conditioning_scale": 0.8},
        "Image-to-image steered by ControlNets."),
    "StableDiffusionControlNetInpaint": Row(
        FromImageMask, (ControlNet,),
        f"prompt_ids image mask control_image params prng_seed strength {SD} noise neg_prompt_ids "
        f"controlnet_conditioning_scale {SD_TAIL} {CONTROL}", {"controlnet_conditioning_scale": 0.5},
        "Inpainting steered by ControlNets; the nets see the 4-channel latents. An inpainting ControlNet wants "
        "the image with the repainted pixels set to -1 as its control image."),
    "StableDiffusionAdapter": Row(
        FromNoise, (T2IAdapters,),
        f"prompt_ids image params prng_seed {SD} latents neg_prompt_ids adapter_conditioning_scale {SD_TAIL}", {},
        "Text-to-image steered by T2I-Adapters (`image`: the adapter's picture, e.g. a sketch or depth map)."),
}

FAMILY = Family("sd", "SD 1.x / 2.x", SDText, ("StableDiffusion",), ROWS, module=__name__,
                single_file="sdflax.loading.single_file:UNetFiles")

StableDiffusion = FAMILY.classes["StableDiffusion"]
StableDiffusionImg2Img = FAMILY.classes["StableDiffusionImg2Img"]
StableDiffusionInpaint = FAMILY.classes["StableDiffusionInpaint"]
StableDiffusionControlNet = FAMILY.classes["StableDiffusionControlNet"]
StableDiffusionControlNetImg2Img = FAMILY.classes["StableDiffusionControlNetImg2Img"]
StableDiffusionControlNetInpaint = FAMILY.classes["StableDiffusionControlNetInpaint"]
StableDiffusionAdapter = FAMILY.classes["StableDiffusionAdapter"]
