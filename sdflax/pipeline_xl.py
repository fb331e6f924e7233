"""StableDiffusionXL: SDXL text-to-image (Podell et al. 2023), `conditioning.SDXLText` on the one generate."""

from __future__ import annotations

from .conditioning import SDXLText
from .latents import FromNoise
from .pipeline import Pipeline


class StableDiffusionXL(Pipeline):
    """`from_pretrained` as StableDiffusion; params `{"text_encoder", "text_encoder_2", "unet", "vae"}`.

    `prepare_inputs(prompts)` gives (B, 2, 77) ids (one row per tokenizer). `__call__` and `_generate` take the
    arguments of diffusers' Flax SDXL pipeline (`guidance_scale` before `height`, `width`), plus
    `guidance_rescale` and the size conditioning `original_size`, `crops_coords_top_left`, `target_size`
    ((h, w) pairs, default (height, width), (0, 0), (height, width)), all traced: changing them never recompiles.
    Without `neg_prompt_ids` the unconditional embeddings are zeros if the checkpoint says
    `force_zeros_for_empty_prompt`, else those of the empty prompt.
    """

    conditioning, start = SDXLText, FromNoise

    def __call__(self, prompt_ids, params, prng_seed, num_inference_steps=50, guidance_scale=5.0, height=None,
                 width=None, latents=None, neg_prompt_ids=None, guidance_rescale=0.0, original_size=None,
                 crops_coords_top_left=(0, 0), target_size=None, jit=False, callback=None, guidance=None,
                 return_trajectory=False, prompt_embeds=None, neg_prompt_embeds=None, pooled_prompt_embeds=None,
                 neg_pooled_prompt_embeds=None):
        """Images (B, H, W, 3); with `jit=True` under `jax.pmap`, inputs sharded (`sdflax.shard`) and params
        replicated (`sdflax.replicate`): (devices, B, H, W, 3). `prompt_embeds` (B, 77, D1 + D2) and
        `pooled_prompt_embeds` (B, P) replace the ids' encoding (`pipeline.encode_prompt(params, ids)` gives
        both); the negative ones likewise. The rest as `StableDiffusion.__call__`."""
        return self._run(locals())
