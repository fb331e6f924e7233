"""End-to-end parity of the StableDiffusion pipeline with diffusers' PyTorch StableDiffusionPipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import REPO, torch_pipeline

import jax
import jax.numpy as jnp

from sdflax import StableDiffusion

ATOL = 1e-3  # images in [0, 1], float32
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
NEGATIVE = ["blurry", "low quality, dark"]


def run_both(tmp_path, arch, scheduler, steps, guidance, negative=None, **scheduler_config):
    theirs = torch_pipeline(arch, scheduler, **scheduler_config)
    theirs.save_pretrained(tmp_path / "pipe")
    pipe, params = StableDiffusion.from_pretrained(tmp_path / "pipe")
    size = pipe.unet.config.sample_size
    latents = np.random.default_rng(0).standard_normal((2, 4, size, size), dtype=np.float32)
    with torch.no_grad():
        expected = theirs(PROMPTS, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps,
                          latents=torch.from_numpy(latents), output_type="np").images
    ids = pipe.prepare_inputs(PROMPTS)
    neg = pipe.prepare_inputs(negative) if negative else None
    ours = pipe(ids, params, jax.random.key(0), steps, guidance_scale=guidance, latents=latents,
                neg_prompt_ids=neg).images
    return pipe, params, ours, expected


@pytest.mark.parametrize("arch, scheduler, config", [
    ("sd1", "pndm", {}),
    ("sd1", "ddim", {}),
    ("sd1", "ddim", {"timestep_spacing": "trailing"}),
    ("sd2", "ddim", {"prediction_type": "v_prediction"}),
    ("sd2", "pndm", {"prediction_type": "v_prediction"}),
])
def test_images_match_diffusers(tmp_path, arch, scheduler, config):
    pipe, _, ours, expected = run_both(tmp_path, arch, scheduler, 4, 7.5, NEGATIVE, **config)
    assert type(pipe.scheduler).__name__.lower().startswith(scheduler)
    assert ours.shape == expected.shape == (2, 32, 32, 3)
    assert ours.dtype == np.float32 and 0 <= ours.min() and ours.max() <= 1
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - 0.5).mean() > 0.01  # not a constant image: the comparison means something


def test_empty_negative_prompt_and_other_guidance(tmp_path):
    _, _, ours, expected = run_both(tmp_path, "sd1", "pndm", 3, 2.0)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
