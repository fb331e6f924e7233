"""weights/tiny-sd is a genuine diffusers SD 1.x checkpoint: diffusers itself loads it, and its tokenizer is CLIP's."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = Path(__file__).resolve().parents[1] / "weights" / "tiny-sd"
PROMPT = "a photo of an astronaut riding a horse on mars"
IDS = [49406, 320, 1125, 539, 550, 18376, 6765, 320, 4558, 525, 7496, 49407]  # as real SD 1.x tokenizes it
MAX_BYTES = 20_000_000


@pytest.fixture(scope="module")
def diffusers_pipeline():
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(TINY)


def test_diffusers_loads_it(diffusers_pipeline):
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    p = diffusers_pipeline
    assert isinstance(p.unet, UNet2DConditionModel) and isinstance(p.vae, AutoencoderKL)
    assert isinstance(p.text_encoder, CLIPTextModel) and isinstance(p.scheduler, PNDMScheduler)
    assert p.safety_checker is None and p.feature_extractor is None
    # The default image: unet.sample_size * vae_scale_factor pixels a side, as the VAE's own config says.
    assert p.unet.config.sample_size * p.vae_scale_factor == p.vae.config.sample_size == 128
    assert p.text_encoder.config.eos_token_id == p.tokenizer.eos_token_id == 49407
    sd14 = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                steps_offset=1, skip_prk_steps=True, set_alpha_to_one=False, trained_betas=None)
    assert {k: p.scheduler.config[k] for k in sd14} == sd14


def test_tokenizer_is_clips(diffusers_pipeline):
    tokenizer = diffusers_pipeline.tokenizer
    assert tokenizer(PROMPT).input_ids == IDS
    assert tokenizer.model_max_length == 77 and tokenizer.pad_token == "<|endoftext|>"


def test_tokenizer_has_the_sd1_files():
    """SD 1.x hub repos ship vocab.json + merges.txt; the BPE files alone give the same ids."""
    from transformers import CLIPTokenizer

    folder = TINY / "tokenizer"
    assert CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))(PROMPT).input_ids == IDS


def test_small():
    total = sum(f.stat().st_size for f in TINY.rglob("*") if f.is_file())
    assert total < MAX_BYTES, f"weights/tiny-sd is {total / 1e6:.1f} MB"
