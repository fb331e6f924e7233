"""SD 3.x: CLIP-L, CLIP-G and T5 (`pipeline.sd3_text.SD3Text`), an MMDiT predicting a flow's velocity, its
command-line flags and its public pipeline classes (ControlNets: `pipeline.sd3_controlnet`)."""

from __future__ import annotations

from ..pipeline.sd3_controlnet import SD3ControlNet, SD3ControlNetInpaint
from ..pipeline.starts import FromImage, FromImageMask, FromNoise, FromNoiseBesideImageMask
from ..pipeline.table import Row
from ..pipeline.sd3_text import SD3Text
from .base import Family

# argument orders, as the classes have always had them
EMBEDS = "jit callback guidance return_trajectory prompt_embeds neg_prompt_embeds pooled_prompt_embeds " \
    "neg_pooled_prompt_embeds"
SD3_TAIL = f"{EMBEDS} skip_guidance_layers skip_layer_guidance_scale skip_layer_guidance_start skip_layer_guidance_stop"
# diffusers' SD 3 ControlNet pipelines (no skip-layer guidance there)
CONTROL = "num_inference_steps guidance_scale height width latents neg_prompt_ids controlnet_conditioning_scale " \
    f"control_guidance_start control_guidance_end controlnet_pooled_projections {EMBEDS}"
CONTROL_DEFAULTS = {"num_inference_steps": 28, "guidance_scale": 7.0, "controlnet_pooled_projections": None}
SD3_IMAGE = "num_inference_steps guidance_scale height width noise neg_prompt_ids"
# (flag, Request field): the command line's flags for SD 3.x alone
FLAGS = (("--prompt-3", "prompt_3"), ("--negative-prompt-3", "negative_prompt_3"), ("--no-t5", "no_t5"),
         ("--max-sequence-length", "max_sequence_length"), ("--slg-layers", "slg_layers"), ("--slg-scale", "slg_scale"))

ROWS = {
    "StableDiffusion3": Row(
        FromNoise, (),
        f"prompt_ids params prng_seed num_inference_steps guidance_scale height width latents neg_prompt_ids "
        f"{SD3_TAIL}", {"num_inference_steps": 28, "guidance_scale": 7.0},
        "SD 3.x text-to-image (SD 3.5 Medium's skip-layer guidance: `skip_guidance_layers=[7, 8, 9]`)."),
    "StableDiffusion3Img2Img": Row(
        FromImage, (), f"prompt_ids image params prng_seed strength {SD3_IMAGE} {SD3_TAIL}",
        {"strength": 0.6, "guidance_scale": 7.0}, "SD 3.x image-to-image."),
    "StableDiffusion3Inpaint": Row(
        FromImageMask, (), f"prompt_ids image mask params prng_seed strength {SD3_IMAGE} {SD3_TAIL}",
        {"strength": 0.6, "guidance_scale": 7.0}, "SD 3.x inpainting (the known region pasted back every step)."),
    "StableDiffusion3ControlNet": Row(
        FromNoise, (SD3ControlNet,), f"prompt_ids image params prng_seed {CONTROL}", CONTROL_DEFAULTS,
        "SD 3.x text-to-image steered by ControlNets (`image`: the control image; InstantX's SD 3 nets, "
        "Stability's SD 3.5 Large nets with `controlnet_pooled_projections`)."),
    "StableDiffusion3ControlNetInpaint": Row(
        FromNoiseBesideImageMask, (SD3ControlNetInpaint,), f"prompt_ids image mask params prng_seed {CONTROL}",
        CONTROL_DEFAULTS, "SD 3.x inpainting by an inpainting ControlNet (alimama's): the image with its mask is the "
        "nets' control; sampling starts from noise and pastes nothing back, as diffusers'."),
}

FAMILY = Family("sd3", "SD 3.x", SD3Text, ("StableDiffusion3",), ROWS, module=__name__, flags=FLAGS,
                single_file="sdflax.loading.single_file:MMDiTFiles", cli="sdflax.cli.sd3")

StableDiffusion3 = FAMILY.classes["StableDiffusion3"]
StableDiffusion3Img2Img = FAMILY.classes["StableDiffusion3Img2Img"]
StableDiffusion3Inpaint = FAMILY.classes["StableDiffusion3Inpaint"]
StableDiffusion3ControlNet = FAMILY.classes["StableDiffusion3ControlNet"]
StableDiffusion3ControlNetInpaint = FAMILY.classes["StableDiffusion3ControlNetInpaint"]
