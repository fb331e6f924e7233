"""Inpainting parity with diffusers' PyTorch StableDiffusionInpaintPipeline (9-channel inpainting UNets and ordinary
4-channel ones), its input checks, the sampler's post_step hook, and the pmap / jit + sharding paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import SD1, saved, torch_pipeline, torch_unet
from test_guiders import both_guided

import jax
import jax.numpy as jnp

from sdflax import StableDiffusionInpaint, replicate, sampling, shard
from sdflax import random_draws
from sdflax.schedulers import DDIMScheduler

ATOL = 1e-3  # images in [0, 1], float32
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
NEGATIVE = ["blurry", "low quality, dark"]
SIZE = 32  # pixels; latents 16x16 (VAE scale factor 2)
STEPS = 10  # the parity tests'; the tests below that reuse a parity test's program take them too


def inputs(seed=0, batch=2):
    """Random pixels (B, H, W, 3) and masks (B, H, W) in [0, 1]: a repainted rectangle per image, with grey
    values on both sides of the 0.5 threshold."""
    rng = np.random.default_rng(seed)
    pixels = rng.uniform(0, 1, (batch, SIZE, SIZE, 3)).astype(np.float32)
    masks = np.full((batch, SIZE, SIZE), 0.3, np.float32)
    for b in range(batch):
        masks[b, 6 + 2 * b:22, 5:25 - 3 * b] = 0.7
    masks[:, :2] = 0.0
    masks[:, -2:] = 1.0
    return pixels, masks


def torch_inpaint_pipeline(unet_channels, scheduler, **scheduler_config):
    from diffusers import StableDiffusionInpaintPipeline

    components = torch_pipeline("sd1", scheduler, **scheduler_config).components
    if unet_channels == 9:
        components["unet"] = torch_unet({**SD1["unet"], "in_channels": 9}, seed=1)
    return StableDiffusionInpaintPipeline(**components)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(unet_channels, scheduler, **scheduler_config)` -> (diffusers pipeline, ours, params), each saved
    and loaded once per module: the parity tests and the fixtures below share pipelines and so compiled programs."""
    loaded = {}

    def load(unet_channels, scheduler, **scheduler_config):
        name = (unet_channels, scheduler, *sorted(scheduler_config.items()))
        if name not in loaded:
            folder = tmp_path_factory.mktemp(f"inpaint{unet_channels}")
            loaded[name] = saved(torch_inpaint_pipeline(unet_channels, scheduler, **scheduler_config), folder,
                                 StableDiffusionInpaint)
        return loaded[name]

    return load


def run_both(checkpoint, monkeypatch, unet_channels, scheduler, strength, steps, guider=None, **scheduler_config):
    """The same image, mask, prompts, posterior draws and noise on both sides; `guider`: a guider's class name and
    arguments, diffusers' stepping diffusers' loop (test_guiders.guided_by) and sdflax's."""
    import diffusers.models.autoencoders.vae as torch_vae_module
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint as torch_inpaint_module

    theirs, pipe, params = checkpoint(unet_channels, scheduler, **scheduler_config)
    assert pipe.inpainting_unet == (unet_channels == 9)

    pixels, masks = inputs()
    ids, image, mask = pipe.prepare_inputs(PROMPTS, list(pixels), list(masks))
    key = jax.random.key(3)
    shape = (2, 4, SIZE // 2, SIZE // 2)
    (image_eps, masked_eps, noise), _ = random_draws(key, shape, 3)  # what our pipeline draws from this key
    # diffusers encodes the image (when it needs its latents), then the masked image.
    posterior = [image_eps, masked_eps] if strength < 1 or unet_channels == 4 else [masked_eps]
    posterior = [torch.from_numpy(np.array(eps)) for eps in posterior]
    monkeypatch.setattr(torch_vae_module, "randn_tensor", lambda *a, **k: posterior.pop(0))
    monkeypatch.setattr(torch_inpaint_module, "randn_tensor", lambda *a, **k: torch.from_numpy(np.array(noise)))
    guided, their_scale, pipe = both_guided(theirs, pipe, guider, steps, strength)
    with torch.no_grad(), guided:
        expected = theirs(PROMPTS, image=torch.from_numpy(image), mask_image=torch.from_numpy(masks[:, None]),
                          strength=strength, num_inference_steps=steps, guidance_scale=their_scale,
                          height=SIZE, width=SIZE, negative_prompt=NEGATIVE, output_type="np").images
    assert not posterior, "diffusers drew fewer posterior samples than expected"
    ours = pipe(ids, image, mask, params, key, strength=strength, num_inference_steps=steps,
                neg_prompt_ids=pipe.prepare_inputs(NEGATIVE)).images
    return ours, expected, mask


@pytest.mark.parametrize("unet_channels, scheduler, strength, config", [
    (9, "pndm", 0.75, {}),
    (9, "ddim", 0.3, {"timestep_spacing": "trailing"}),
    (9, "euler", 1.0, {"timestep_spacing": "leading"}),
    (4, "pndm", 1.0, {}),
    (4, "ddim", 0.75, {}),
    (4, "euler", 0.3, {}),
    (4, "dpmpp_2m", 0.75, {"use_karras_sigmas": True}),
])
def test_inpaint_matches_diffusers(checkpoint, monkeypatch, unet_channels, scheduler, strength, config):
    ours, expected, mask = run_both(checkpoint, monkeypatch, unet_channels, scheduler, strength, STEPS, **config)
    assert ours.shape == expected.shape == (2, SIZE, SIZE, 3)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - 0.5).mean() > 0.01


def test_a_guider_matches_diffusers(checkpoint, monkeypatch):
    guider = ("ClassifierFreeZeroStarGuidance", {"guidance_scale": 7.5, "zero_init_steps": 1, "stop": 0.5})
    ours, expected, _ = run_both(checkpoint, monkeypatch, 9, "pndm", 0.75, STEPS, guider=guider)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    plain, _, _ = run_both(checkpoint, monkeypatch, 9, "pndm", 0.75, STEPS)
    assert np.abs(plain - expected).max() > 1e-2  # the guider made the image


@pytest.fixture(scope="module")
def nine(checkpoint):
    """(pipeline, params) with a 9-channel UNet: the parity test's checkpoint that runs at strength 1."""
    return checkpoint(9, "euler", timestep_spacing="leading")[1:]


def test_strength_one_sees_the_image_only_where_it_is_kept(nine):
    """At strength 1 the start is pure noise and the UNet sees the image masked: pixels under the mask do not
    matter (for a 9-channel UNet; an ordinary UNet's pasted latents come from encoding the whole image)."""
    pipe, params = nine
    pixels, masks = inputs()
    other = np.where(masks[..., None] >= 0.5, 1 - pixels, pixels)  # differs only in the repainted region
    key = jax.random.key(5)
    negative = pipe.prepare_inputs(NEGATIVE)

    def run(p):  # the static settings of this checkpoint's parity test: its program
        return pipe(*pipe.prepare_inputs(PROMPTS, list(p), list(masks)), params, key, num_inference_steps=STEPS,
                    neg_prompt_ids=negative).images

    a, b = run(pixels), run(other)
    np.testing.assert_array_equal(a, b)
    kept_changed = np.where(masks[..., None] >= 0.5, pixels, 1 - pixels)
    assert np.abs(run(kept_changed) - a).max() > 1e-3


def test_strength_and_inputs_are_checked(nine):
    pipe, params = nine
    pixels, masks = inputs()
    ids, image, mask = pipe.prepare_inputs(PROMPTS, list(pixels), list(masks))
    key = jax.random.key(0)
    for strength in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"strength must be in \(0, 1\]"):
            pipe(ids, image, mask, params, key, strength=strength, num_inference_steps=4)
    with pytest.raises(ValueError, match="runs no denoising step"):
        pipe(ids, image, mask, params, key, strength=0.2, num_inference_steps=4)
    with pytest.raises(ValueError, match="mask of 32x30 for an image of 32x32: give a mask the size of its image"):
        pipe.prepare_inputs(PROMPTS[:1], pixels[0], masks[0, :30])
    with pytest.raises(ValueError, match=r"mask array must be greyscale .*got \(32, 32, 2\): give one channel"):
        pipe.prepare_inputs(PROMPTS[:1], pixels[0], np.zeros((SIZE, SIZE, 2), np.float32))
    with pytest.raises(ValueError, match="2 images and 1 masks: give one mask per image"):
        pipe.prepare_inputs(PROMPTS, list(pixels), masks[0])
    with pytest.raises(ValueError, match=r"takes images and masks"):
        pipe.prepare_inputs(PROMPTS, list(pixels))
    with pytest.warns(UserWarning, match="image of 33x35 resized to 32x34") as caught:
        _, resized, resized_mask = pipe.prepare_inputs(["a"], np.zeros((35, 33, 3), np.uint8),
                                                       np.zeros((35, 33), np.uint8))
    assert any("mask of 33x35 resized to 32x34" in str(w.message) for w in caught)
    assert resized.shape == (1, 3, 34, 32) and resized_mask.shape == (1, 1, 34, 32)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 3, 32, 32\); expected \(B, 1, H, W\)"):
        pipe(ids, image, image, params, key, num_inference_steps=4)
    with pytest.raises(ValueError, match="mask is 16x16 but the image is 32x32: give a mask of the image's size"):
        pipe(ids, image, mask[:, :, ::2, ::2], params, key, num_inference_steps=4)
    with pytest.raises(ValueError, match="height=64 but the image is 32"):
        pipe(ids, image, mask, params, key, num_inference_steps=4, height=64)


def test_masks_are_prepared_as_diffusers_prepares_them():
    """Greyscale, resized to a multiple of the scale factor (Lanczos) and binarised: diffusers' mask processor."""
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    from sdflax.pipeline.images import preprocess_masks

    processor = VaeImageProcessor(vae_scale_factor=4, do_normalize=False, do_binarize=True,
                                  do_convert_grayscale=True)
    rng = np.random.default_rng(0)
    grey = Image.fromarray(rng.integers(0, 256, (35, 41), dtype=np.uint8))
    rgb = Image.fromarray(rng.integers(0, 256, (32, 40, 3), dtype=np.uint8))
    for mask, (w, h) in ((grey, (40, 32)), (rgb, (40, 32))):
        with pytest.warns(UserWarning) if mask.size != (w, h) else _no_warning():
            ours = preprocess_masks(mask, 4)
        theirs = processor.preprocess(mask, height=h, width=w).numpy()
        assert ours.shape == theirs.shape == (1, 1, h, w)
        np.testing.assert_array_equal(ours, theirs)
        assert 0.2 < ours.mean() < 0.8
    # arrays: uint8 or float, with or without a channel axis; RGB arrays as PIL's luma
    array = rng.uniform(0, 1, (8, 12)).astype(np.float32)
    np.testing.assert_array_equal(preprocess_masks(array, 4)[0, 0], array >= 0.5)
    np.testing.assert_array_equal(preprocess_masks(array[..., None], 4)[0, 0], array >= 0.5)
    rgb_array = np.asarray(rgb)
    np.testing.assert_array_equal(preprocess_masks(rgb_array, 4), preprocess_masks(rgb, 4))


class _no_warning:
    def __enter__(self):
        import warnings

        self.catch = warnings.catch_warnings()
        self.catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self.catch.__exit__(*exc)


def test_post_step_runs_after_every_step_before_callback_and_trajectory():
    """sampling.denoise(post_step=...): what it returns is the next step's input and what the hooks see."""
    scheduler = DDIMScheduler.from_config({"num_train_timesteps": 1000})
    seen, steps = [], 4
    model = lambda x, t: jnp.zeros_like(x)  # noqa: E731
    post_step = lambda x, i, state: x * 0 + i.astype(x.dtype) + state.alpha_prod_t[i]  # noqa: E731
    x0 = jnp.ones((1, 4, 2, 2))
    out, trajectory = sampling.denoise(model, scheduler, x0, steps, jax.random.key(0), return_trajectory=True,
                                       callback=lambda i, n, x: seen.append((i, float(x[0, 0, 0, 0]))),
                                       post_step=post_step)
    jax.effects_barrier()
    state = scheduler.set_timesteps(steps)
    expected = np.arange(steps) + np.asarray(state.alpha_prod_t)
    np.testing.assert_allclose(trajectory.latents[:, 0, 0, 0, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(out, np.full(x0.shape, expected[-1]), rtol=1e-6)
    assert [i for i, _ in sorted(seen)] == list(range(steps))
    np.testing.assert_allclose([v for _, v in sorted(seen)], expected, rtol=1e-6)


@pytest.fixture(scope="module")
def four(checkpoint):
    """(pipeline, params) with an ordinary 4-channel UNet: the parity test's checkpoint that runs PNDM at strength 1."""
    return checkpoint(4, "pndm")[1:]


@pytest.mark.parametrize("which", ["nine", "four"])
def test_pmap_and_sharded_paths_equal_single_device_calls(which, request):
    """jit=True (pmap over sharded images and masks) and generate_sharded (jit + NamedSharding) give the same
    images; with one key per image, image b is what a batch of one with key b gives, on any device count."""
    pipe, params = request.getfixturevalue(which)
    devices = jax.local_device_count()
    pixels, masks = inputs(seed=1, batch=2 * devices)
    prompts = [f"a painting number {i}" for i in range(2 * devices)]
    ids, image, mask = pipe.prepare_inputs(prompts, list(pixels), list(masks))
    steps, strength = 4, 0.75
    image_keys = jax.random.split(jax.random.key(1), 2 * devices)  # one key per image
    # One key per device: two images per device; for the 9-channel UNet one (the second half of the images, with
    # their keys), so that each device computes a batch of one with its image's key, to compare with below.
    rows, keys = ((slice(None), jax.random.split(jax.random.key(0), devices)) if which == "four"
                  else (slice(devices, None), image_keys[devices:]))
    pmapped = pipe(shard(ids[rows]), shard(image[rows]), shard(mask[rows]), replicate(params), keys, strength, steps,
                   jit=True).images
    assert pmapped.shape == (devices, 2 if which == "four" else 1, SIZE, SIZE, 3)
    sharded = pipe.generate_sharded(ids[rows], image[rows], mask[rows], params, keys, strength, steps)
    np.testing.assert_allclose(sharded, pmapped.reshape(sharded.shape), rtol=0, atol=1e-5)
    assert np.abs(sharded[0] - sharded[1]).max() > 1e-3
    if which == "four":
        return  # the rest does not depend on the kind of UNet

    per_image = pipe.generate_sharded(ids, image, mask, params, image_keys, strength, steps)
    np.testing.assert_allclose(per_image[devices:], sharded, rtol=0, atol=1e-5)  # each a batch of one, its key
    # under pmap: (devices, 2) keys, sharded like the images
    pmapped = pipe(shard(ids), shard(image), shard(mask), replicate(params), shard(image_keys), strength, steps,
                   jit=True).images
    np.testing.assert_allclose(pmapped.reshape(per_image.shape), per_image, rtol=0, atol=1e-5)


def test_traced_values_do_not_recompile(four):
    """New values of traced inputs reuse the program; giving noise (an input left out before) makes one more. The
    first call has the static settings of this checkpoint's parity test: its program."""
    pipe, params = four
    pixels, masks = inputs(seed=2)
    ids, image, mask = pipe.prepare_inputs(PROMPTS, list(pixels), list(masks))
    pipe(ids, image, mask, params, jax.random.key(0), 1.0, STEPS, neg_prompt_ids=pipe.prepare_inputs(NEGATIVE))
    size = pipe._jitted._cache_size()
    other_ids, other_image, other_mask = pipe.prepare_inputs(PROMPTS[::-1], list(pixels[::-1]), list(masks[::-1]))
    pipe(other_ids, other_image, other_mask, params, jax.random.key(1), 1.0, STEPS, guidance_scale=3.0,
         neg_prompt_ids=pipe.prepare_inputs(NEGATIVE), noise=np.zeros((2, 4, 16, 16), np.float32))
    assert pipe._jitted._cache_size() == size + 1  # noise given: a second signature
    pipe(other_ids, other_image, other_mask, params, jax.random.key(3), 1.0, STEPS, guidance_scale=9.0,
         neg_prompt_ids=pipe.prepare_inputs(PROMPTS), noise=np.ones((2, 4, 16, 16), np.float32))
    assert pipe._jitted._cache_size() == size + 1
