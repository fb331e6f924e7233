"""SD 3.x pipelines (text-to-image, image-to-image, inpainting) against diffusers' StableDiffusion3Pipeline,
StableDiffusion3Img2ImgPipeline and StableDiffusion3InpaintPipeline (PyTorch) on a small random SD 3.5 Medium-shaped
checkpoint (qk RMSNorm, a dual-attention block, 16 latent channels, CLIP-L + CLIP-G + T5), float32: with and without
T5, prompt_3, a negative prompt, skip-layer guidance, no guidance (Large Turbo's way); and the pmap / sharded paths."""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest
import torch
from builders import (SD3_CLIP, SD3_CLIP_G, TOKENIZER, guided_by_batches, randomize_norms, sd3_t5_config,
                      t5_tokenizer_folder, torch_vae)
from PIL import Image
from test_mmdit import torch_transformer

from sdflax import (StableDiffusion3, StableDiffusion3Img2Img, StableDiffusion3Inpaint, random_draws, replicate,
                    shard, unshard)

IMAGE_ATOL = 1e-3  # images in [0, 1], float32
MODES_ATOL = 1e-5  # pmap / sharded against one device, the same program
MOVES = 1e-2  # what each tested setting changes in diffusers' image, at least
STEPS = 5
SIZE = 64  # pixels; latents 8x8 (VAE scale factor 8), 4x4 patches
T5_LENGTH = 24  # max_sequence_length
SHAPE = (2, 16, SIZE // 8, SIZE // 8)
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a red cat"]
PROMPTS_3 = ["the dog on mars", "blue"]
NEGATIVE = ["blurry", "a dog"]
SLG = dict(skip_guidance_layers=(1,), skip_layer_guidance_scale=2.8, skip_layer_guidance_start=0.01,
           skip_layer_guidance_stop=0.6)  # with 5 steps diffusers skips at steps 1 and 2 (i > 0.05, i < 3)

JOINT = 96  # T5's width, wider than the two CLIPs' 32 + 48
TRANSFORMER = dict(sample_size=SIZE // 8, patch_size=2, in_channels=16, out_channels=16, num_layers=3,
                   attention_head_dim=8, num_attention_heads=4, joint_attention_dim=JOINT, caption_projection_dim=32,
                   pooled_projection_dim=32 + 40, pos_embed_max_size=16, qk_norm="rms_norm",
                   dual_attention_layers=(0,))
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=8,
           sample_size=SIZE, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
           use_post_quant_conv=False)
CLIP, CLIP_G, T5 = SD3_CLIP, SD3_CLIP_G, sd3_t5_config(JOINT)


def torch_sd3_pipeline(folder):
    """diffusers' StableDiffusion3Pipeline of small random models (tokenizer_3's files written under `folder`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    torch.manual_seed(0)
    encoders = [randomize_norms(CLIPTextModelWithProjection(CLIPTextConfig(**config)), seed).eval()
                for seed, config in ((0, CLIP), (1, CLIP_G))]
    t5 = T5EncoderModel(T5Config(**T5)).eval()
    tokenizer_3 = t5_tokenizer_folder(folder / "t5_tokenizer")
    return StableDiffusion3Pipeline(
        transformer=torch_transformer(TRANSFORMER, seed=2), vae=torch_vae(VAE, seed=3),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=encoders[0], text_encoder_2=encoders[1],
        text_encoder_3=t5, tokenizer=CLIPTokenizer.from_pretrained(TOKENIZER),
        tokenizer_2=CLIPTokenizer.from_pretrained(TOKENIZER, pad_token="!"),
        tokenizer_3=T5TokenizerFast(tokenizer_file=str(tokenizer_3 / "tokenizer.json")))


def pictures_and_masks(seed=0, batch=2):
    """Random pictures (PIL RGB) and masks (PIL L, a white square to repaint per picture)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (batch, SIZE, SIZE, 3), dtype=np.uint8)
    masks = np.zeros((batch, SIZE, SIZE), np.uint8)
    for b in range(batch):
        masks[b, 12 + 4 * b:44, 10:50 - 6 * b] = 255
    return [Image.fromarray(p) for p in pixels], [Image.fromarray(m) for m in masks]


def check_images(ours, expected):
    assert isinstance(ours, np.ndarray) and ours.dtype == np.float32
    assert ours.shape == expected.shape == (len(expected), SIZE, SIZE, 3)
    assert expected.std() > 0.05  # not a blank image: the comparison means something
    np.testing.assert_allclose(ours, expected, rtol=0, atol=IMAGE_ATOL)


def moves(a, b):
    return np.abs(np.asarray(a) - np.asarray(b)).max() > MOVES


# ---- fixtures: one checkpoint with T5 and one without, saved and loaded once -------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(folder with T5, folder without, diffusers' pipeline with T5, diffusers' pipeline without)."""
    from diffusers import StableDiffusion3Pipeline

    tmp = tmp_path_factory.mktemp("sd3")
    theirs = torch_sd3_pipeline(tmp)
    theirs.save_pretrained(tmp / "sd3", safe_serialization=True)
    null = StableDiffusion3Pipeline(**{**theirs.components, "text_encoder_3": None, "tokenizer_3": None})
    null.save_pretrained(tmp / "sd3_null", safe_serialization=True)
    return tmp / "sd3", tmp / "sd3_null", theirs, null


@pytest.fixture(scope="module")
def text_to_image(checkpoints):
    folder, _, theirs, _ = checkpoints
    return (theirs, *StableDiffusion3.from_pretrained(folder))


def latents_for(batch=2, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, *SHAPE[1:]), dtype=np.float32)


def theirs_images(theirs, prompts=PROMPTS, steps=STEPS, latents=None, **kwargs):
    """diffusers' images (B, H, W, 3) from the given unit-scale latents."""
    latents = latents_for(len(prompts)) if latents is None else latents
    with torch.no_grad():
        return theirs(prompts, num_inference_steps=steps, height=SIZE, width=SIZE, max_sequence_length=T5_LENGTH,
                      latents=torch.from_numpy(latents), output_type="np", **kwargs).images


def ours_images(pipe, params, ids, steps=STEPS, latents=None, **kwargs):
    latents = latents_for(len(ids)) if latents is None else latents
    return pipe(ids, params, jax.random.PRNGKey(0), num_inference_steps=steps, height=SIZE, width=SIZE,
                latents=latents, **kwargs).images


# ---- text-to-image ------------------------------------------------------------------------------------------------
def test_text_to_image_matches_diffusers(text_to_image):
    """T5, guidance 7 with a negative prompt, two prompts; then prompt_3 (T5's own prompt), in the same program."""
    theirs, pipe, params = text_to_image
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    assert ids.shape == (2, 77 + 77 + T5_LENGTH) and ids.dtype == np.int32
    neg = pipe.prepare_inputs(NEGATIVE, max_sequence_length=T5_LENGTH)
    expected = theirs_images(theirs, guidance_scale=7.0, negative_prompt=NEGATIVE)
    check_images(ours_images(pipe, params, ids, guidance_scale=7.0, neg_prompt_ids=neg), expected)

    expected_3 = theirs_images(theirs, guidance_scale=7.0, negative_prompt=NEGATIVE, prompt_3=PROMPTS_3)
    assert moves(expected_3, expected)  # prompt_3 reaches diffusers' image
    ids_3 = pipe.prepare_inputs(PROMPTS, prompts_3=PROMPTS_3, max_sequence_length=T5_LENGTH)
    compiled = pipe._jitted._cache_size()
    check_images(ours_images(pipe, params, ids_3, guidance_scale=7.0, neg_prompt_ids=neg), expected_3)
    assert pipe._jitted._cache_size() == compiled  # ids are traced: one program for both


def test_without_t5_matches_diffusers(checkpoints, text_to_image):
    """A folder saved without T5, and T5 left out when loading a folder that has it: the same image, diffusers'."""
    folder, null_folder, _, null = checkpoints
    theirs, pipe, params = text_to_image
    expected = theirs_images(null, guidance_scale=7.0, negative_prompt=NEGATIVE)
    assert moves(expected, theirs_images(theirs, guidance_scale=7.0, negative_prompt=NEGATIVE))  # T5 matters
    images = []
    for null_pipe, null_params in (StableDiffusion3.from_pretrained(null_folder),
                                   StableDiffusion3.from_pretrained(folder, text_encoder_3=None)):
        assert "text_encoder_3" not in null_params
        ids = null_pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
        assert ids.shape == (2, 77 + 77 + T5_LENGTH)
        neg = null_pipe.prepare_inputs(NEGATIVE, max_sequence_length=T5_LENGTH)
        images.append(ours_images(null_pipe, null_params, ids, guidance_scale=7.0, neg_prompt_ids=neg))
        check_images(images[-1], expected)
    np.testing.assert_allclose(images[0], images[1], rtol=0, atol=MODES_ATOL)


def test_skip_layer_guidance_matches_diffusers(text_to_image):
    """Layer 1 skipped in an extra pass on the conditional rows at steps 1 and 2 of 5, scale 2.8."""
    theirs, pipe, params = text_to_image
    expected = theirs_images(theirs, guidance_scale=7.0, negative_prompt=NEGATIVE, **{
        **SLG, "skip_guidance_layers": list(SLG["skip_guidance_layers"])})
    assert moves(expected, theirs_images(theirs, guidance_scale=7.0, negative_prompt=NEGATIVE))
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs(NEGATIVE, max_sequence_length=T5_LENGTH)
    check_images(ours_images(pipe, params, ids, guidance_scale=7.0, neg_prompt_ids=neg, **SLG), expected)


def test_a_skip_layer_window_that_holds_no_step_or_is_no_window_is_refused(text_to_image):
    """Skip-layer guidance whose window held no step (diffusers' default window at fewer than 6 steps), or with
    start > stop, NaN or outside [0, 1], gave plain CFG's image while a PNG recorded it."""
    _, pipe, params = text_to_image
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)

    def call(**window):
        return pipe(ids, params, jax.random.PRNGKey(0), num_inference_steps=STEPS, height=SIZE, width=SIZE,
                    skip_guidance_layers=(1,), **window)

    with pytest.raises(ValueError, match=r"skip-layer guidance from 0.01 to 0.2 of 5 steps runs at no step"):
        call()  # 0.05 < i < 1
    for start, stop in [(0.5, 0.2), (float("nan"), 0.2), (-0.1, 0.2), (0.1, 1.5)]:
        with pytest.raises(ValueError, match="must be fractions of the steps with 0 <= start <= stop <= 1"):
            call(skip_layer_guidance_start=start, skip_layer_guidance_stop=stop)


def test_skip_layer_guidance_guider_matches_diffusers_guider(text_to_image, monkeypatch):
    """SkipLayerGuidance on the transformer (block 1 skipped on the conditional copy), its window rounded as
    diffusers' guider rounds it (stop 0.5 of 5 steps: step 1 only, where the pipeline's skip_guidance_layers
    would run steps 1 and 2); a new skip scale reuses the program. diffusers mended: its skipped block gives
    (hidden_states, encoder_hidden_states) where SD 3's block returns (encoder_hidden_states, hidden_states)."""
    from diffusers import LayerSkipConfig as TheirConfig
    from diffusers.guiders import SkipLayerGuidance as TheirSLG
    from diffusers.hooks.layer_skip import TransformerBlockSkipHook

    skip = TransformerBlockSkipHook.new_forward

    def in_the_blocks_order(self, module, *args, **kwargs):
        out = skip(self, module, *args, **kwargs)
        return out[::-1] if isinstance(out, tuple) and self._metadata.return_hidden_states_index == 1 else out

    monkeypatch.setattr(TransformerBlockSkipHook, "new_forward", in_the_blocks_order)

    from sdflax.guiders import LayerSkipConfig, SkipLayerGuidance

    theirs, pipe, params = text_to_image
    window = dict(skip_layer_guidance_start=0.01, skip_layer_guidance_stop=0.5)

    def expected(scale):
        guider = TheirSLG(guidance_scale=5.0, skip_layer_guidance_scale=scale,  # (its *_layers
                          skip_layer_config=TheirConfig([1], fqn="auto"), **window)  # fail: int indices)
        with guided_by_batches(theirs.transformer, guider, STEPS):
            return theirs_images(theirs, guidance_scale=2.0, negative_prompt=NEGATIVE)

    slg = expected(3.0)
    assert moves(slg, expected(0.0))  # the skipped pass reaches diffusers' image
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs(NEGATIVE, max_sequence_length=T5_LENGTH)
    config = LayerSkipConfig([1], fqn="transformer_blocks")
    guided = pipe.with_guider(SkipLayerGuidance(5.0, skip_layer_guidance_scale=3.0, skip_layer_config=config,
                                                **window))
    check_images(ours_images(guided, params, ids, neg_prompt_ids=neg), slg)
    compiled = pipe._jitted._cache_size()
    guided = pipe.with_guider(SkipLayerGuidance(5.0, skip_layer_guidance_scale=0.0, skip_layer_config=config,
                                                **window))
    check_images(ours_images(guided, params, ids, neg_prompt_ids=neg), expected(0.0))
    assert pipe._jitted._cache_size() == compiled  # the scales are traced


def test_no_guidance_matches_diffusers(text_to_image):
    """guidance_scale 1 (SD 3.5 Large Turbo's setting): one transformer pass a step, no negative prompt; the
    default size (the transformer's sample_size x the VAE's factor, 64), as diffusers'."""
    theirs, pipe, params = text_to_image
    expected = theirs_images(theirs, steps=4, guidance_scale=1.0)
    assert moves(expected, theirs_images(theirs, steps=4, guidance_scale=7.0))
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    ours = pipe(ids, params, jax.random.PRNGKey(0), num_inference_steps=4, guidance_scale=1.0,
                latents=latents_for()).images
    check_images(ours, expected)


def test_refuses_a_scheduler_that_is_not_flow_matching(text_to_image):
    _, pipe, _ = text_to_image
    with pytest.raises(ValueError, match="flow-matching scheduler"):
        copy.copy(pipe).scheduler = "ddim"


def test_t5_ids_outside_t5s_vocabulary_are_refused(text_to_image):
    """A T5 tokenizer larger than its encoder gave ids T5 has no row for (a black image); CLIP's were checked."""
    _, pipe, params = text_to_image
    ids = np.array(pipe.prepare_inputs(PROMPTS[:1]))
    vocab = pipe.text_encoder_3.config.vocab_size
    assert vocab < pipe.text_encoder.config.vocab_size  # within CLIP's: the CLIP check let it through
    ids[0, -1] = vocab
    with pytest.raises(ValueError, match=rf"prompt_ids holds token id {vocab}, outside T5's vocabulary "
                                         rf"\[0, {vocab}\)"):
        pipe(ids, params, jax.random.PRNGKey(0), num_inference_steps=STEPS, height=SIZE, width=SIZE)


# ---- image-to-image and inpainting --------------------------------------------------------------------------------
def patch_draws(monkeypatch, module, posterior, noise):
    """diffusers' VAE posterior samples (in the order it encodes) and its added noise, as ours draw them."""
    import diffusers.models.autoencoders.vae as torch_vae_module

    posterior = [torch.from_numpy(np.array(eps)) for eps in posterior]
    monkeypatch.setattr(torch_vae_module, "randn_tensor", lambda *a, **k: posterior.pop(0))
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: torch.from_numpy(np.array(noise)))
    return posterior


@pytest.mark.parametrize("strength, run_steps", [(0.6, 3), (0.5, 3)])
def test_img2img_matches_diffusers(checkpoints, monkeypatch, strength, run_steps):
    """Guidance 7 with the default (empty) negative prompt; diffusers given the same pictures. SD 3's pipelines
    skip int(steps - steps * strength) steps: at strength 0.5 3 of 5 run (SD 1.x's rule runs int(5 * 0.5) = 2)."""
    import diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img as module
    from diffusers import StableDiffusion3Img2ImgPipeline

    folder, _, theirs, _ = checkpoints
    theirs = StableDiffusion3Img2ImgPipeline(**theirs.components)
    pipe, params = StableDiffusion3Img2Img.from_pretrained(folder)
    pictures, _ = pictures_and_masks()
    ids, image = pipe.prepare_inputs(PROMPTS, pictures, max_sequence_length=T5_LENGTH)
    assert image.shape == (2, 3, SIZE, SIZE) and image.dtype == np.float32
    key = jax.random.PRNGKey(3)
    (posterior_eps, _), _ = random_draws(key, SHAPE, 2)  # what ours draws for the posterior sample
    noise = latents_for(seed=1)

    def run(strength):
        patch_draws(monkeypatch, module, [posterior_eps], noise)
        with torch.no_grad():
            return theirs(PROMPTS, image=pictures, strength=strength, num_inference_steps=STEPS, guidance_scale=7.0,
                          max_sequence_length=T5_LENGTH, output_type="np").images

    expected = run(strength)
    assert theirs.num_timesteps == run_steps
    assert moves(expected, run(0.9))
    ours = pipe(ids, image, params, key, strength=strength, num_inference_steps=STEPS, guidance_scale=7.0,
                noise=noise).images
    check_images(ours, expected)


def with_shift_on_decode(vae):
    """A copy of diffusers' VAE whose decode adds shift_factor back, which diffusers' SD 3 inpainting forgets
    (diffusers issue 13611, finding 1: it decodes latents / scaling_factor, its other SD 3 pipelines
    latents / scaling_factor + shift_factor)."""
    vae = copy.deepcopy(vae)
    decode = vae.decode
    vae.decode = lambda z, *args, **kwargs: decode(z + vae.config.shift_factor, *args, **kwargs)
    return vae


def test_inpaint_matches_diffusers(checkpoints, monkeypatch):
    """Strength 1 (from noise), an ordinary 16-channel transformer: the kept region pasted back after every step;
    diffusers' image decoded as its other SD 3 pipelines decode (with the VAE's shift)."""
    import diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_inpaint as module
    from diffusers import StableDiffusion3InpaintPipeline

    folder, _, theirs, _ = checkpoints
    pipe, params = StableDiffusion3Inpaint.from_pretrained(folder)
    pictures, masks = pictures_and_masks()
    ids, image, mask = pipe.prepare_inputs(PROMPTS, pictures, masks, max_sequence_length=T5_LENGTH)
    key = jax.random.PRNGKey(4)
    (image_eps, masked_eps, _), _ = random_draws(key, SHAPE, 3)  # what ours draws from this key
    noise = latents_for(seed=2)

    def run(mask_images, vae=with_shift_on_decode(theirs.vae)):
        # diffusers encodes the image (its latents are pasted back), then the masked image.
        posterior = patch_draws(monkeypatch, module, [image_eps, masked_eps], noise)
        with torch.no_grad():
            images = StableDiffusion3InpaintPipeline(**{**theirs.components, "vae": vae})(
                PROMPTS, image=pictures, mask_image=mask_images, strength=1.0, num_inference_steps=STEPS,
                height=SIZE, width=SIZE, max_sequence_length=T5_LENGTH, output_type="np").images
        assert not posterior, "diffusers drew fewer posterior samples than expected"
        return images

    expected = run(masks)
    assert moves(expected, run([Image.fromarray(np.full((SIZE, SIZE), 255, np.uint8))] * 2))  # the mask matters
    assert moves(expected, run(masks, theirs.vae))  # the shift matters
    ours = pipe(ids, image, mask, params, key, strength=1.0, num_inference_steps=STEPS, noise=noise).images
    check_images(ours, expected)


# ---- devices ------------------------------------------------------------------------------------------------------
def test_pmap_and_sharded_equal_single_device(text_to_image):
    """Two prompts per device over eight devices, latents given: device i's images are what a one-device call on
    its rows gives (the settings of the text-to-image parity test: its program), and generate_sharded's too."""
    _, pipe, params = text_to_image
    devices = jax.local_device_count()
    assert devices == 8
    prompts = [f"a painting of a {i}" for i in range(2 * devices)]
    ids = pipe.prepare_inputs(prompts, max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs(["blurry"] * len(prompts), max_sequence_length=T5_LENGTH)
    latents = latents_for(len(prompts), seed=5)
    keys = jax.random.split(jax.random.PRNGKey(0), devices)
    settings = dict(num_inference_steps=STEPS, guidance_scale=7.0, height=SIZE, width=SIZE)
    images = pipe(shard(ids), replicate(params), keys, jit=True, neg_prompt_ids=shard(neg), latents=shard(latents),
                  **settings).images
    assert images.shape == (devices, 2, SIZE, SIZE, 3)
    for i in (0, 5):
        rows = slice(2 * i, 2 * i + 2)
        single = pipe(ids[rows], params, keys[i], neg_prompt_ids=neg[rows], latents=latents[rows], **settings).images
        np.testing.assert_allclose(images[i], single, rtol=0, atol=MODES_ATOL)
    assert np.abs(images[0] - images[1]).max() > 1e-3
    sharded = pipe.generate_sharded(ids, params, keys, neg_prompt_ids=neg, latents=latents, **settings)
    assert sharded.shape == (2 * devices, SIZE, SIZE, 3)
    np.testing.assert_allclose(sharded, unshard(images), rtol=0, atol=MODES_ATOL)


def test_textual_inversion_is_refused_in_one_line(text_to_image):
    """Embeddings are the UNet families' (SD 3.x's IP-Adapters and LoRAs load: tests/test_transformer_ip_adapter.py,
    tests/test_sd3_lora.py)."""
    _, pipe, params = text_to_image
    with pytest.raises(ValueError, match="are for UNet checkpoints .* SD 3.x's are not supported yet"):
        pipe.load_textual_inversion(params, "charturner.pt")
