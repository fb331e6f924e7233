"""The pipelines as data: one row per (family, start, wrappers) cell, naming its pieces and its public argument
order, from which the public classes are made. A new UNet-side conditioning is a piece and a row; a new family a
text piece and its rows.

Every argument means the same in every class (docs/design.md, "How a pipeline is built"); the defaults are diffusers'
for the matching pipeline: `DEFAULTS`, with a row's own values where diffusers' pipelines differ.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

from .controlnet import ControlNet
from .core import Pipeline
from .images import preprocess_adapter_images, preprocess_control_images
from .starts import FromImage, FromImageMask, FromNoise
from .t2i_adapter import T2IAdapters
from .sd3_text import SD3Text
from .text import SDText, SDXLText

DEFAULTS = {"num_inference_steps": 50, "height": None, "width": None, "guidance_scale": 7.5, "latents": None,
            "noise": None, "neg_prompt_ids": None, "jit": False, "callback": None, "guidance_rescale": 0.0,
            "guidance": None, "return_trajectory": False, "prompt_embeds": None, "neg_prompt_embeds": None,
            "pooled_prompt_embeds": None, "neg_pooled_prompt_embeds": None, "original_size": None,
            "crops_coords_top_left": (0, 0), "target_size": None, "aesthetic_score": 6.0,
            "negative_aesthetic_score": 2.5, "denoising_start": None, "denoising_end": None, "output_type": "np",
            "strength": 1.0, "controlnet_conditioning_scale": 1.0, "control_guidance_start": 0.0,
            "control_guidance_end": 1.0, "guess_mode": False, "timesteps": None, "sigmas": None,
            "ip_adapter_image": None, "ip_adapter_image_embeds": None, "ip_adapter_scale": 1.0,
            "ip_adapter_masks": None,
            "adapter_image": None, "adapter_conditioning_scale": 1.0, "adapter_conditioning_factor": 1.0,
            "skip_guidance_layers": None, "skip_layer_guidance_scale": 2.8, "skip_layer_guidance_start": 0.01,
            "skip_layer_guidance_stop": 0.2}
REQUIRED = ("prompt_ids", "image", "mask", "control_image", "params", "prng_seed")

# argument orders, as the classes have always had them (the SD ones follow diffusers' old Flax pipelines)
SD = "num_inference_steps height width guidance_scale"
SD_TAIL = "jit callback guidance_rescale guidance return_trajectory prompt_embeds neg_prompt_embeds"
XL_SIZES = "original_size crops_coords_top_left target_size"
XL_EMBEDS = "prompt_embeds neg_prompt_embeds pooled_prompt_embeds neg_pooled_prompt_embeds"
XL_TAIL = "jit callback guidance return_trajectory " + XL_EMBEDS
XL_IMAGE = (f"num_inference_steps guidance_scale height width noise neg_prompt_ids guidance_rescale {XL_SIZES} "
            "aesthetic_score negative_aesthetic_score")
CONTROL = "control_guidance_start control_guidance_end guess_mode"
SCHEDULE = "timesteps sigmas"  # near the end of every class, as diffusers' pipelines take them
# every class, with load_ip_adapter
IP_ADAPTER = "ip_adapter_image ip_adapter_image_embeds ip_adapter_scale ip_adapter_masks"
# last in the classes whose row has no T2I-Adapter: an adapter given to them (adapter=) reads these
T2I_ADAPTER = "adapter_image adapter_conditioning_scale adapter_conditioning_factor"
SD3_TAIL = ("jit callback guidance return_trajectory prompt_embeds neg_prompt_embeds pooled_prompt_embeds "
            "neg_pooled_prompt_embeds skip_guidance_layers skip_layer_guidance_scale skip_layer_guidance_start "
            "skip_layer_guidance_stop")
SD3_IMAGE = "num_inference_steps guidance_scale height width noise neg_prompt_ids"


class Row(NamedTuple):
    text: type
    start: type
    wrappers: tuple
    arguments: str  # positional order after the fixed leading ones
    defaults: dict  # where this pipeline's defaults differ from DEFAULTS
    doc: str


ROWS = {
    "StableDiffusion": Row(SDText, FromNoise, (), f"prompt_ids params prng_seed {SD} latents neg_prompt_ids {SD_TAIL}",
                           {}, "Text-to-image with SD 1.x / 2.x checkpoints."),
    "StableDiffusionImg2Img": Row(
        SDText, FromImage, (), f"prompt_ids image params prng_seed strength {SD} noise neg_prompt_ids {SD_TAIL}",
        {"strength": 0.8}, "Image-to-image (SDEdit) with SD 1.x / 2.x checkpoints."),
    "StableDiffusionInpaint": Row(
        SDText, FromImageMask, (),
        f"prompt_ids image mask params prng_seed strength {SD} noise neg_prompt_ids {SD_TAIL}", {},
        "Inpainting with SD 1.x / 2.x checkpoints: inpainting UNets (9 channels) or ordinary ones."),
    "StableDiffusionXL": Row(
        SDXLText, FromNoise, (),
        f"prompt_ids params prng_seed num_inference_steps guidance_scale height width latents neg_prompt_ids "
        f"guidance_rescale {XL_SIZES} {XL_TAIL} denoising_end output_type", {"guidance_scale": 5.0},
        "SDXL text-to-image; `denoising_end` and `output_type=\"latent\"` hand the latents to a refiner."),
    "StableDiffusionXLImg2Img": Row(
        SDXLText, FromImage, (),
        f"prompt_ids image params prng_seed strength {XL_IMAGE} denoising_start denoising_end output_type {XL_TAIL}",
        {"strength": 0.3, "guidance_scale": 5.0},
        "SDXL image-to-image, and the SDXL refiner (`denoising_start` continues a base run)."),
    "StableDiffusionXLInpaint": Row(
        SDXLText, FromImageMask, (),
        f"prompt_ids image mask params prng_seed strength {XL_IMAGE} denoising_start denoising_end output_type "
        f"{XL_TAIL}", {"strength": 0.9999}, "SDXL inpainting: SDXL inpainting UNets (9 channels) or ordinary ones."),
    "StableDiffusionControlNet": Row(
        SDText, FromNoise, (ControlNet,),
        f"prompt_ids image params prng_seed num_inference_steps guidance_scale latents neg_prompt_ids "
        f"controlnet_conditioning_scale {SD_TAIL} {CONTROL} height width", {},
        "Text-to-image steered by ControlNets (`image`: the control image, as diffusers' old Flax pipeline)."),
    "StableDiffusionXLControlNet": Row(
        SDXLText, FromNoise, (ControlNet,),
        f"prompt_ids image params prng_seed num_inference_steps guidance_scale latents neg_prompt_ids "
        f"controlnet_conditioning_scale jit callback guidance_rescale guidance return_trajectory {XL_SIZES} "
        f"{XL_EMBEDS} {CONTROL} height width", {"guidance_scale": 5.0},
        "SDXL text-to-image steered by SDXL ControlNets (`image`: the control image)."),
    "StableDiffusionControlNetImg2Img": Row(
        SDText, FromImage, (ControlNet,),
        f"prompt_ids image control_image params prng_seed strength {SD} noise neg_prompt_ids "
        f"controlnet_conditioning_scale {SD_TAIL} {CONTROL}", {"strength": 0.8, "controlnet_conditioning_scale": 0.8},
        "Image-to-image steered by ControlNets."),
    "StableDiffusionControlNetInpaint": Row(
        SDText, FromImageMask, (ControlNet,),
        f"prompt_ids image mask control_image params prng_seed strength {SD} noise neg_prompt_ids "
        f"controlnet_conditioning_scale {SD_TAIL} {CONTROL}", {"controlnet_conditioning_scale": 0.5},
        "Inpainting steered by ControlNets; the nets see the 4-channel latents. An inpainting ControlNet wants "
        "the image with the repainted pixels set to -1 as its control image."),
    "StableDiffusionXLControlNetImg2Img": Row(
        SDXLText, FromImage, (ControlNet,),
        f"prompt_ids image control_image params prng_seed strength {XL_IMAGE} controlnet_conditioning_scale "
        f"output_type {XL_TAIL} {CONTROL}", {"strength": 0.8, "guidance_scale": 5.0,
                                             "controlnet_conditioning_scale": 0.8},
        "SDXL image-to-image steered by SDXL ControlNets."),
    "StableDiffusionXLControlNetInpaint": Row(
        SDXLText, FromImageMask, (ControlNet,),
        f"prompt_ids image mask control_image params prng_seed strength {XL_IMAGE} controlnet_conditioning_scale "
        f"denoising_start denoising_end output_type {XL_TAIL} {CONTROL}", {"strength": 0.9999, "guidance_scale": 5.0},
        "SDXL inpainting steered by SDXL ControlNets; the nets see the 4-channel latents."),
    "StableDiffusionAdapter": Row(
        SDText, FromNoise, (T2IAdapters,),
        f"prompt_ids image params prng_seed {SD} latents neg_prompt_ids adapter_conditioning_scale {SD_TAIL}", {},
        "Text-to-image steered by T2I-Adapters (`image`: the adapter's picture, e.g. a sketch or depth map)."),
    "StableDiffusionXLAdapter": Row(
        SDXLText, FromNoise, (T2IAdapters,),
        f"prompt_ids image params prng_seed num_inference_steps guidance_scale height width latents neg_prompt_ids "
        f"adapter_conditioning_scale adapter_conditioning_factor guidance_rescale {XL_SIZES} {XL_TAIL}",
        {"guidance_scale": 5.0}, "SDXL text-to-image steered by SDXL T2I-Adapters (`image`: the adapter's picture)."),
    "StableDiffusion3": Row(
        SD3Text, FromNoise, (),
        f"prompt_ids params prng_seed num_inference_steps guidance_scale height width latents neg_prompt_ids "
        f"{SD3_TAIL}", {"num_inference_steps": 28, "guidance_scale": 7.0},
        "SD 3.x text-to-image (SD 3.5 Medium's skip-layer guidance: `skip_guidance_layers=[7, 8, 9]`)."),
    "StableDiffusion3Img2Img": Row(
        SD3Text, FromImage, (), f"prompt_ids image params prng_seed strength {SD3_IMAGE} {SD3_TAIL}",
        {"strength": 0.6, "guidance_scale": 7.0}, "SD 3.x image-to-image."),
    "StableDiffusion3Inpaint": Row(
        SD3Text, FromImageMask, (), f"prompt_ids image mask params prng_seed strength {SD3_IMAGE} {SD3_TAIL}",
        {"strength": 0.6, "guidance_scale": 7.0}, "SD 3.x inpainting (the known region pasted back every step)."),
}


def signature(row: Row) -> inspect.Signature:
    defaults = {**DEFAULTS, **row.defaults}
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    unet = row.text.denoiser.component == "unet"  # IP-Adapters and T2I-Adapters act on UNets
    tail = SCHEDULE.split() + (IP_ADAPTER.split() if unet else []) + (
        T2I_ADAPTER.split() if unet and T2IAdapters not in row.wrappers else [])
    return inspect.Signature([inspect.Parameter(name, kind) if name in REQUIRED else
                              inspect.Parameter(name, kind, default=defaults[name])
                              for name in row.arguments.split() + tail])


def make_class(name: str, row: Row) -> type:
    """The public class of a row: `__call__` and `prepare_inputs` with the row's signatures."""
    call_signature = signature(row)
    pictures = [f"{n}s" for n, _ in row.start.images]
    if row.start.images:  # a text-to-image ControlNet pipeline takes its control images apart (the old Flax API)
        pictures += [f"{wrapper.picture}s" for wrapper in row.wrappers]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    prepare_signature = inspect.Signature([inspect.Parameter("prompts", kind)] + [
        inspect.Parameter(n, kind, default=None) for n in pictures] + [
        inspect.Parameter(n, kind, default=default) for n, default in row.text.prompt_arguments.items()])

    def __call__(self, *args, **kwargs):
        return self._call(args, kwargs)

    def prepare_inputs(self, *args, **kwargs):
        values = self._bind(args, kwargs, prepare_signature)
        texts = {name: values.pop(name) for name in row.text.prompt_arguments}
        return self._prepare(values.pop("prompts"), texts, values)

    with_self = [inspect.Parameter("self", kind)]
    __call__.__signature__ = call_signature.replace(parameters=with_self + list(call_signature.parameters.values()))
    __call__.__doc__ = ("Images (B, H, W, 3) in [0, 1]; with `jit=True` under `jax.pmap` (inputs `shard`ed, params "
                        "`replicate`d): (devices, B, H, W, 3). The arguments: docs/design.md, \"How a pipeline is "
                        "built\".")
    prepare_inputs.__signature__ = prepare_signature.replace(
        parameters=with_self + list(prepare_signature.parameters.values()))
    prepare_inputs.__doc__ = Pipeline._prepare.__doc__
    namespace = {"text": row.text, "start": row.start, "wrappers": row.wrappers, "signature": call_signature,
                 "defaults": {n: p.default for n, p in call_signature.parameters.items() if n not in REQUIRED},
                 "renamed": {"image": row.wrappers[0].picture} if row.wrappers and not row.start.images else {},
                 "__call__": __call__, "prepare_inputs": prepare_inputs, "__doc__": row.doc, "__module__": __name__}
    if row.wrappers and not row.start.images:
        namespace.update(prepare_text_inputs=prepare_text_inputs, prepare_image_inputs=(
            prepare_adapter_image_inputs if T2IAdapters in row.wrappers else prepare_image_inputs))
    return type(name, (Pipeline,), namespace)


def prepare_text_inputs(self, prompts, prompts_2=None):
    """= prepare_inputs (the name in diffusers' old Flax ControlNet pipeline)."""
    return self._prepare(prompts, {"prompts_2": prompts_2}, {})


def prepare_image_inputs(self, images):
    """Control images -> float32 (B, 3, H, W) in [0, 1]."""
    return preprocess_control_images(images, self.vae_scale_factor)


def prepare_adapter_image_inputs(self, images):
    """Adapter pictures -> float32 (B, C, H, W) in [0, 1], C the adapter's input channels (grey for 1): a list of
    them for several adapters, one list of pictures each."""
    if len(self.adapters) > 1:
        if not isinstance(images, (list, tuple)) or len(images) != len(self.adapters):
            raise ValueError(f"{len(self.adapters)} T2I-Adapters: give one list of pictures per adapter")
        return [preprocess_adapter_images(pictures, self.vae_scale_factor, adapter.config.in_channels)
                for pictures, adapter in zip(images, self.adapters)]
    return preprocess_adapter_images(images, self.vae_scale_factor, self.adapters[0].config.in_channels)


CLASSES = {name: make_class(name, row) for name, row in ROWS.items()}
START_NAMES = {FromNoise: "noise", FromImage: "image", FromImageMask: "image_mask"}


def pipeline_class(family: str, start: str, controlnet: bool = False) -> type:
    """The class of a cell: family "sd", "sdxl" or "sd3", start "noise", "image" or "image_mask", with or without
    ControlNets."""
    text = {"sd": SDText, "sdxl": SDXLText, "sd3": SD3Text}[family]
    for cls in CLASSES.values():
        if cls.text is text and START_NAMES[cls.start] == start and (ControlNet in cls.wrappers) == controlnet \
                and T2IAdapters not in cls.wrappers:
            return cls
    raise ValueError(f"no pipeline for family={family!r}, start={start!r}, controlnet={controlnet}")


StableDiffusion = CLASSES["StableDiffusion"]
StableDiffusionImg2Img = CLASSES["StableDiffusionImg2Img"]
StableDiffusionInpaint = CLASSES["StableDiffusionInpaint"]
StableDiffusionXL = CLASSES["StableDiffusionXL"]
StableDiffusionXLImg2Img = CLASSES["StableDiffusionXLImg2Img"]
StableDiffusionXLInpaint = CLASSES["StableDiffusionXLInpaint"]
StableDiffusionControlNet = CLASSES["StableDiffusionControlNet"]
StableDiffusionXLControlNet = CLASSES["StableDiffusionXLControlNet"]
StableDiffusionControlNetImg2Img = CLASSES["StableDiffusionControlNetImg2Img"]
StableDiffusionControlNetInpaint = CLASSES["StableDiffusionControlNetInpaint"]
StableDiffusionXLControlNetImg2Img = CLASSES["StableDiffusionXLControlNetImg2Img"]
StableDiffusionXLControlNetInpaint = CLASSES["StableDiffusionXLControlNetInpaint"]
StableDiffusionAdapter = CLASSES["StableDiffusionAdapter"]
StableDiffusionXLAdapter = CLASSES["StableDiffusionXLAdapter"]
StableDiffusion3 = CLASSES["StableDiffusion3"]
StableDiffusion3Img2Img = CLASSES["StableDiffusion3Img2Img"]
StableDiffusion3Inpaint = CLASSES["StableDiffusion3Inpaint"]
