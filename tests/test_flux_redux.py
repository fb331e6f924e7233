"""Flux.1 Redux against diffusers' FluxPriorReduxPipeline (PyTorch) on small random SigLIP towers and image embedders
saved as Redux folders: its embeddings without a text prompt (zeros of T5-XXL's width, as diffusers) and with one
(the tiny Flux checkpoint's CLIP and T5), per-image scales, and a Flux image made from them against diffusers'
FluxPipeline given the same embeddings."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from builders import randomize_norms
from PIL import Image
from test_flux_pipeline import SIZE, check_images, latents_for, moves, packed, torch_flux_pipeline

from sdflax import Flux, FluxPriorRedux

RTOL = 1e-4  # float32 embeddings: relative to each element, and to the tensor's largest (T5's 512 states carry
# differences of a few 1e-5 at values of 0.1 among values up to 4: sums in another order through T5's layers)
STEPS = 2  # the prompt is 512 + 16 tokens long here
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
              patch_size=7)  # 16 image tokens


def pictures():
    rng = np.random.default_rng(5)
    return [Image.fromarray(rng.integers(0, 256, (40, 52, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (33, 30, 3), dtype=np.uint8))]


def redux_folder(folder, txt_in_features, seed):
    """diffusers' FluxPriorReduxPipeline without text encoders (a Redux checkpoint's parts), saved to `folder`."""
    from diffusers import FluxPriorReduxPipeline
    from diffusers.pipelines.flux.modeling_flux import ReduxImageEncoder
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    encoder = randomize_norms(SiglipVisionModel(SiglipVisionConfig(**SIGLIP)), seed=seed).eval()
    embedder = ReduxImageEncoder(redux_dim=SIGLIP["hidden_size"], txt_in_features=txt_in_features).eval()
    processor = SiglipImageProcessorPil(size={"height": SIGLIP["image_size"], "width": SIGLIP["image_size"]})
    theirs = FluxPriorReduxPipeline(image_encoder=encoder, feature_extractor=processor, image_embedder=embedder)
    theirs.save_pretrained(folder, safe_serialization=True)
    return theirs


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """(diffusers' tiny Flux dev pipeline, ours, params): CLIP and T5 32 wide."""
    tmp = tmp_path_factory.mktemp("flux")
    theirs = torch_flux_pipeline(tmp)
    theirs.save_pretrained(tmp / "dev", safe_serialization=True)
    return (theirs, *Flux.from_pretrained(tmp / "dev"))


def close(ours, theirs):
    expected = theirs.detach().numpy()
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())


def test_without_a_prompt_matches_diffusers(tmp_path):
    """No text encoders: the image tokens follow 512 zero T5 states of T5-XXL's width (4096) and the pooled
    embedding is zeros, as diffusers'; each image's tokens scaled by its prompt_embeds_scale and summed."""
    theirs = redux_folder(tmp_path / "redux", 4096, seed=1)
    redux, params = FluxPriorRedux.from_pretrained(tmp_path / "redux")
    pixels = redux.prepare_image(pictures())
    with torch.no_grad():
        expected = theirs(pictures(), prompt_embeds_scale=[1.0, 0.6], pooled_prompt_embeds_scale=[1.0, 0.3])
        unscaled = theirs(pictures()).prompt_embeds
    assert moves(expected.prompt_embeds, unscaled)
    states, pooled = redux(params, pixels, prompt_embeds_scale=[1.0, 0.6], pooled_prompt_embeds_scale=[1.0, 0.3])
    assert states.shape == (1, 512 + 16, 4096) and pooled.shape == (1, 768)
    close(states, expected.prompt_embeds)
    close(pooled, expected.pooled_prompt_embeds)
    compiles = redux._embeds._cache_size()
    close(redux(params, pixels)[0], unscaled)  # a new scale: the same program
    assert redux._embeds._cache_size() == compiles


def test_with_a_prompt_and_a_flux_image_match_diffusers(tmp_path, flux):
    """With the Flux checkpoint's text encoders (diffusers' Redux pipeline given them): the prompt's T5 states and
    pooled CLIP embedding from the Flux pipeline's encode_prompt, the image tokens appended; the Flux image made
    from these embeddings equals diffusers' FluxPipeline given them, and differs from the prompt's alone."""
    from diffusers import FluxPriorReduxPipeline

    torch_flux, pipe, flux_params = flux
    saved = redux_folder(tmp_path / "redux", 32, seed=2)
    text = {name: getattr(torch_flux, name) for name in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")}
    theirs = FluxPriorReduxPipeline(**{**saved.components, **text})
    prompt = ["a red cat", "a red cat"]  # diffusers repeats the prompt for each image
    with torch.no_grad():
        expected = theirs(pictures(), prompt=prompt[0], prompt_embeds_scale=[1.0, 0.5])
    redux, params = FluxPriorRedux.from_pretrained(tmp_path / "redux")
    states, pooled = pipe.encode_prompt(flux_params, pipe.prepare_inputs(prompt, max_sequence_length=512))
    ours = redux(params, redux.prepare_image(pictures()), states, pooled, prompt_embeds_scale=[1.0, 0.5])
    close(ours[0], expected.prompt_embeds)
    close(ours[1], expected.pooled_prompt_embeds)

    latents = latents_for(1)
    with torch.no_grad():
        theirs_image = torch_flux(prompt_embeds=expected.prompt_embeds,
                                  pooled_prompt_embeds=expected.pooled_prompt_embeds, num_inference_steps=STEPS, height=SIZE, width=SIZE, latents=packed(latents),
                                  guidance_scale=3.5, output_type="np").images
        text_only = torch_flux(prompt[:1], num_inference_steps=STEPS, height=SIZE, width=SIZE,
                               max_sequence_length=512, latents=packed(latents), guidance_scale=3.5, output_type="np").images
    assert moves(theirs_image, text_only)
    image = pipe(None, flux_params, jax.random.PRNGKey(0), num_inference_steps=STEPS, height=SIZE, width=SIZE, latents=latents,
                 guidance_scale=3.5, prompt_embeds=np.asarray(ours[0]),
                 pooled_prompt_embeds=np.asarray(ours[1])).images
    check_images(image, theirs_image)


def test_bad_input_is_one_line(tmp_path):
    redux_folder(tmp_path / "redux", 24, seed=3)
    redux, params = FluxPriorRedux.from_pretrained(tmp_path / "redux")
    pixels = redux.prepare_image(pictures())
    with pytest.raises(ValueError, match=r"prompt_embeds_scale of shape \(3,\): give one number, or one per image"):
        redux(params, pixels, prompt_embeds_scale=[1.0, 0.5, 0.2])
    with pytest.raises(ValueError, match=r"the Redux image tokens are 24 wide; give \(1 or 2, T, 24\)"):
        redux(params, pixels, np.zeros((1, 5, 32)), np.zeros((1, 32)))
    with pytest.raises(ValueError, match="give prompt_embeds with pooled_prompt_embeds"):
        redux(params, pixels, np.zeros((1, 5, 24)))
    with pytest.raises(ValueError, match="has no image_encoder/config.json: a Flux Redux checkpoint"):
        FluxPriorRedux.from_pretrained(tmp_path / "redux" / "image_encoder")
