"""Image-to-image parity with diffusers' PyTorch StableDiffusionImg2ImgPipeline, and its input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import torch_pipeline

import jax

from sdflax import StableDiffusionImg2Img

ATOL = 1e-3  # images in [0, 1], float32
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
NEGATIVE = ["blurry", "low quality, dark"]


def run_both(tmp_path, monkeypatch, scheduler, strength, steps, **scheduler_config):
    """The same image, prompts, posterior draw and added noise on both sides."""
    import diffusers.models.autoencoders.vae as torch_vae_module
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img as torch_img2img_module
    from diffusers import StableDiffusionImg2ImgPipeline

    text2img = torch_pipeline("sd1", scheduler, **scheduler_config)
    text2img.save_pretrained(tmp_path)
    theirs = StableDiffusionImg2ImgPipeline(**text2img.components)
    pipe, params = StableDiffusionImg2Img.from_pretrained(tmp_path)

    rng = np.random.default_rng(0)
    pixels = rng.uniform(0, 1, (2, 32, 32, 3)).astype(np.float32)
    ids, image = pipe.prepare_inputs(PROMPTS, list(pixels))
    noise = rng.standard_normal((2, 4, 16, 16), dtype=np.float32)
    key = jax.random.key(3)
    # What our pipeline draws for the VAE posterior sample from this key.
    posterior = np.asarray(jax.random.normal(jax.random.split(key, 3)[0], (2, 4, 16, 16)))
    draws = {"posterior": torch.from_numpy(posterior), "noise": torch.from_numpy(noise)}
    monkeypatch.setattr(torch_vae_module, "randn_tensor", lambda *a, **k: draws["posterior"])
    monkeypatch.setattr(torch_img2img_module, "randn_tensor", lambda *a, **k: draws["noise"])
    with torch.no_grad():
        expected = theirs(PROMPTS, image=torch.from_numpy(image), strength=strength, num_inference_steps=steps,
                          guidance_scale=7.5, negative_prompt=NEGATIVE, output_type="np").images
    ours = pipe(ids, image, params, key, strength=strength, num_inference_steps=steps, noise=noise,
                neg_prompt_ids=pipe.prepare_inputs(NEGATIVE)).images
    return pipe, params, ours, expected


@pytest.mark.parametrize("scheduler, strength, config", [
    ("pndm", 0.75, {}),
    ("pndm", 0.3, {}),
    ("ddim", 1.0, {}),
    ("ddim", 0.75, {"timestep_spacing": "trailing"}),
    ("euler", 0.75, {"timestep_spacing": "leading"}),
    ("dpmpp_2m", 0.3, {"use_karras_sigmas": True}),
])
def test_img2img_matches_diffusers(tmp_path, monkeypatch, scheduler, strength, config):
    _, _, ours, expected = run_both(tmp_path, monkeypatch, scheduler, strength, 10, **config)
    assert ours.shape == expected.shape == (2, 32, 32, 3)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - 0.5).mean() > 0.01


@pytest.fixture(scope="module")
def img2img(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipe")
    torch_pipeline("sd1").save_pretrained(folder)
    return StableDiffusionImg2Img.from_pretrained(folder)


def test_strength_and_inputs_are_checked(img2img):
    pipe, params = img2img
    ids, image = pipe.prepare_inputs(PROMPTS, [np.zeros((32, 32, 3), np.uint8)] * 2)
    key = jax.random.key(0)
    for strength in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"strength must be in \(0, 1\]"):
            pipe(ids, image, params, key, strength=strength, num_inference_steps=4)
    with pytest.raises(ValueError, match="runs no denoising step"):
        pipe(ids, image, params, key, strength=0.2, num_inference_steps=4)
    with pytest.raises(ValueError, match="height=64 but the image is 32"):
        pipe(ids, image, params, key, num_inference_steps=4, height=64)
    with pytest.raises(ValueError, match=r"image has shape \(2, 32, 32, 3\)"):
        pipe(ids, np.zeros((2, 32, 32, 3), np.float32), params, key, num_inference_steps=4)
    with pytest.raises(ValueError, match="images differ in size"):
        pipe.prepare_inputs(PROMPTS, [np.zeros((32, 32, 3), np.uint8), np.zeros((34, 32, 3), np.uint8)])
    with pytest.warns(UserWarning, match="image of 33x35 resized to 32x34"):
        _, resized = pipe.prepare_inputs(["a"], np.zeros((35, 33, 3), np.uint8))
    assert resized.shape == (1, 3, 34, 32)


def test_img2img_under_pmap_equals_single_device(img2img):
    from sdflax import replicate, shard

    pipe, params = img2img
    devices = jax.local_device_count()
    pixels = np.random.default_rng(1).uniform(0, 1, (devices, 32, 32, 3)).astype(np.float32)
    prompts = [f"a painting number {i}" for i in range(devices)]
    ids, image = pipe.prepare_inputs(prompts, list(pixels))
    keys = jax.random.split(jax.random.key(0), devices)
    images = pipe(shard(ids), shard(image), replicate(params), keys, strength=0.5, num_inference_steps=4,
                  jit=True).images
    assert images.shape == (devices, 1, 32, 32, 3)
    for i in (0, devices - 1):
        single = pipe(ids[i:i + 1], image[i:i + 1], params, keys[i], strength=0.5, num_inference_steps=4).images
        np.testing.assert_allclose(images[i], single, rtol=0, atol=1e-5)


def test_img2img_sharded_equals_pmap(img2img):
    """generate_sharded (jit + NamedSharding) gives the images of jit=True (pmap)."""
    from sdflax import replicate, shard

    pipe, params = img2img
    devices = jax.local_device_count()
    pixels = np.random.default_rng(3).uniform(0, 1, (devices, 32, 32, 3)).astype(np.float32)
    ids, image = pipe.prepare_inputs([f"a painting number {i}" for i in range(devices)], list(pixels))
    keys = jax.random.split(jax.random.key(0), devices)
    pmapped = pipe(shard(ids), shard(image), replicate(params), keys, 0.5, 4, jit=True).images
    sharded = pipe.generate_sharded(ids, image, params, keys, 0.5, 4)
    assert sharded.shape == (devices, 32, 32, 3)
    np.testing.assert_allclose(sharded, pmapped.reshape(sharded.shape), rtol=0, atol=1e-5)
