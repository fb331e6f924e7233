"""ControlNet (Zhang et al. 2023): steer the UNet with residuals that ControlNets compute from a control image
(edges, pose, depth), as diffusers' ControlNet pipelines do; with the API of diffusers' old Flax ControlNet pipeline.

`ControlNet` is a UNet wrapper (`generate`'s `controls`): at every evaluation each net sees the latents, the
timestep, the text states and its control image, and the sum of their residuals, each times its scale while the
step is inside its guidance window, is added to the UNet's skip connections and mid block.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .conditioning import SDText, SDXLText
from .img2img import as_list, multiple_size, preprocess_images, to_pil
from .inpaint import preprocess_images_and_masks
from .latents import FromImage, FromImageMask, FromNoise
from .pipeline import Pipeline


def as_nets(value):
    """One ControlNet (or its params) or several -> a tuple."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


class ControlNet:
    """The residuals of one or several ControlNets, added to the UNet's (diffusers' MultiControlNetModel sums)."""

    @staticmethod
    def check(pipeline, inputs, leading_dims, batch):
        """The control images checked against the nets; returns their (H, W)."""
        nets, images = pipeline.controlnets, as_nets(inputs.control_image)
        if len(images) != len(nets):
            raise ValueError(f"{len(images)} control images for {len(nets)} ControlNets: give one image (batch) per "
                             "net, in the order of the nets")
        size = None
        for k, (net, image) in enumerate(zip(nets, images)):
            name = f"control image {k}" if len(nets) > 1 else "the control image"
            channels = net.config.conditioning_channels
            if image.ndim != leading_dims + 3 or image.shape[-3] != channels:
                expected = ("(devices, B, " if leading_dims == 2 else "(B, ") + f"{channels}, H, W)"
                sharded = " and shard()" if leading_dims == 2 else ""
                raise ValueError(f"{name} has shape {image.shape}; expected {expected}: make it with "
                                 f"pipeline.prepare_image_inputs(images){sharded}")
            if image.shape[:leading_dims] != batch:
                raise ValueError(f"{name} has shape {image.shape} for a batch of {batch}: give one control image "
                                 "per prompt")
            if size is not None and image.shape[-2:] != size:
                raise ValueError(f"{name} is {image.shape[-1]}x{image.shape[-2]}, the first {size[1]}x{size[0]}: "
                                 "give control images of one size")
            size = image.shape[-2:]
        for net in nets:
            if net.config.addition_embed_type != pipeline.unet.config.addition_embed_type or (
                    net.config.cross_attention_dim != pipeline.unet.config.cross_attention_dim):
                raise ValueError("a ControlNet of another model family than the pipeline's UNet (cross-attention "
                                 f"dim {net.config.cross_attention_dim} vs {pipeline.unet.config.cross_attention_dim}, "
                                 f"addition_embed_type {net.config.addition_embed_type!r} vs "
                                 f"{pipeline.unet.config.addition_embed_type!r}): use a ControlNet trained for this "
                                 "base model")
        return tuple(size)

    @staticmethod
    def size(inputs):
        return as_nets(inputs.control_image)[0].shape[-2:]

    @staticmethod
    def wrap(pipeline, params, inputs, settings, cond, start):
        nets, net_params = pipeline.controlnets, as_nets(params["controlnet"])
        images = as_nets(inputs.control_image)
        n = len(nets)
        scales = jnp.broadcast_to(jnp.asarray(inputs.controlnet_conditioning_scale, jnp.float32), (n,))
        starts = jnp.broadcast_to(jnp.asarray(inputs.control_guidance_start, jnp.float32), (n,))
        ends = jnp.broadcast_to(jnp.asarray(inputs.control_guidance_end, jnp.float32), (n,))
        num_evals = start.state.timesteps.shape[0]

        def wrapper(unet_fn):
            def controlled(x, t, context, step, **residuals):
                # guess mode: only the conditional half sees the nets; the unconditional half gets zero residuals
                half = settings.guess_mode and settings.classifier_free_guidance
                x_c, context_c = (jnp.split(x, 2)[1], jnp.split(context, 2)[1]) if half else (x, context)
                extra = {name: jnp.split(v, 2)[1] if half else v for name, v in cond.unet_kwargs.items()}
                down, mid = None, None
                for k, (net, p, image) in enumerate(zip(nets, net_params, images)):
                    # diffusers' guidance window: the net acts at evaluation i unless i/n < start or (i+1)/n > end
                    outside = (step / num_evals < starts[k]) | ((step + 1) / num_evals > ends[k])
                    scale = scales[k] * (1.0 - outside.astype(jnp.float32))
                    image = jnp.tile(image, (x_c.shape[0] // image.shape[0], 1, 1, 1))  # [uncond; cond] rows
                    d, m = net.apply(p, x_c, t, context_c, image.astype(net.dtype), scale, guess_mode=half, **extra)
                    down = d if down is None else tuple(a + b for a, b in zip(down, d))
                    mid = m if mid is None else mid + m
                if half:
                    down = tuple(jnp.concatenate([jnp.zeros_like(d), d]) for d in down)
                    mid = jnp.concatenate([jnp.zeros_like(mid), mid])
                return unet_fn(x, t, context, step, down_block_additional_residuals=down,
                               mid_block_additional_residual=mid, **residuals)

            return controlled

        return wrapper


def preprocess_control_images(images, scale_factor: int) -> np.ndarray:
    """PIL images or arrays (H, W, 3) -> float32 (B, 3, H, W) in [0, 1], as diffusers' control image processor
    (RGB, sides cut down to a multiple of `scale_factor` with Lanczos, not normalised)."""
    from PIL import Image

    out = []
    for image in as_list(images):
        image = to_pil(image, "control image").convert("RGB")
        size = multiple_size(image.size, scale_factor, "control image")
        if size != image.size:
            image = image.resize(size, Image.LANCZOS)
        out.append(np.asarray(image, np.float32) / 255.0)
    if len({a.shape for a in out}) > 1:
        raise ValueError(f"control images differ in size: {sorted({a.shape[:2] for a in out})}; give one size")
    return np.stack(out).transpose(0, 3, 1, 2)


def prepare_text_inputs(pipeline, prompts):
    """= prepare_inputs (the old Flax API's name)."""
    return pipeline.prepare_inputs(prompts)


def prepare_image_inputs(pipeline, images):
    """Control images -> float32 (B, 3, H, W) in [0, 1]."""
    return preprocess_control_images(images, pipeline.vae_scale_factor)


class StableDiffusionControlNet(Pipeline):
    """Text-to-image steered by one or several ControlNets (SD 1.x / 2.x), as diffusers' Flax ControlNet pipeline:

        controlnet, controlnet_params = ControlNetModel.from_pretrained(cn_id)
        pipe, params = StableDiffusionControlNet.from_pretrained(sd_id, controlnet=controlnet)
        params["controlnet"] = controlnet_params          # several nets: lists of nets and of params
        ids = pipe.prepare_text_inputs(prompts)
        image = pipe.prepare_image_inputs(images)         # float (B, 3, H, W) in [0, 1]
        images = pipe(ids, image, params, rng, num_inference_steps=50).images

    Height and width come from the control image.
    """

    conditioning, start, controls = SDText, FromNoise, (ControlNet,)
    renamed = {"image": "control_image"}  # the old Flax API's name
    prepare_text_inputs, prepare_image_inputs = prepare_text_inputs, prepare_image_inputs

    def __call__(self, prompt_ids, image, params, prng_seed, num_inference_steps=50, guidance_scale=7.5,
                 latents=None, neg_prompt_ids=None, controlnet_conditioning_scale=1.0, jit=False, callback=None,
                 guidance_rescale=0.0, guidance=None, return_trajectory=False, prompt_embeds=None,
                 neg_prompt_embeds=None, control_guidance_start=0.0, control_guidance_end=1.0, guess_mode=False,
                 height=None, width=None):
        """Images (B, H, W, 3) in [0, 1]; (devices, B, H, W, 3) with `jit=True` (ids and control images
        `shard`ed, params `replicate`d). `image`: the control image (B, 3, H, W) in [0, 1], or a list of them,
        one per net. `controlnet_conditioning_scale`, `control_guidance_start` and `control_guidance_end` (a
        value, or one per net: the fraction of the steps in which each net acts) are traced; `guess_mode`
        (the nets see only the conditional batch, their residuals scaled up with depth) is static. `height` and
        `width`, if given, must be the control image's. The rest as `StableDiffusion.__call__`."""
        return self._run(locals())


class StableDiffusionXLControlNet(Pipeline):
    """SDXL text-to-image steered by SDXL ControlNets (diffusers' StableDiffusionXLControlNetPipeline); the API of
    `StableDiffusionControlNet` with StableDiffusionXL's arguments (size conditioning, (B, 2, 77) ids)."""

    conditioning, start, controls = SDXLText, FromNoise, (ControlNet,)
    renamed = {"image": "control_image"}
    prepare_text_inputs, prepare_image_inputs = prepare_text_inputs, prepare_image_inputs

    def __call__(self, prompt_ids, image, params, prng_seed, num_inference_steps=50, guidance_scale=5.0,
                 latents=None, neg_prompt_ids=None, controlnet_conditioning_scale=1.0, jit=False, callback=None,
                 guidance_rescale=0.0, guidance=None, return_trajectory=False, original_size=None,
                 crops_coords_top_left=(0, 0), target_size=None, prompt_embeds=None, neg_prompt_embeds=None,
                 pooled_prompt_embeds=None, neg_pooled_prompt_embeds=None, control_guidance_start=0.0,
                 control_guidance_end=1.0, guess_mode=False, height=None, width=None):
        """As `StableDiffusionControlNet.__call__`, with `StableDiffusionXL.__call__`'s SDXL arguments."""
        return self._run(locals())


class StableDiffusionControlNetImg2Img(Pipeline):
    """Image-to-image steered by ControlNets (diffusers' StableDiffusionControlNetImg2ImgPipeline):
    `prepare_inputs(prompts, images, control_images) -> (prompt_ids, image, control_image)`."""

    conditioning, start, controls = SDText, FromImage, (ControlNet,)

    def prepare_inputs(self, prompts, images=None, control_images=None):
        prompt_ids = super().prepare_inputs(prompts)
        if images is None and control_images is None:
            return prompt_ids
        return (prompt_ids, preprocess_images(images, self.vae_scale_factor),
                preprocess_control_images(control_images, self.vae_scale_factor))

    def __call__(self, prompt_ids, image, control_image, params, prng_seed, strength=0.8, num_inference_steps=50,
                 height=None, width=None, guidance_scale=7.5, noise=None, neg_prompt_ids=None,
                 controlnet_conditioning_scale=0.8, jit=False, callback=None, guidance_rescale=0.0, guidance=None,
                 return_trajectory=False, prompt_embeds=None, neg_prompt_embeds=None, control_guidance_start=0.0,
                 control_guidance_end=1.0, guess_mode=False):
        """`StableDiffusionImg2Img.__call__` with a control image (B, 3, H, W) in [0, 1] of the image's size (or a
        list, one per net) and the ControlNet arguments of `StableDiffusionControlNet.__call__`."""
        return self._run(locals())


class StableDiffusionControlNetInpaint(Pipeline):
    """Inpainting steered by ControlNets (diffusers' StableDiffusionControlNetInpaintPipeline), with inpainting
    UNets or ordinary ones as `StableDiffusionInpaint`; the nets see the 4-channel latents. `prepare_inputs(prompts,
    images, masks, control_images) -> (prompt_ids, image, mask, control_image)`. An inpainting ControlNet
    (control_v11p_sd15_inpaint) wants the image with the repainted pixels set to -1 as its control image: pass
    that (B, 3, H, W) float array directly."""

    conditioning, start, controls = SDText, FromImageMask, (ControlNet,)

    def prepare_inputs(self, prompts, images=None, masks=None, control_images=None):
        prompt_ids = super().prepare_inputs(prompts)
        if images is None and masks is None and control_images is None:
            return prompt_ids
        return (prompt_ids, *preprocess_images_and_masks(images, masks, self.vae_scale_factor),
                preprocess_control_images(control_images, self.vae_scale_factor))

    def __call__(self, prompt_ids, image, mask, control_image, params, prng_seed, strength=1.0,
                 num_inference_steps=50, height=None, width=None, guidance_scale=7.5, noise=None, neg_prompt_ids=None,
                 controlnet_conditioning_scale=0.5, jit=False, callback=None, guidance_rescale=0.0, guidance=None,
                 return_trajectory=False, prompt_embeds=None, neg_prompt_embeds=None, control_guidance_start=0.0,
                 control_guidance_end=1.0, guess_mode=False):
        """`StableDiffusionInpaint.__call__` with a control image (B, 3, H, W) in [0, 1] of the image's size (or a
        list, one per net) and the ControlNet arguments of `StableDiffusionControlNet.__call__` (the scale defaults
        to 0.5, as diffusers')."""
        return self._run(locals())
