"""Flux.1 (Black Forest Labs 2024): CLIP-L and T5-XXL (`flux_text.FluxText`), a rectified-flow transformer of
double- and single-stream blocks over packed latents, and its public pipeline classes. `guidance_scale` is the
guidance dev was distilled to take as an input (schnell has none and ignores it); `true_cfg_scale` above 1 with a
negative prompt runs classifier-free guidance on top, as diffusers' Flux pipelines."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..pipeline.types import Start

from ..pipeline.starts import FromImage, FromImageMask, FromNoise
from ..pipeline.table import Row
from .base import Family
from .flux_control import ControlLatents, FluxControlNets, FromImageMaskPasted
from .flux_text import FluxText

FLUX_TAIL = ("true_cfg_scale jit callback guidance return_trajectory prompt_embeds neg_prompt_embeds "
             "pooled_prompt_embeds neg_pooled_prompt_embeds")
FLUX_IMAGE = "num_inference_steps guidance_scale height width noise neg_prompt_ids"
# the call's guidance_scale is the distilled guidance the transformer takes, its true_cfg_scale the scale of
# classifier-free guidance (the Inputs field every family's guidance reads)
RENAMED = {"guidance_scale": "embedded_guidance", "true_cfg_scale": "guidance_scale"}
# the ControlNets' arguments, after the image's (diffusers' defaults)
FLUX_CONTROL = "controlnet_conditioning_scale control_mode control_guidance_start control_guidance_end"
CONTROL_DEFAULTS = {"num_inference_steps": 28, "guidance_scale": 7.0, "control_mode": None}
# (flag, Request field): the command line's flags for Flux.1 (and the other families that list them) alone
FLAGS = (("--true-cfg", "true_cfg"), ("--max-sequence-length", "max_sequence_length"))



@dataclasses.dataclass(frozen=True)
class FromImageMaskFill(FromImageMask):
    """Flux.1 Fill's inpainting: the transformer sees [latents, masked image latents, mask] on its channels at
    every step, the full-resolution mask folded into f x f channels (diffusers' `FluxFillPipeline`)."""

    @classmethod
    def build(cls, vae, denoiser) -> "FromImageMaskFill":
        f, c = vae.scale_factor, vae.latent_channels
        if denoiser.in_channels != 2 * c + f * f:
            raise ValueError(f"Flux Fill's transformer takes {4 * (2 * c + f * f)} features per token (latents, "
                             f"masked image latents and the {f}x{f}-folded mask, packed); this one takes "
                             f"{4 * denoiser.in_channels}: use FluxInpaint with an ordinary Flux checkpoint")
        return cls(vae, True)

    @staticmethod
    def condition(mask, latent_mask, masked_latents):
        b, _, height, width = mask.shape
        h, w = masked_latents.shape[2:]
        f = height // h
        folded = mask[:, 0].reshape(b, h, f, w, f).transpose(0, 2, 4, 1, 3).reshape(b, f * f, h, w)
        return jnp.concatenate([masked_latents, folded], axis=1)


@dataclasses.dataclass(frozen=True)
class FromNoiseWithReference(FromNoise):
    """Flux.1 Kontext: text-to-image whose transformer also attends to a reference image's latents (the VAE
    posterior's mean, as diffusers' `sample_mode="argmax"`), extra tokens with position ids (1, row, column);
    the image is made at the reference's size."""

    images = (("image", (3, 16)),)  # RGB, or the reference's 16-channel latents

    def begin(self, params, inputs, settings, scheduler) -> Start:
        start = super().begin(params, inputs, settings, scheduler)
        image = inputs.image
        if self.vae.is_latent_image(image):
            reference = image.astype(jnp.float32)
        else:
            shape = (image.shape[0], self.vae.latent_channels, *(side // self.vae.scale_factor for side in image.shape[2:]))
            reference = self.vae.encode(params, image, jnp.zeros(shape, jnp.float32))

        def wrap(unet_fn):
            def with_reference(x, t, context, step, **extra):
                tiled = jnp.tile(reference, (x.shape[0] // reference.shape[0], 1, 1, 1))  # the guided batch's rows
                return unet_fn(x, t, context, step, reference=tiled, **extra)
            return with_reference

        return start._replace(wrap_unet=wrap)


ROWS = {
    "Flux": Row(
        FromNoise, (),
        f"prompt_ids params prng_seed num_inference_steps guidance_scale height width latents neg_prompt_ids "
        f"{FLUX_TAIL}", {"num_inference_steps": 28, "guidance_scale": 3.5},
        "Flux.1 text-to-image (dev: `guidance_scale` is its distilled guidance; schnell: 4 steps, no guidance).",
        RENAMED),
    "FluxImg2Img": Row(
        FromImage, (), f"prompt_ids image params prng_seed strength {FLUX_IMAGE} {FLUX_TAIL}",
        {"num_inference_steps": 28, "strength": 0.6, "guidance_scale": 7.0}, "Flux.1 image-to-image.", RENAMED),
    "FluxInpaint": Row(
        FromImageMask, (), f"prompt_ids image mask params prng_seed strength {FLUX_IMAGE} {FLUX_TAIL}",
        {"num_inference_steps": 28, "strength": 0.6, "guidance_scale": 7.0},
        "Flux.1 inpainting (the known region pasted back every step).", RENAMED),
    "FluxFill": Row(
        FromImageMaskFill, (), f"prompt_ids image mask params prng_seed strength {FLUX_IMAGE} {FLUX_TAIL}",
        {"num_inference_steps": 50, "strength": 1.0, "guidance_scale": 30.0},
        "Flux.1 Fill: inpainting and outpainting with the Fill model (384 input features: the masked image and "
        "the mask beside the latents).", RENAMED),
    "FluxKontext": Row(
        FromNoiseWithReference, (), f"prompt_ids image params prng_seed {FLUX_IMAGE.replace('noise', 'latents')} "
        f"{FLUX_TAIL}", {"num_inference_steps": 28, "guidance_scale": 3.5},
        "Flux.1 Kontext: an image edited as the prompt says (`image`: the reference, at one of Kontext's trained "
        "sizes, e.g. 1024x1024, 832x1248, 1248x832).", RENAMED),
    "FluxControlNet": Row(
        FromNoise, (FluxControlNets,), f"prompt_ids control_image params prng_seed "
        f"{FLUX_IMAGE.replace('noise', 'latents')} {FLUX_CONTROL} {FLUX_TAIL}", CONTROL_DEFAULTS,
        "Flux.1 text-to-image steered by Flux ControlNets (InstantX's, XLabs', Union nets with `control_mode`).",
        RENAMED),
    "FluxControlNetImg2Img": Row(
        FromImage, (FluxControlNets,), f"prompt_ids image control_image params prng_seed strength {FLUX_IMAGE} "
        f"{FLUX_CONTROL} {FLUX_TAIL}", {**CONTROL_DEFAULTS, "strength": 0.6},
        "Flux.1 image-to-image steered by Flux ControlNets.", RENAMED),
    "FluxControlNetInpaint": Row(
        FromImageMask, (FluxControlNets,), f"prompt_ids image mask control_image params prng_seed strength "
        f"{FLUX_IMAGE} {FLUX_CONTROL} {FLUX_TAIL}", {**CONTROL_DEFAULTS, "strength": 0.6},
        "Flux.1 inpainting steered by Flux ControlNets (the known region pasted back every step).", RENAMED),
    "FluxControl": Row(
        FromNoise, (ControlLatents,), f"prompt_ids control_image params prng_seed "
        f"{FLUX_IMAGE.replace('noise', 'latents')} {FLUX_TAIL}", {"num_inference_steps": 28, "guidance_scale": 3.5},
        "Flux.1 Control (FLUX.1 Canny / Depth dev): the control picture's latents beside the latents (128 input "
        "features); the image is made at the picture's size.", RENAMED),
    "FluxControlImg2Img": Row(
        FromImage, (ControlLatents,), f"prompt_ids image control_image params prng_seed strength {FLUX_IMAGE} "
        f"{FLUX_TAIL}", {"num_inference_steps": 28, "strength": 0.6, "guidance_scale": 7.0},
        "Flux.1 Control image-to-image: the control picture's latents beside the latents of the noised image.",
        RENAMED),
    "FluxControlInpaint": Row(
        FromImageMaskPasted, (ControlLatents,), f"prompt_ids image mask control_image params prng_seed strength "
        f"{FLUX_IMAGE} {FLUX_TAIL}", {"num_inference_steps": 28, "strength": 0.6, "guidance_scale": 7.0},
        "Flux.1 Control inpainting: the control picture's latents beside the latents, the known region pasted back "
        "every step.", RENAMED),
}

FAMILY = Family("flux", "Flux.1", FluxText, ("Flux",), ROWS, module=__name__, flags=FLAGS,
                single_file="sdflax.loading.flux_single_file:FluxFiles", cli="sdflax.families.flux_cli")

Flux = FAMILY.classes["Flux"]
FluxImg2Img = FAMILY.classes["FluxImg2Img"]
FluxInpaint = FAMILY.classes["FluxInpaint"]
FluxFill = FAMILY.classes["FluxFill"]
FluxKontext = FAMILY.classes["FluxKontext"]
FluxControlNet = FAMILY.classes["FluxControlNet"]
FluxControlNetImg2Img = FAMILY.classes["FluxControlNetImg2Img"]
FluxControlNetInpaint = FAMILY.classes["FluxControlNetInpaint"]
FluxControl = FAMILY.classes["FluxControl"]
FluxControlImg2Img = FAMILY.classes["FluxControlImg2Img"]
FluxControlInpaint = FAMILY.classes["FluxControlInpaint"]
