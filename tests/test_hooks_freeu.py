"""FreeU as a hook: images equal diffusers' with `pipe.enable_freeu(...)`, SD and SDXL."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import torch_pipeline, torch_xl_pipeline

import jax

from sdflax import StableDiffusion, StableDiffusionXL
from sdflax.hooks.freeu import freeu

ATOL = 1e-3  # images in [0, 1], float32
STEPS = 3
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
FACTORS = dict(s1=0.9, s2=0.2, b1=1.2, b2=1.4)  # diffusers' SD 1.x recommendation


@pytest.fixture(scope="module", params=["sd1", "sdxl"])
def pipes(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    theirs = torch_pipeline("sd1") if request.param == "sd1" else torch_xl_pipeline()
    theirs.save_pretrained(folder)
    ours, params = (StableDiffusion if request.param == "sd1" else StableDiffusionXL).from_pretrained(folder)
    return theirs, ours, params


def test_freeu_images_match_diffusers(pipes):
    theirs, ours, params = pipes
    size = ours.unet.config.sample_size
    latents = np.random.default_rng(0).standard_normal((2, 4, size, size), dtype=np.float32)
    with torch.no_grad():
        plain = theirs(PROMPTS, num_inference_steps=STEPS, latents=torch.from_numpy(latents), output_type="np").images
        theirs.enable_freeu(**FACTORS)
        expected = theirs(PROMPTS, num_inference_steps=STEPS, latents=torch.from_numpy(latents),
                          output_type="np").images
        theirs.disable_freeu()
    hooked = ours.with_hooks(freeu(**FACTORS))
    images = hooked(ours.prepare_inputs(PROMPTS), params, jax.random.key(0), STEPS, latents=latents).images
    np.testing.assert_allclose(images, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - plain).max() > 0.05  # FreeU changes the oracle's image
