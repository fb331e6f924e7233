"""Hooks in the other pipelines: perturbed-attention guidance in img2img and inpainting equals diffusers'
StableDiffusionPAGImg2ImgPipeline / StableDiffusionPAGInpaintPipeline (same image, posterior draws and noise);
DeepCache and attention maps on SDXL."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import torch_pipeline, torch_xl_pipeline
from test_inpaint import SIZE, inputs

import jax

from sdflax import StableDiffusionImg2Img, StableDiffusionInpaint, StableDiffusionXL, random_draws
from sdflax.hooks import cross_attention_maps, deep_cache, perturbed_attention_guidance

ATOL = 1e-3  # images in [0, 1], float32
STEPS = 4
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
LAYERS = ["mid", "up_blocks.1"]


def without_pag(pipe):
    """The pipeline with PAG at scale 0, classifier-free guidance alone: the PAG program (a traced scale), so the
    unguided image costs no compile of its own."""
    return pipe.with_hooks(perturbed_attention_guidance(0.0, LAYERS))


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    """A diffusers SD 1.x pipeline with DDIM and the folder it is saved in, for the img2img and inpaint classes."""
    folder = tmp_path_factory.mktemp("sd1")
    plain = torch_pipeline("sd1", "ddim")
    plain.save_pretrained(folder)
    return plain, folder


def test_pag_img2img_matches_diffusers(sd1, monkeypatch):
    import diffusers.models.autoencoders.vae as torch_vae_module
    import diffusers.pipelines.pag.pipeline_pag_sd_img2img as torch_module
    from diffusers import StableDiffusionPAGImg2ImgPipeline

    plain, folder = sd1
    pipe, params = StableDiffusionImg2Img.from_pretrained(folder)
    theirs = StableDiffusionPAGImg2ImgPipeline(**plain.components, pag_applied_layers=LAYERS)
    pixels, _ = inputs()
    ids, image = pipe.prepare_inputs(PROMPTS, list(pixels))
    key = jax.random.key(3)
    (posterior, noise), _ = random_draws(key, (2, 4, SIZE // 2, SIZE // 2), 2)  # what our pipeline draws
    monkeypatch.setattr(torch_vae_module, "randn_tensor", lambda *a, **k: torch.from_numpy(np.array(posterior)))
    monkeypatch.setattr(torch_module, "randn_tensor", lambda *a, **k: torch.from_numpy(np.array(noise)))
    with torch.no_grad():
        expected = theirs(PROMPTS, image=torch.from_numpy(image), strength=0.75, num_inference_steps=STEPS,
                          guidance_scale=7.5, pag_scale=2.5, output_type="np").images
    hooked = pipe.with_hooks(perturbed_attention_guidance(2.5, LAYERS))
    ours = hooked(ids, image, params, key, strength=0.75, num_inference_steps=STEPS).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    unguided = without_pag(pipe)(ids, image, params, key, strength=0.75, num_inference_steps=STEPS).images
    assert np.abs(ours - unguided).max() > 0.01


def test_pag_inpaint_matches_diffusers(sd1, monkeypatch):
    import diffusers.models.autoencoders.vae as torch_vae_module
    import diffusers.pipelines.pag.pipeline_pag_sd_inpaint as torch_module
    from diffusers import StableDiffusionPAGInpaintPipeline

    plain, folder = sd1
    pipe, params = StableDiffusionInpaint.from_pretrained(folder)
    theirs = StableDiffusionPAGInpaintPipeline(**plain.components, pag_applied_layers=LAYERS)
    pixels, masks = inputs()
    ids, image, mask = pipe.prepare_inputs(PROMPTS, list(pixels), list(masks))
    key = jax.random.key(3)
    (image_eps, masked_eps, noise), _ = random_draws(key, (2, 4, SIZE // 2, SIZE // 2), 3)
    posterior = [torch.from_numpy(np.array(eps)) for eps in (image_eps, masked_eps)]
    monkeypatch.setattr(torch_vae_module, "randn_tensor", lambda *a, **k: posterior.pop(0))
    monkeypatch.setattr(torch_module, "randn_tensor", lambda *a, **k: torch.from_numpy(np.array(noise)))
    with torch.no_grad():
        expected = theirs(PROMPTS, image=torch.from_numpy(image), mask_image=torch.from_numpy(masks[:, None]),
                          strength=0.75, num_inference_steps=STEPS, guidance_scale=7.5, pag_scale=2.5,
                          height=SIZE, width=SIZE, output_type="np").images
    hooked = pipe.with_hooks(perturbed_attention_guidance(2.5, LAYERS))
    ours = hooked(ids, image, mask, params, key, strength=0.75, num_inference_steps=STEPS).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    unguided = without_pag(pipe)(ids, image, mask, params, key, strength=0.75, num_inference_steps=STEPS).images
    assert np.abs(ours - unguided).max() > 0.01


def test_sdxl_deep_cache_and_maps(tmp_path):
    """SDXL: DeepCache at interval 1 and the attention maps leave the images as they are; the maps are
    probabilities over the tokens."""
    torch_xl_pipeline().save_pretrained(tmp_path)
    pipe, params = StableDiffusionXL.from_pretrained(tmp_path)
    ids = pipe.prepare_inputs(PROMPTS)
    latents = np.random.default_rng(0).standard_normal((2, 4, 16, 16), dtype=np.float32)
    run = lambda p: p(ids, params, jax.random.key(0), STEPS, latents=latents)  # noqa: E731
    plain = run(pipe).images
    np.testing.assert_allclose(run(pipe.with_hooks(deep_cache(1))).images, plain, rtol=0, atol=1e-5)
    out = run(pipe.with_hooks(cross_attention_maps()))
    np.testing.assert_allclose(out.images, plain, rtol=0, atol=1e-5)
    maps = out.trajectory.hooks["cross_attention_maps"]
    assert maps.shape == (STEPS, 2, 16, 16, 77)
    np.testing.assert_allclose(maps.sum(-1), 1, rtol=0, atol=1e-5)
