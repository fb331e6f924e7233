"""SDXL image-to-image, the refiner, the base -> refiner hand-off, SDXL inpainting and prompt_2, against diffusers'
StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline and StableDiffusionXLInpaintPipeline (PyTorch) on small
SDXL-shaped checkpoints, float32; and the pmap / sharded paths of the refiner."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from builders import saved, torch_xl_inpaint_pipeline, torch_xl_pipeline, torch_xl_refiner

import jax

from sdflax import (StableDiffusion, StableDiffusionXL, StableDiffusionXLImg2Img, StableDiffusionXLInpaint,
                    random_draws, replicate, shard, unshard)
from sdflax.loading.hub import ModelNotFoundError
from sdflax.loading.folders import check_pipeline_folder
from sdflax.schedulers import scheduler_from_config

IMAGE_ATOL = 1e-3  # images in [0, 1], float32
LATENT_ATOL = 1e-3  # latents (unit scale) handed from the base to the refiner
STEPS = 4
SIZE = 32  # pixels; latents 16x16 (VAE scale factor 2)
SHAPE = (2, 4, SIZE // 2, SIZE // 2)
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
PROMPTS_2 = ["an oil painting, dramatic light", "a pencil sketch of boats"]
NEGATIVE = ["blurry", "low quality, dark"]
NEGATIVE_2 = ["grainy", "oversaturated"]


def pixels_and_masks(seed=0, batch=2):
    """Random pixels (B, H, W, 3) in [0, 1] and masks (B, H, W): a repainted rectangle per image."""
    rng = np.random.default_rng(seed)
    pixels = rng.uniform(0, 1, (batch, SIZE, SIZE, 3)).astype(np.float32)
    masks = np.zeros((batch, SIZE, SIZE), np.float32)
    for b in range(batch):
        masks[b, 6 + 2 * b:22, 5:25 - 3 * b] = 1.0
    return pixels, masks


def check_images(ours, expected):
    assert ours.shape == expected.shape == (2, SIZE, SIZE, 3)
    assert expected.std() > 0.05  # not a blank image: the comparison means something
    np.testing.assert_allclose(ours, expected, rtol=0, atol=IMAGE_ATOL)


def with_scheduler(pipe, theirs, kind):
    """Both pipelines with the same scheduler kind on the checkpoint's config (ours a copy: its own programs)."""
    import diffusers

    if kind == "euler":
        return pipe, theirs
    cls = {"dpmpp_2m": diffusers.DPMSolverMultistepScheduler}[kind]
    theirs = copy.copy(theirs)
    theirs.scheduler = cls.from_config(theirs.scheduler.config)
    ours = copy.copy(pipe)
    ours.scheduler = scheduler_from_config(dict(theirs.scheduler.config), cls.__name__)
    return ours, theirs


def patch_draws(monkeypatch, module, posterior, noise):
    """diffusers' VAE posterior samples (in the order it encodes) and its added noise, as ours draw them."""
    import diffusers.models.autoencoders.vae as torch_vae_module

    posterior = [torch.from_numpy(np.array(eps)) for eps in posterior]
    monkeypatch.setattr(torch_vae_module, "randn_tensor", lambda *a, **k: posterior.pop(0))
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: torch.from_numpy(np.array(noise)))
    return posterior


# ---- fixtures: one saved base checkpoint and one refiner, loaded once --------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(folder, diffusers SDXL text-to-image pipeline) of a small SDXL base checkpoint (Euler)."""
    folder = tmp_path_factory.mktemp("sdxl_base")
    theirs = torch_xl_pipeline("euler")
    theirs.save_pretrained(folder)
    return folder, theirs


@pytest.fixture(scope="module")
def img2img(base):
    """(diffusers StableDiffusionXLImg2ImgPipeline, ours, params) on the base checkpoint."""
    from diffusers import StableDiffusionXLImg2ImgPipeline

    folder, theirs = base
    pipe, params = StableDiffusionXLImg2Img.from_pretrained(folder)
    return StableDiffusionXLImg2ImgPipeline(**theirs.components, add_watermarker=False), pipe, params


@pytest.fixture(scope="module")
def refiner(tmp_path_factory):
    """(folder, diffusers refiner, ours, params) of a refiner-shaped checkpoint."""
    folder = tmp_path_factory.mktemp("sdxl_refiner")
    return (folder, *saved(torch_xl_refiner("euler"), folder, StableDiffusionXLImg2Img))


def run_img2img(monkeypatch, theirs, pipe, params, strength, prompts=PROMPTS, **kwargs):
    """Both pipelines on the same image, posterior draw and noise; `kwargs` are diffusers' (prompt_2, ...)."""
    import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_img2img as module

    pixels, _ = pixels_and_masks()
    _, image = pipe.prepare_inputs(prompts, list(pixels))
    key = jax.random.key(3)
    (posterior_eps, _), _ = random_draws(key, SHAPE, 2)  # what ours draws for the posterior sample
    noise = np.random.default_rng(1).standard_normal(SHAPE, dtype=np.float32)
    patch_draws(monkeypatch, module, [posterior_eps], noise)
    with torch.no_grad():
        expected = theirs(prompts, image=torch.from_numpy(image), strength=strength, num_inference_steps=STEPS,
                          output_type="np", **kwargs).images
    return image, key, noise, expected


# ---- image-to-image -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", ["euler", "dpmpp_2m"])
@pytest.mark.parametrize("strength", [0.5, 0.75])
def test_img2img_matches_diffusers(img2img, monkeypatch, scheduler, strength):
    theirs, pipe, params = img2img
    pipe, theirs = with_scheduler(pipe, theirs, scheduler)
    image, key, noise, expected = run_img2img(monkeypatch, theirs, pipe, params, strength, guidance_scale=5.0,
                                              negative_prompt=NEGATIVE)
    ours = pipe(pipe.prepare_inputs(PROMPTS), image, params, key, strength, STEPS, noise=noise,
                neg_prompt_ids=pipe.prepare_inputs(NEGATIVE)).images
    check_images(ours, expected)


def test_prompt_2_matches_diffusers(img2img, monkeypatch):
    """A second prompt (and negative prompt) for the second tokenizer and encoder: ids row 1, and the image."""
    theirs, pipe, params = img2img
    pixels, _ = pixels_and_masks()
    ids, _ = pipe.prepare_inputs(PROMPTS, list(pixels), PROMPTS_2)
    for row, (tokenizer, texts) in enumerate(((theirs.tokenizer, PROMPTS), (theirs.tokenizer_2, PROMPTS_2))):
        expected_ids = tokenizer(texts, padding="max_length", max_length=77, truncation=True, return_tensors="np")
        np.testing.assert_array_equal(ids[:, row], expected_ids.input_ids)
    np.testing.assert_array_equal(pipe.prepare_inputs(PROMPTS, prompts_2=""), pipe.prepare_inputs(PROMPTS))
    neg_ids = pipe.prepare_inputs(NEGATIVE, prompts_2=NEGATIVE_2)

    image, key, noise, expected = run_img2img(monkeypatch, theirs, pipe, params, 0.5, prompt_2=PROMPTS_2,
                                              negative_prompt=NEGATIVE, negative_prompt_2=NEGATIVE_2)
    ours = pipe(ids, image, params, key, 0.5, STEPS, noise=noise, neg_prompt_ids=neg_ids).images
    check_images(ours, expected)
    compiled = pipe._jitted._cache_size()
    plain = pipe(pipe.prepare_inputs(PROMPTS), image, params, key, 0.5, STEPS, noise=noise,
                 neg_prompt_ids=pipe.prepare_inputs(NEGATIVE)).images
    assert np.abs(ours - plain).max() > 1e-2  # prompt_2 reaches the image
    assert pipe._jitted._cache_size() == compiled  # ids are traced: one program for both


# ---- the refiner ----------------------------------------------------------------------------------------------------
def test_refiner_loads_with_the_second_encoder_alone(refiner):
    folder, theirs, pipe, params = refiner
    assert set(params) == {"text_encoder_2", "unet", "vae"}
    assert pipe.text_encoder is None and pipe.tokenizer is None
    assert pipe.requires_aesthetics_score and not pipe.force_zeros_for_empty_prompt  # read from model_index.json
    ids = pipe.prepare_inputs(PROMPTS)
    assert ids.shape == (2, 1, 77)
    np.testing.assert_array_equal(ids[:, 0], theirs.tokenizer_2(PROMPTS, padding="max_length", max_length=77,
                                                                truncation=True, return_tensors="np").input_ids)
    check_pipeline_folder(folder, components=tuple(StableDiffusionXL.text.models),
                          tokenizers=StableDiffusionXL.text.tokenizers)  # null components need no files
    with pytest.raises(ModelNotFoundError, match="lists text_encoder, tokenizer as null"):
        StableDiffusion.from_pretrained(folder)
    with pytest.raises(ValueError, match="one text encoder"):
        pipe.prepare_inputs(PROMPTS, prompts_2=PROMPTS_2)
    parts = dict(text_encoder=None, tokenizer=None, text_encoder_2=pipe.text_encoder_2, tokenizer_2=pipe.tokenizer_2,
                 unet=pipe.unet, vae=pipe.vae, scheduler=pipe.scheduler)
    with pytest.raises(ValueError, match="requires_aesthetics_score=True"):
        StableDiffusionXLImg2Img(**parts)


def test_refiner_matches_diffusers_with_aesthetic_scores(refiner, monkeypatch):
    """Second encoder only, the empty prompt encoded (no zeros), aesthetic scores in the time ids (crop (0, 0) for
    the unconditional rows), at a non-default score that changes diffusers' image."""
    _, theirs, pipe, params = refiner
    scores = dict(aesthetic_score=7.5, negative_aesthetic_score=1.0, crops_coords_top_left=(4, 8))
    image, key, noise, expected = run_img2img(monkeypatch, theirs, pipe, params, 0.5, guidance_scale=5.0, **scores)
    _, _, _, default = run_img2img(monkeypatch, theirs, pipe, params, 0.5, guidance_scale=5.0)
    assert np.abs(expected - default).max() > 1e-2  # the scores change the oracle's image
    ids = pipe.prepare_inputs(PROMPTS)
    ours = pipe(ids, image, params, key, 0.5, STEPS, noise=noise, **scores).images
    check_images(ours, expected)
    compiled = pipe._jitted._cache_size()
    ours_default = pipe(ids, image, params, key, 0.5, STEPS, noise=noise).images  # traced: the same program
    check_images(ours_default, default)
    assert pipe._jitted._cache_size() == compiled


def test_base_to_refiner_hand_off_matches_diffusers(base, refiner):
    """The base runs the first 70% of the schedule and returns latents; the refiner runs the rest from them,
    exactly as diffusers' two pipelines chained with output_type="latent"."""
    folder, theirs_base = base
    _, theirs_refiner, refiner_pipe, refiner_params = refiner
    pipe, params = StableDiffusionXL.from_pretrained(folder)
    steps = 5  # leading spacing: timesteps 801, 601, 401 | 201, 1 (the cut at t = 300)
    latents = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    with torch.no_grad():
        handed = theirs_base(PROMPTS, num_inference_steps=steps, denoising_end=0.7, latents=torch.from_numpy(latents),
                             output_type="latent").images
        expected = theirs_refiner(PROMPTS, image=handed, num_inference_steps=steps, denoising_start=0.7,
                                  output_type="np").images
        whole = theirs_base(PROMPTS, num_inference_steps=steps, latents=torch.from_numpy(latents),
                            output_type="latent").images
    ours_latents = pipe(pipe.prepare_inputs(PROMPTS), params, jax.random.key(0), steps, latents=latents,
                        denoising_end=0.7, output_type="latent").images
    assert ours_latents.shape == SHAPE
    np.testing.assert_allclose(ours_latents, handed.numpy(), rtol=0, atol=LATENT_ATOL)
    assert np.abs(handed.numpy() - whole.numpy()).max() > 0.1  # denoising_end stopped early
    ours = refiner_pipe(refiner_pipe.prepare_inputs(PROMPTS), ours_latents, refiner_params, jax.random.key(1),
                        num_inference_steps=steps, denoising_start=0.7).images
    check_images(ours, expected)
    # the pure function traces too (the schedule's cut is computed from static values)
    traced = jax.eval_shape(lambda p, x: refiner_pipe._generate(refiner_pipe.prepare_inputs(PROMPTS), x, p,
                                                                jax.random.key(1), num_inference_steps=steps,
                                                                denoising_start=0.7), refiner_params, ours_latents)
    assert traced.shape == (2, SIZE, SIZE, 3)

    with pytest.raises(ValueError, match="must be below denoising_end"):
        refiner_pipe(refiner_pipe.prepare_inputs(PROMPTS), ours_latents, refiner_params, jax.random.key(1),
                     num_inference_steps=steps, denoising_start=0.7, denoising_end=0.5)
    with pytest.raises(ValueError, match="ends before the first step"):
        pipe(pipe.prepare_inputs(PROMPTS), params, jax.random.key(0), steps, denoising_end=0.01)
    with pytest.raises(ValueError, match=r"denoising_start=1.5 must be a float in \(0, 1\)"):
        refiner_pipe(refiner_pipe.prepare_inputs(PROMPTS), ours_latents, refiner_params, jax.random.key(1),
                     num_inference_steps=steps, denoising_start=1.5)
    with pytest.raises(ValueError, match="output_type='pil'"):
        pipe(pipe.prepare_inputs(PROMPTS), params, jax.random.key(0), steps, output_type="pil")
    with pytest.raises(ValueError, match=r"expected \(B, 3 or 4, H, W\)"):
        refiner_pipe(refiner_pipe.prepare_inputs(PROMPTS), np.zeros((2, 5, 16, 16), np.float32), refiner_params,
                     jax.random.key(1), num_inference_steps=steps)


# ---- inpainting -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def xl_inpaint(tmp_path_factory):
    """`xl_inpaint(unet_channels)` -> (diffusers SDXL inpainting pipeline, ours, params), saved and loaded once."""
    loaded = {}

    def load(unet_channels):
        if unet_channels not in loaded:
            folder = tmp_path_factory.mktemp(f"sdxl_inpaint{unet_channels}")
            loaded[unet_channels] = saved(torch_xl_inpaint_pipeline(unet_channels, "euler"), folder,
                                          StableDiffusionXLInpaint)
        return loaded[unet_channels]

    return load


@pytest.mark.parametrize("unet_channels, strength, denoising_start", [(9, 1.0, None), (4, 0.75, None),
                                                                      (4, 0.9999, 0.6)])
def test_inpaint_matches_diffusers(xl_inpaint, monkeypatch, unet_channels, strength, denoising_start):
    """9-channel and ordinary UNets; and as a refiner stage (denoising_start: no noise added, the schedule cut,
    the known region pasted back at the cut schedule's levels)."""
    import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_inpaint as module

    theirs, pipe, params = xl_inpaint(unet_channels)
    assert pipe.inpainting_unet == (unet_channels == 9)
    pixels, masks = pixels_and_masks()
    ids, image, mask = pipe.prepare_inputs(PROMPTS, list(pixels), list(masks))
    key = jax.random.key(3)
    (image_eps, masked_eps, noise), _ = random_draws(key, SHAPE, 3)  # what ours draws from this key
    # diffusers encodes the image (when it needs its latents), then the masked image.
    posterior = patch_draws(monkeypatch, module,
                            [image_eps, masked_eps] if strength < 1 or unet_channels == 4 else [masked_eps], noise)
    with torch.no_grad():
        expected = theirs(PROMPTS, image=torch.from_numpy(image), mask_image=torch.from_numpy(masks[:, None]),
                          strength=strength, num_inference_steps=STEPS, height=SIZE, width=SIZE,
                          negative_prompt=NEGATIVE, output_type="np", denoising_start=denoising_start).images
    assert not posterior, "diffusers drew fewer posterior samples than expected"
    ours = pipe(ids, image, mask, params, key, strength, STEPS, neg_prompt_ids=pipe.prepare_inputs(NEGATIVE),
                denoising_start=denoising_start).images
    check_images(ours, expected)


# ---- devices --------------------------------------------------------------------------------------------------------
def test_refiner_pmap_and_sharded_equal_single_device(refiner):
    """Two images per device, noise given: a device's images are what a one-device call on its rows with its key
    gives (the static settings of the aesthetic-score parity test: its program), and the sharded path's too."""
    _, _, pipe, params = refiner
    devices = jax.local_device_count()
    assert devices == 8
    rng = np.random.default_rng(2)
    pixels = rng.uniform(0, 1, (2 * devices, SIZE, SIZE, 3)).astype(np.float32)
    noise = rng.standard_normal((2 * devices, *SHAPE[1:]), dtype=np.float32)
    ids, image = pipe.prepare_inputs([f"a painting of a {i}" for i in range(2 * devices)], list(pixels))
    keys = jax.random.split(jax.random.key(0), devices)
    extra = dict(aesthetic_score=7.0, original_size=(48, 40))
    images = pipe(shard(ids), shard(image), replicate(params), keys, 0.5, STEPS, jit=True, noise=shard(noise),
                  **extra).images
    assert images.shape == (devices, 2, SIZE, SIZE, 3)
    for i in (0, 5):
        rows = slice(2 * i, 2 * i + 2)
        single = pipe(ids[rows], image[rows], params, keys[i], 0.5, STEPS, noise=noise[rows], **extra).images
        np.testing.assert_allclose(images[i], single, rtol=0, atol=1e-5)
    assert np.abs(images[0] - images[1]).max() > 1e-3
    sharded = pipe.generate_sharded(ids, image, params, keys, 0.5, STEPS, noise=noise, **extra)
    np.testing.assert_allclose(sharded, unshard(images), rtol=0, atol=1e-5)


# ---- the schedule's cut, without models -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["EulerDiscreteScheduler", "DPMSolverMultistepScheduler", "HeunDiscreteScheduler",
                                  "KDPM2DiscreteScheduler", "PNDMScheduler", "DDIMScheduler"])
@pytest.mark.parametrize("steps, strength, start, end", [(10, 1.0, 0.7, None), (9, 1.0, None, 0.45),
                                                         (10, 0.6, None, 0.85), (10, 1.0, 0.3, 0.85), (7, 1.0, 0.5, None)])
def test_schedule_cut_matches_diffusers(kind, steps, strength, start, end):
    """denoising_start / denoising_end evaluate the timesteps diffusers' SDXL img2img pipeline does, for one- and
    two-evaluation samplers (whose cut keeps whole steps) and PNDM's repeated timestep."""
    import diffusers
    from diffusers import StableDiffusionXLImg2ImgPipeline

    from sdflax import Settings
    from sdflax.pipeline.starts import schedule_timesteps, schedule_window

    from builders import SDXL_SCHEDULER

    theirs = getattr(diffusers, kind).from_config(SDXL_SCHEDULER)
    theirs.set_timesteps(steps)
    holder = type("Holder", (), {"scheduler": theirs})()
    timesteps, _ = StableDiffusionXLImg2ImgPipeline.get_timesteps(holder, steps, strength, "cpu",
                                                                  denoising_start=start)
    if end is not None:  # the pipelines' denoising_end cut
        cutoff = int(round(1000 - end * 1000))
        timesteps = timesteps[:len([t for t in timesteps if t >= cutoff])]
    ours = scheduler_from_config(SDXL_SCHEDULER, kind)
    first, num_evals = schedule_window(ours, Settings(steps, strength=strength, denoising_start=start,
                                                      denoising_end=end))
    np.testing.assert_allclose(schedule_timesteps(ours, steps, first)[:num_evals], timesteps.numpy(), rtol=0, atol=1e-4)


def test_bfloat16_encodes_the_image_in_float32(base):
    """A force_upcast VAE encodes in float32 (as diffusers' SDXL img2img), its bfloat16 params cast inside."""
    import jax.numpy as jnp
    from test_sdxl import conv_dtypes

    folder, _ = base
    pipe, params = StableDiffusionXLImg2Img.from_pretrained(folder, dtype=jnp.bfloat16)
    encode_image = lambda _, p, x, eps: pipe.spec.vae.encode(p, x, eps)  # noqa: E731
    image = np.zeros((1, 3, SIZE, SIZE), np.float32)
    eps = np.zeros((1, 4, SIZE // 2, SIZE // 2), np.float32)
    assert conv_dtypes(lambda p, x: encode_image(pipe, p, x, eps), params, image) == {jnp.dtype(jnp.float32)}
    assert jax.eval_shape(lambda p, x: encode_image(pipe, p, x, eps), params, image).dtype == jnp.float32
    encode = lambda p, x: pipe.vae.apply(p["vae"], x.astype(jnp.bfloat16), method="encode").mean  # noqa: E731
    assert conv_dtypes(encode, params, image) == {jnp.dtype(jnp.bfloat16)}  # (the VAE as loaded)
