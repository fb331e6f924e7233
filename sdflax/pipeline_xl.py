"""SDXL (Podell et al. 2023): text-to-image, image-to-image (and the refiner) and inpainting, `conditioning.SDXLText`
with each start on the one generate, as diffusers' `StableDiffusionXLPipeline`, `StableDiffusionXLImg2ImgPipeline`
and `StableDiffusionXLInpaintPipeline`."""

from __future__ import annotations

from .conditioning import SDXLText
from .img2img import StableDiffusionImg2Img
from .inpaint import StableDiffusionInpaint
from .latents import FromImage, FromImageMask, FromNoise
from .pipeline import Pipeline


class StableDiffusionXL(Pipeline):
    """`from_pretrained` as StableDiffusion; params `{"text_encoder", "text_encoder_2", "unet", "vae"}`.

    `prepare_inputs(prompts, prompts_2=None)` gives (B, 2, 77) ids (one row per tokenizer; `prompts_2`, diffusers'
    prompt_2, for the second; negatives likewise). `__call__` and `_generate` take the arguments of diffusers' Flax
    SDXL pipeline (`guidance_scale` before `height`, `width`), plus `guidance_rescale` and the size conditioning
    `original_size`, `crops_coords_top_left`, `target_size` ((h, w) pairs, default (height, width), (0, 0),
    (height, width)), all traced: changing them never recompiles. Without `neg_prompt_ids` the unconditional
    embeddings are zeros if the checkpoint says `force_zeros_for_empty_prompt`, else those of the empty prompt.
    """

    conditioning, start = SDXLText, FromNoise

    def __call__(self, prompt_ids, params, prng_seed, num_inference_steps=50, guidance_scale=5.0, height=None,
                 width=None, latents=None, neg_prompt_ids=None, guidance_rescale=0.0, original_size=None,
                 crops_coords_top_left=(0, 0), target_size=None, jit=False, callback=None, guidance=None,
                 return_trajectory=False, prompt_embeds=None, neg_prompt_embeds=None, pooled_prompt_embeds=None,
                 neg_pooled_prompt_embeds=None, denoising_end=None, output_type="np"):
        """Images (B, H, W, 3); with `jit=True` under `jax.pmap`, inputs sharded (`sdflax.shard`) and params
        replicated (`sdflax.replicate`): (devices, B, H, W, 3). `prompt_embeds` (B, 77, D1 + D2) and
        `pooled_prompt_embeds` (B, P) replace the ids' encoding (`pipeline.encode_prompt(params, ids)` gives
        both); the negative ones likewise. `denoising_end=0.8` (static) stops where diffusers does, after 80% of
        the schedule, and `output_type="latent"` returns the latents (B, 4, h, w) undecoded: a refiner
        (`StableDiffusionXLImg2Img`, `denoising_start=0.8`) finishes them. The rest as `StableDiffusion.__call__`."""
        return self._run(locals())


class StableDiffusionXLImg2Img(StableDiffusionImg2Img):
    """SDXL image-to-image, and the SDXL refiner; `from_pretrained` loads a base or a refiner checkpoint (a refiner
    has the second text encoder alone and `requires_aesthetics_score`). `prepare_inputs(prompts, images,
    prompts_2=None) -> (prompt_ids, images)`."""

    conditioning, start = SDXLText, FromImage

    def __call__(self, prompt_ids, image, params, prng_seed, strength=0.3, num_inference_steps=50,
                 guidance_scale=5.0, height=None, width=None, noise=None, neg_prompt_ids=None, guidance_rescale=0.0,
                 original_size=None, crops_coords_top_left=(0, 0), target_size=None, aesthetic_score=6.0,
                 negative_aesthetic_score=2.5, denoising_start=None, denoising_end=None, output_type="np", jit=False,
                 callback=None, guidance=None, return_trajectory=False, prompt_embeds=None, neg_prompt_embeds=None,
                 pooled_prompt_embeds=None, neg_pooled_prompt_embeds=None):
        """Images (B, H, W, 3) in [0, 1] from `image`: (B, 3, H, W) in [-1, 1], or (B, 4, h, w) latents (a base
        run's `output_type="latent"`); (devices, B, H, W, 3) with `jit=True`. As diffusers' SDXL img2img:
        `strength` (static) picks how much of the schedule runs; `denoising_start` (static, in (0, 1)) instead
        starts where a base run with that `denoising_end` stopped, and adds no noise. `aesthetic_score` and
        `negative_aesthetic_score` (traced) condition a refiner (`requires_aesthetics_score`), in place of the
        target size. The rest as `StableDiffusionImg2Img.__call__` and `StableDiffusionXL.__call__`."""
        return self._run(locals())


class StableDiffusionXLInpaint(StableDiffusionInpaint):
    """SDXL inpainting, with 9-channel SDXL inpainting UNets or ordinary ones (the kept region pasted back);
    `prepare_inputs(prompts, images, masks, prompts_2=None) -> (prompt_ids, images, masks)`."""

    conditioning, start = SDXLText, FromImageMask

    def __call__(self, prompt_ids, image, mask, params, prng_seed, strength=0.9999, num_inference_steps=50,
                 guidance_scale=7.5, height=None, width=None, noise=None, neg_prompt_ids=None, guidance_rescale=0.0,
                 original_size=None, crops_coords_top_left=(0, 0), target_size=None, aesthetic_score=6.0,
                 negative_aesthetic_score=2.5, denoising_start=None, denoising_end=None, output_type="np", jit=False,
                 callback=None, guidance=None, return_trajectory=False, prompt_embeds=None, neg_prompt_embeds=None,
                 pooled_prompt_embeds=None, neg_pooled_prompt_embeds=None):
        """Images (B, H, W, 3) in [0, 1] from `image` (B, 3, H, W) in [-1, 1] and `mask` (B, 1, H, W) (>= 0.5 is
        repainted), or (devices, B, H, W, 3) with `jit=True`. diffusers' defaults (strength 0.9999, guidance
        7.5); the arguments as `StableDiffusionXLImg2Img.__call__` and `StableDiffusionInpaint.__call__`."""
        return self._run(locals())
