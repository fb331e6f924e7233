"""Perturbed-attention guidance as a hook: images equal diffusers' StableDiffusionPAGPipeline /
StableDiffusionXLPAGPipeline with the same pag_scale and pag_applied_layers; a new pag_scale does not recompile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import torch_pipeline, torch_xl_pipeline

import jax

from sdflax import StableDiffusion, StableDiffusionXL
from sdflax.hooks.pag import perturbed_attention_guidance

ATOL = 1e-3  # images in [0, 1], float32
STEPS = 3
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
LAYERS = {"sd1": ["mid", "down_blocks.0"], "sdxl": ["mid", "up_blocks.0.attentions.1"]}


@pytest.fixture(scope="module", params=["sd1", "sdxl"])
def pipes(request, tmp_path_factory):
    from diffusers import StableDiffusionPAGPipeline, StableDiffusionXLPAGPipeline

    folder = tmp_path_factory.mktemp(request.param)
    sd1 = request.param == "sd1"
    plain = torch_pipeline("sd1") if sd1 else torch_xl_pipeline()
    plain.save_pretrained(folder)
    theirs = (StableDiffusionPAGPipeline if sd1 else StableDiffusionXLPAGPipeline).from_pipe(
        plain, pag_applied_layers=LAYERS[request.param])
    ours, params = (StableDiffusion if sd1 else StableDiffusionXL).from_pretrained(folder)
    size = ours.unet.config.sample_size
    latents = np.random.default_rng(0).standard_normal((2, 4, size, size), dtype=np.float32)
    return request.param, plain, theirs, ours, params, latents


@pytest.mark.parametrize("guidance_scale", [6.0, 1.0])  # with classifier-free guidance, and PAG alone
def test_pag_images_match_diffusers(pipes, guidance_scale):
    arch, plain, theirs, ours, params, latents = pipes
    with torch.no_grad():
        expected = theirs(PROMPTS, num_inference_steps=STEPS, guidance_scale=guidance_scale, pag_scale=3.0,
                          latents=torch.from_numpy(latents), output_type="np").images
        unguided = plain(PROMPTS, num_inference_steps=STEPS, guidance_scale=guidance_scale,
                         latents=torch.from_numpy(latents), output_type="np").images
    hooked = ours.with_hooks(perturbed_attention_guidance(3.0, LAYERS[arch]))
    ids = ours.prepare_inputs(PROMPTS)
    images = hooked(ids, params, jax.random.key(0), STEPS, guidance_scale=guidance_scale, latents=latents).images
    np.testing.assert_allclose(images, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - unguided).max() > 0.02  # PAG changes the oracle's image

    if arch == "sd1" and guidance_scale > 1:  # a traced pag_scale: a new value, the same program
        compiled = ours._jitted._cache_size()
        other = ours.with_hooks(perturbed_attention_guidance(1.5, LAYERS[arch]))(
            ids, params, jax.random.key(0), STEPS, guidance_scale=guidance_scale, latents=latents).images
        assert ours._jitted._cache_size() == compiled
        assert np.abs(other - images).max() > 0.01
