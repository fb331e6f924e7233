"""Flux.1 pipelines (text-to-image, image-to-image, inpainting) against diffusers' FluxPipeline, FluxImg2ImgPipeline
and FluxInpaintPipeline (PyTorch) on small random dev- and schnell-shaped checkpoints (CLIP-L, T5, a transformer of
double and single blocks, a 16-channel VAE), float32: dev's distilled guidance, true CFG with a negative prompt,
schnell (no guidance input), dynamic shifting at two sizes, packed latents, and the pmap / sharded paths."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from builders import SD3_CLIP, TOKENIZER, sd3_t5_config, t5_tokenizer_folder, torch_vae
from test_sd3_pipeline import VAE, patch_draws, pictures_and_masks

from sdflax import Flux, FluxFill, FluxImg2Img, FluxInpaint, FluxKontext, random_draws, replicate, shard, unshard

MODES_ATOL = 1e-5  # pmap / sharded against one device, the same program
MOVES = 1e-2  # what each tested setting changes in diffusers' image, at least
STEPS = 4
SIZE = 64  # pixels: latents 8x8, 16 packed tokens
T5_LENGTH = 16
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a red cat"]
NEGATIVE = ["blurry", "a dog"]

JOINT = 32  # T5's width: the transformer's text tokens
CLIP = {**SD3_CLIP, "projection_dim": None}  # CLIPTextModel: its 32-wide pooled output conditions the transformer
TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=JOINT, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                 max_image_seq_len=4096)


def torch_flux_transformer(seed, **config):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return randomized(FluxTransformer2DModel(**{**TRANSFORMER, **config}).eval())


def randomized(model):
    """`model` with every weight random (a ControlNet's zero layers too); the qk norms' scales near 1, so that
    attention is not uniform."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if ".norm_" in name else 0.0))
    return model


def torch_flux_pipeline(folder, guidance_embeds=True):
    """diffusers' FluxPipeline of small random models (tokenizer_2's files written under `folder`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

    torch.manual_seed(0)
    clip = CLIPTextModel(CLIPTextConfig(**{k: v for k, v in CLIP.items() if k != "projection_dim"})).eval()
    t5 = T5EncoderModel(T5Config(**sd3_t5_config(JOINT))).eval()
    tokenizer_2 = t5_tokenizer_folder(folder / "t5_tokenizer")
    return FluxPipeline(
        transformer=torch_flux_transformer(2, guidance_embeds=guidance_embeds), vae=torch_vae(VAE, seed=3),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), text_encoder=clip, text_encoder_2=t5,
        tokenizer=CLIPTokenizer.from_pretrained(TOKENIZER),
        tokenizer_2=T5TokenizerFast(tokenizer_file=str(tokenizer_2 / "tokenizer.json")))


IMAGE_ATOL = 1e-3  # images in [0, 1], float32


def check_images(ours, expected, shape=(SIZE, SIZE)):
    assert ours.shape == expected.shape == (len(expected), *shape, 3)
    assert expected.std() > 0.05  # not a blank image: the comparison means something
    np.testing.assert_allclose(ours, expected, rtol=0, atol=IMAGE_ATOL)


def moves(a, b):
    return np.abs(np.asarray(a) - np.asarray(b)).max() > MOVES


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"dev": (folder, diffusers' pipeline), "schnell": ..., "fill": ...}, saved once."""
    from diffusers import FluxFillPipeline, FluxPipeline

    tmp = tmp_path_factory.mktemp("flux")
    dev = torch_flux_pipeline(tmp)
    schnell = FluxPipeline(**{**dev.components, "transformer": torch_flux_transformer(4, guidance_embeds=False)})
    common = {name: part for name, part in dev.components.items() if name not in ("image_encoder",
                                                                                 "feature_extractor")}
    fill = FluxFillPipeline(**{**common, "transformer": torch_flux_transformer(5, in_channels=384, out_channels=64)})
    pipelines = {"dev": dev, "schnell": schnell, "fill": fill}
    for name, theirs in pipelines.items():
        theirs.save_pretrained(tmp / name, safe_serialization=True)
    return {name: (tmp / name, theirs) for name, theirs in pipelines.items()}


@pytest.fixture(scope="module")
def dev(checkpoints):
    folder, theirs = checkpoints["dev"]
    return (theirs, *Flux.from_pretrained(folder))


def latents_for(batch=2, seed=0, height=SIZE, width=SIZE):
    return np.random.default_rng(seed).standard_normal((batch, 16, height // 8, width // 8), dtype=np.float32)


def packed(latents):
    from diffusers import FluxPipeline

    b, c, h, w = latents.shape
    return FluxPipeline._pack_latents(torch.from_numpy(latents), b, c, h, w)


def theirs_images(theirs, prompts=PROMPTS, latents=None, height=SIZE, width=SIZE, **kwargs):
    latents = latents_for(len(prompts), height=height, width=width) if latents is None else latents
    with torch.no_grad():
        return theirs(prompts, num_inference_steps=STEPS, height=height, width=width, max_sequence_length=T5_LENGTH,
                      latents=packed(latents), output_type="np", **kwargs).images


def ours_images(pipe, params, ids, latents=None, height=SIZE, width=SIZE, **kwargs):
    latents = latents_for(len(ids), height=height, width=width) if latents is None else latents
    return pipe(ids, params, jax.random.PRNGKey(0), num_inference_steps=STEPS, height=height, width=width,
                latents=latents, **kwargs).images


# ---- text-to-image ------------------------------------------------------------------------------------------------
def test_dev_guidance_matches_diffusers_without_recompiling(dev):
    """dev's guidance is an input of the transformer (no unconditional batch): 3.5 and 5 each equal diffusers'
    image, and the second scale runs the first one's program."""
    theirs, pipe, params = dev
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    assert ids.shape == (2, 77 + T5_LENGTH)
    expected = theirs_images(theirs, guidance_scale=3.5)
    assert moves(expected, theirs_images(theirs, guidance_scale=5.0))
    check_images(ours_images(pipe, params, ids, guidance_scale=3.5), expected)
    compiles = pipe._jitted._cache_size()
    check_images(ours_images(pipe, params, ids, guidance_scale=5.0), theirs_images(theirs, guidance_scale=5.0))
    assert pipe._jitted._cache_size() == compiles


def test_true_cfg_with_a_negative_prompt_matches_diffusers(dev):
    """true_cfg_scale 4 with a negative prompt runs [negative; prompt] (diffusers' do_true_cfg); packed latents
    (B, h/2 · w/2, 64), as diffusers takes them, are accepted."""
    theirs, pipe, params = dev
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs(NEGATIVE, max_sequence_length=T5_LENGTH)
    expected = theirs_images(theirs, guidance_scale=3.5, true_cfg_scale=4.0, negative_prompt=NEGATIVE)
    assert moves(expected, theirs_images(theirs, guidance_scale=3.5))
    ours = ours_images(pipe, params, ids, latents=packed(latents_for()).numpy(), guidance_scale=3.5,
                       true_cfg_scale=4.0, neg_prompt_ids=neg)
    check_images(ours, expected)
    compiles = pipe._jitted._cache_size()
    other = ours_images(pipe, params, ids, guidance_scale=3.5, true_cfg_scale=6.0, neg_prompt_ids=neg)
    assert pipe._jitted._cache_size() == compiles and moves(other, ours)  # the scale is traced


def test_custom_sigmas_match_diffusers(dev):
    """A σ schedule of one's own, shifted by the image's mu as diffusers' Flux pipelines shift theirs (diffusers takes
    the n σ, sdflax the n σ and the 0 the last step lands at)."""
    theirs, pipe, params = dev
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    sigmas = [1.0, 0.7, 0.45, 0.2]
    expected = theirs_images(theirs, guidance_scale=3.5, sigmas=sigmas)
    assert moves(expected, theirs_images(theirs, guidance_scale=3.5))
    check_images(ours_images(pipe, params, ids, guidance_scale=3.5, sigmas=[*sigmas, 0.0]), expected)


def test_schnell_at_another_size_matches_diffusers(checkpoints):
    """schnell's transformer has no guidance input (guidance_scale is ignored, as diffusers); at 96x64 the image
    has 24 tokens, another dynamic shift than 64x64's 16."""
    folder, theirs = checkpoints["schnell"]
    pipe, params = Flux.from_pretrained(folder)
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    size = dict(height=96, width=64)
    expected = theirs_images(theirs, **size)
    assert moves(expected[:, :64], theirs_images(theirs)[:, :64])  # the shift (and the size) matter
    check_images(ours_images(pipe, params, ids, guidance_scale=7.0, **size), expected, shape=(96, 64))


def test_without_t5_the_call_takes_prompt_embeds(checkpoints, dev):
    """text_encoder_2=None spares T5's memory (it never loads): the call takes the states and pooled embeddings a
    pipeline with T5 made (on the host, say), and the image is the full pipeline's; ids alone are refused."""
    _, pipe, params = dev
    light, light_params = Flux.from_pretrained(checkpoints["dev"][0], text_encoder_2=None)
    assert light.text_encoder_2 is None and "text_encoder_2" not in light_params
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    states, pooled = pipe.encode_prompt(params, ids)
    expected = ours_images(pipe, params, ids, guidance_scale=3.5)
    ours = ours_images(light, light_params, None, latents=latents_for(), guidance_scale=3.5,
                       prompt_embeds=np.asarray(states), pooled_prompt_embeds=np.asarray(pooled))
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"this Flux pipeline has no T5 \(text_encoder_2=None\): give prompt_embeds "
                                         "and pooled_prompt_embeds"):
        ours_images(light, light_params, light.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH))


# ---- image-to-image and inpainting --------------------------------------------------------------------------------
def test_img2img_matches_diffusers(checkpoints, monkeypatch):
    import diffusers.pipelines.flux.pipeline_flux_img2img as module
    from diffusers import FluxImg2ImgPipeline

    folder, theirs = checkpoints["dev"]
    theirs = FluxImg2ImgPipeline(**theirs.components)
    pipe, params = FluxImg2Img.from_pretrained(folder)
    pictures, _ = pictures_and_masks()
    ids, image = pipe.prepare_inputs(PROMPTS, pictures, max_sequence_length=T5_LENGTH)
    key = jax.random.PRNGKey(3)
    (posterior_eps, _), _ = random_draws(key, (2, 16, SIZE // 8, SIZE // 8), 2)
    noise = latents_for(seed=1)

    def run(strength):
        patch_draws(monkeypatch, module, [posterior_eps], noise)
        with torch.no_grad():
            return theirs(PROMPTS, image=pictures, strength=strength, num_inference_steps=STEPS, guidance_scale=7.0,
                          height=SIZE, width=SIZE, max_sequence_length=T5_LENGTH, output_type="np").images

    expected = run(0.6)
    assert moves(expected, run(0.9))
    ours = pipe(ids, image, params, key, strength=0.6, num_inference_steps=STEPS, guidance_scale=7.0,
                noise=noise).images
    check_images(ours, expected)


def test_inpaint_matches_diffusers(checkpoints, monkeypatch):
    """Strength 1 (from noise): the kept region pasted back after every step."""
    import diffusers.pipelines.flux.pipeline_flux_inpaint as module
    from diffusers import FluxInpaintPipeline

    folder, theirs = checkpoints["dev"]
    pipe, params = FluxInpaint.from_pretrained(folder)
    pictures, masks = pictures_and_masks()
    ids, image, mask = pipe.prepare_inputs(PROMPTS, pictures, masks, max_sequence_length=T5_LENGTH)
    key = jax.random.PRNGKey(4)
    (image_eps, masked_eps, _), _ = random_draws(key, (2, 16, SIZE // 8, SIZE // 8), 3)
    noise = latents_for(seed=2)

    def run(mask_images):
        posterior = patch_draws(monkeypatch, module, [image_eps, masked_eps], noise)
        with torch.no_grad():
            images = FluxInpaintPipeline(**theirs.components)(
                PROMPTS, image=pictures, mask_image=mask_images, strength=1.0, num_inference_steps=STEPS,
                guidance_scale=7.0, height=SIZE, width=SIZE, max_sequence_length=T5_LENGTH, output_type="np").images
        assert not posterior, "diffusers drew fewer posterior samples than expected"
        return images

    expected = run(masks)
    from PIL import Image
    assert moves(expected, run([Image.fromarray(np.full((SIZE, SIZE), 255, np.uint8))] * 2))
    ours = pipe(ids, image, mask, params, key, strength=1.0, num_inference_steps=STEPS, guidance_scale=7.0,
                noise=noise).images
    check_images(ours, expected)


def test_fill_matches_diffusers(checkpoints, monkeypatch):
    """The Fill model sees the masked image's latents and the 8x8-folded mask beside the latents (384 features)."""
    import diffusers.pipelines.flux.pipeline_flux_fill as module
    from PIL import Image

    folder, theirs = checkpoints["fill"]
    pipe, params = FluxFill.from_pretrained(folder)
    pictures, masks = pictures_and_masks()
    ids, image, mask = pipe.prepare_inputs(PROMPTS, pictures, masks, max_sequence_length=T5_LENGTH)
    key = jax.random.PRNGKey(5)
    (image_eps, masked_eps, _), _ = random_draws(key, (2, 16, SIZE // 8, SIZE // 8), 3)
    noise = latents_for(seed=3)

    def run(mask_images):
        posterior = patch_draws(monkeypatch, module, [image_eps, masked_eps], noise)
        with torch.no_grad():
            images = theirs(
                PROMPTS, image=pictures, mask_image=mask_images, num_inference_steps=STEPS, guidance_scale=30.0,
                height=SIZE, width=SIZE, max_sequence_length=T5_LENGTH, output_type="np").images
        assert not posterior, "diffusers drew fewer posterior samples than expected"
        return images

    expected = run(masks)
    assert moves(expected, run([Image.fromarray(np.full((SIZE, SIZE), 255, np.uint8))] * 2))
    check_images(pipe(ids, image, mask, params, key, num_inference_steps=STEPS, noise=noise).images, expected)


def test_kontext_matches_diffusers(dev):
    """The reference image's latents (the posterior's mean) are extra tokens with ids (1, row, column); diffusers
    at the reference's size (max_area its area, no resizing to Kontext's trained sizes). A reference given as
    latents is taken as it is, and two of them show that the reference matters."""
    from diffusers import FluxKontextPipeline

    theirs, pipe, params = dev
    pipe = FluxKontext(**pipe.components())
    pictures, _ = pictures_and_masks(seed=1)
    ids, image = pipe.prepare_inputs(PROMPTS, pictures, max_sequence_length=T5_LENGTH)
    kontext = FluxKontextPipeline(**theirs.components)  # (FluxPipeline's: Kontext's are the same)

    def run(reference):
        with torch.no_grad():
            return kontext(prompt=PROMPTS, image=reference, num_inference_steps=STEPS, guidance_scale=2.5,
                           height=SIZE, width=SIZE, max_area=SIZE * SIZE, _auto_resize=False,
                           max_sequence_length=T5_LENGTH, latents=packed(latents_for()), output_type="np").images

    def ours(reference):
        return pipe(ids, reference, params, jax.random.PRNGKey(0), num_inference_steps=STEPS, guidance_scale=2.5,
                    latents=latents_for()).images

    check_images(ours(image), run(pictures))
    references = [3 * latents_for(seed=seed) for seed in (6, 7)]
    expected = run(torch.from_numpy(references[0]))
    assert moves(expected, run(torch.from_numpy(references[1])))
    check_images(ours(references[0]), expected)


def test_single_files_load_as_their_pipeline(checkpoints, tmp_path):
    """A transformer file in Black Forest Labs' layout with config= the folder of the other parts gives the folder's
    params; `sdflax.from_pretrained` reads the family and, for a Fill model (folder or file), FluxFill."""
    from safetensors.torch import save_file
    from test_flux_model import to_bfl
    from test_single_file import assert_same_params

    import sdflax

    for name, expected in (("dev", Flux), ("fill", FluxFill)):
        folder, theirs = checkpoints[name]
        path = tmp_path / f"flux1-{name}.safetensors"
        save_file(to_bfl(theirs.transformer.state_dict(), dict(theirs.transformer.config)), path)
        pipe, params = sdflax.from_pretrained(path, config=folder)
        assert type(pipe) is expected and type(sdflax.from_pretrained(folder)[0]) is expected
        _, folder_params = expected.from_pretrained(folder)
        assert_same_params(params["transformer"], folder_params["transformer"])
        assert pipe.transformer.config == expected.from_pretrained(folder)[0].transformer.config


# ---- guiders and hooks -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fqn, index", [("transformer_blocks", 1), ("single_transformer_blocks", 0)])
def test_a_skipped_block_matches_diffusers_layer_skip(dev, monkeypatch, fqn, index):
    """Skip-layer guidance's perturbed pass on Flux: a double- or single-stream block skipped gives both streams
    back, as diffusers' apply_layer_skip (mended, as in the SD 3 test: its skipped block returns (hidden_states,
    encoder_hidden_states) where Flux's blocks return (encoder_hidden_states, hidden_states))."""
    import copy
    import functools

    import flax.linen as nn
    from diffusers import LayerSkipConfig as TheirConfig
    from diffusers.hooks.layer_skip import TransformerBlockSkipHook, apply_layer_skip

    from sdflax.guiders import LayerSkipConfig
    from sdflax.hooks.perturbed_layers import PerturbedLayers

    skip = TransformerBlockSkipHook.new_forward
    monkeypatch.setattr(TransformerBlockSkipHook, "new_forward", lambda self, module, *a, **k: skip(
        self, module, *a, **k)[::-1])
    theirs, pipe, params = dev
    rng = np.random.default_rng(0)
    x, context = rng.standard_normal((1, 16, 64), np.float32), rng.standard_normal((1, T5_LENGTH, JOINT), np.float32)
    pooled, t, guidance = rng.standard_normal((1, 32), np.float32), np.array([0.7], np.float32), np.array([3.5], np.float32)
    img_ids = np.stack(np.meshgrid(np.zeros(1), np.arange(4), np.arange(4), indexing="ij"), -1).reshape(-1, 3)
    txt_ids = np.zeros((T5_LENGTH, 3), np.float32)
    model = copy.deepcopy(theirs.transformer)
    apply_layer_skip(model, TheirConfig([index], fqn=fqn))
    with torch.no_grad():
        arrays = [torch.from_numpy(np.asarray(a, np.float32)) for a in (x, context, pooled, t, img_ids, txt_ids, guidance)]
        expected = model(hidden_states=arrays[0], encoder_hidden_states=arrays[1], pooled_projections=arrays[2],
                         timestep=arrays[3], img_ids=arrays[4], txt_ids=arrays[5], guidance=arrays[6],
                         return_dict=False)[0].numpy()
        whole = theirs.transformer(*arrays[:2], arrays[2], arrays[3], arrays[4], arrays[5], arrays[6],
                                   return_dict=False)[0].numpy()
    assert np.abs(expected - whole).max() > MOVES
    layers = PerturbedLayers((LayerSkipConfig([index], fqn=fqn),), "test", chunks=1, chunk=0)
    with nn.intercept_methods(functools.partial(layers.skip_layers, {})):
        ours = pipe.transformer.apply(params["transformer"], x, context, pooled, t, img_ids.astype(np.float32),
                                      txt_ids, guidance)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_guiders_on_flux(dev):
    """A classifier-free guider with a negative prompt is true CFG; PAG, SEG and SLG perturb Flux's attentions and
    blocks; FreeU, which has no meaning on a transformer, is refused in one line."""
    from sdflax.guiders import ClassifierFreeGuidance
    from sdflax.guiders.names import guider_from_name
    from sdflax.hooks import freeu

    _, pipe, params = dev
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs(NEGATIVE, max_sequence_length=T5_LENGTH)
    true_cfg = ours_images(pipe, params, ids, true_cfg_scale=4.0, neg_prompt_ids=neg)
    cfg = ours_images(pipe.with_guider(ClassifierFreeGuidance(4.0)), params, ids, neg_prompt_ids=neg)
    np.testing.assert_allclose(cfg, true_cfg, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="true_cfg_scale=6 with the pipeline's guider ClassifierFreeGuidance, whose "
                                         r"numbers apply \(its guidance_scale is 4\)"):
        ours_images(pipe.with_guider(ClassifierFreeGuidance(4.0)), params, ids, neg_prompt_ids=neg, true_cfg_scale=6.0)
    everywhere = {"pag": dict(perturbed_guidance_start=0.0, perturbed_guidance_stop=1.0),
                  "seg": dict(seg_guidance_start=0.0, seg_guidance_stop=1.0),
                  "slg": dict(skip_layer_guidance_start=0.0, skip_layer_guidance_stop=1.0)}
    for name, config in (("pag", "transformer_blocks:1"), ("seg", "transformer_blocks:1"),
                         ("slg", "single_transformer_blocks:0")):
        guider = guider_from_name(name, guidance_scale=4.0, config=config, **everywhere[name])
        assert moves(ours_images(pipe.with_guider(guider), params, ids, neg_prompt_ids=neg), cfg), name
    with pytest.raises(ValueError, match=r"freeu works on a UNet only: .* which a transformer \(SD 3.x's, Flux.1's\) "
                                         r"has not; drop the hook"):
        ours_images(pipe.with_hooks(freeu(0.9, 0.2, 1.2, 1.4)), params, ids)


# ---- devices and refusals -----------------------------------------------------------------------------------------
def test_pmap_and_sharded_equal_single_device(dev):
    """The settings of the guidance test (its program) over eight devices."""
    _, pipe, params = dev
    devices = jax.local_device_count()
    assert devices == 8
    prompts = [f"a painting of a {i}" for i in range(2 * devices)]
    ids = pipe.prepare_inputs(prompts, max_sequence_length=T5_LENGTH)
    latents = latents_for(len(prompts), seed=5)
    keys = jax.random.split(jax.random.PRNGKey(0), devices)
    settings = dict(num_inference_steps=STEPS, guidance_scale=3.5, height=SIZE, width=SIZE)
    images = pipe(shard(ids), replicate(params), keys, jit=True, latents=shard(latents), **settings).images
    assert images.shape == (devices, 2, SIZE, SIZE, 3)
    for i in (0, 5):
        rows = slice(2 * i, 2 * i + 2)
        single = pipe(ids[rows], params, keys[i], latents=latents[rows], **settings).images
        np.testing.assert_allclose(images[i], single, rtol=0, atol=MODES_ATOL)
    sharded = pipe.generate_sharded(ids, params, keys, latents=latents, **settings)
    np.testing.assert_allclose(sharded, unshard(images), rtol=0, atol=MODES_ATOL)


def test_a_size_off_the_patch_grid_is_refused(dev):
    _, pipe, params = dev
    ids = pipe.prepare_inputs(PROMPTS[:1], max_sequence_length=T5_LENGTH)
    with pytest.raises(ValueError, match="height=72 is not a multiple of the VAE scale factor 8 times the patch size "
                                         "2: use 64 or 80"):
        pipe(ids, params, jax.random.PRNGKey(0), height=72, width=64)
