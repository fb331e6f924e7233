"""Image-to-image parity with diffusers' PyTorch StableDiffusionImg2ImgPipeline, and its input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import torch_pipeline
from test_guiders import both_guided

import jax

from sdflax import StableDiffusionImg2Img

ATOL = 1e-3  # images in [0, 1], float32
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
NEGATIVE = ["blurry", "low quality, dark"]


STEPS = 10  # the parity tests'; the pmap tests take them too, to reuse a parity test's program


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(scheduler, **scheduler_config)` -> (diffusers img2img pipeline, ours, params), each saved and
    loaded once per module: the tests on one checkpoint share its pipeline and so its compiled programs."""
    from diffusers import StableDiffusionImg2ImgPipeline

    loaded = {}

    def load(scheduler, **scheduler_config):
        name = (scheduler, *sorted(scheduler_config.items()))
        if name not in loaded:
            folder = tmp_path_factory.mktemp(scheduler)
            text2img = torch_pipeline("sd1", scheduler, **scheduler_config)
            text2img.save_pretrained(folder)
            loaded[name] = (StableDiffusionImg2ImgPipeline(**text2img.components),
                            *StableDiffusionImg2Img.from_pretrained(folder))
        return loaded[name]

    return load


def run_both(checkpoint, monkeypatch, scheduler, strength, steps, schedule=None, guider=None, **scheduler_config):
    """The same image, prompts, posterior draw and added noise on both sides; `schedule`: `timesteps=` or `sigmas=`
    for both calls instead of `steps`; `guider`: a guider's class name and arguments, diffusers' stepping
    diffusers' loop (test_guiders.guided_by) and sdflax's."""
    import diffusers.models.autoencoders.vae as torch_vae_module
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img as torch_img2img_module

    theirs, pipe, params = checkpoint(scheduler, **scheduler_config)

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
    guided, their_scale, pipe = both_guided(theirs, pipe, guider, steps, strength)
    with torch.no_grad(), guided:
        expected = theirs(PROMPTS, image=torch.from_numpy(image), strength=strength,
                          guidance_scale=their_scale, negative_prompt=NEGATIVE, output_type="np",
                          **(schedule or {"num_inference_steps": steps})).images
    ours = pipe(ids, image, params, key, strength=strength, noise=noise, neg_prompt_ids=pipe.prepare_inputs(NEGATIVE),
                **(schedule or {"num_inference_steps": steps})).images
    return pipe, params, ours, expected


@pytest.mark.parametrize("scheduler, strength, config", [
    ("pndm", 0.75, {}),
    ("pndm", 0.3, {}),
    ("ddim", 1.0, {}),
    ("ddim", 0.75, {"timestep_spacing": "trailing"}),
    ("euler", 0.75, {"timestep_spacing": "leading"}),
    ("dpmpp_2m", 0.3, {"use_karras_sigmas": True}),
])
def test_img2img_matches_diffusers(checkpoint, monkeypatch, scheduler, strength, config):
    _, _, ours, expected = run_both(checkpoint, monkeypatch, scheduler, strength, STEPS, **config)
    assert ours.shape == expected.shape == (2, 32, 32, 3)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - 0.5).mean() > 0.01


def test_a_custom_schedule_is_cut_by_strength_as_diffusers_cuts_it(checkpoint, monkeypatch):
    """`timesteps=` with img2img: strength skips the first steps of the given list (diffusers' `get_timesteps` on
    its length)."""
    from sdflax.schedulers import AYS_SCHEDULES

    schedule = {"timesteps": list(AYS_SCHEDULES["StableDiffusionTimesteps"])}
    _, _, ours, expected = run_both(checkpoint, monkeypatch, "euler", 0.6, None, schedule,
                                    timestep_spacing="leading")
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    _, _, _, spaced = run_both(checkpoint, monkeypatch, "euler", 0.6, 10, timestep_spacing="leading")
    assert np.abs(spaced - expected).max() > 1e-2  # the list, not the spacing, made the image


def test_a_guider_counts_the_steps_left_after_strength(checkpoint, monkeypatch):
    """With strength 0.6 of 10 steps diffusers' loop runs 6, and the guidance interval is a fraction of those."""
    guider = ("AdaptiveProjectedGuidance", {"guidance_scale": 10.0, "eta": 0.0, "start": 0.2, "stop": 0.7,
                                            "adaptive_projected_guidance_momentum": -0.5})
    _, _, ours, expected = run_both(checkpoint, monkeypatch, "ddim", 0.6, STEPS, guider=guider)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    _, _, _, whole = run_both(checkpoint, monkeypatch, "ddim", 0.6, STEPS, guider=(guider[0], {
        **guider[1], "start": 0.0, "stop": 1.0}))
    assert np.abs(whole - expected).max() > 1e-2  # the interval made the image


@pytest.fixture(scope="module")
def img2img(checkpoint):
    """(pipeline, params): the parity tests' PNDM checkpoint."""
    return checkpoint("pndm")[1:]


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


@pytest.fixture(scope="module")
def pmapped(img2img):
    """A jit=True (pmap) call on two images per device, one key per device, and its inputs. Noise and negative
    prompts given and the parity test's strength 0.3: a device's program is that parity test's, on two rows."""
    from sdflax import replicate, shard

    pipe, params = img2img
    devices = jax.local_device_count()
    rng = np.random.default_rng(1)
    pixels = rng.uniform(0, 1, (2 * devices, 32, 32, 3)).astype(np.float32)
    ids, image = pipe.prepare_inputs([f"a painting number {i}" for i in range(2 * devices)], list(pixels))
    inputs = dict(ids=ids, image=image, neg_prompt_ids=pipe.prepare_inputs(NEGATIVE * devices),
                  noise=rng.standard_normal((2 * devices, 4, 16, 16), dtype=np.float32))
    keys = jax.random.split(jax.random.key(0), devices)
    images = pipe(shard(ids), shard(image), replicate(params), keys, 0.3, STEPS, jit=True,
                  noise=shard(inputs["noise"]), neg_prompt_ids=shard(inputs["neg_prompt_ids"])).images
    return inputs, keys, images


def test_img2img_under_pmap_equals_single_device(img2img, pmapped):
    pipe, params = img2img
    inputs, keys, images = pmapped
    devices = jax.local_device_count()
    assert images.shape == (devices, 2, 32, 32, 3)
    for i in (0, devices - 1):
        rows = slice(2 * i, 2 * i + 2)
        single = pipe(inputs["ids"][rows], inputs["image"][rows], params, keys[i], strength=0.3,
                      num_inference_steps=STEPS, noise=inputs["noise"][rows],
                      neg_prompt_ids=inputs["neg_prompt_ids"][rows]).images
        np.testing.assert_allclose(images[i], single, rtol=0, atol=1e-5)


def test_img2img_sharded_equals_pmap(img2img, pmapped):
    """generate_sharded (jit + NamedSharding) gives the images of jit=True (pmap)."""
    pipe, params = img2img
    inputs, keys, pmapped_images = pmapped
    devices = jax.local_device_count()
    sharded = pipe.generate_sharded(inputs["ids"], inputs["image"], params, keys, 0.3, STEPS, noise=inputs["noise"],
                                    neg_prompt_ids=inputs["neg_prompt_ids"])
    assert sharded.shape == (2 * devices, 32, 32, 3)
    np.testing.assert_allclose(sharded, pmapped_images.reshape(sharded.shape), rtol=0, atol=1e-5)
