"""SD 3.x's text conditioning against diffusers' `StableDiffusion3Pipeline.encode_prompt` on small random CLIP-L,
CLIP-G and T5 encoders: the same ids, states and pooled embeddings, with and without T5, with prompt_2/prompt_3."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
import torch
from builders import SD3_CLIP, SD3_CLIP_G, TOKENIZER, randomize_norms, sd3_t5_config, t5_tokenizer_folder

from sdflax.loading.folders import load_tokenizer
from sdflax.models import CLIPTextModelWithProjection, T5EncoderModel
from sdflax.pipeline.sd3_text import SD3Text, prepare_sd3_ids
from sdflax.loading.tokenizers import T5Tokenizer

RTOL, ATOL = 1e-4, 1e-5  # float32 parity
T5_LENGTH, JOINT = 24, 96  # max_sequence_length; T5's width, wider than the two CLIPs' 32 + 48
CLIP, CLIP_G, T5 = SD3_CLIP, SD3_CLIP_G, sd3_t5_config(JOINT)
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a red cat"]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """diffusers' SD 3 pipeline's text half, and sdflax's loaded from the folders it saves."""
    from diffusers import StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection as TorchCLIP, CLIPTokenizer
    from transformers import T5Config, T5EncoderModel as TorchT5, T5TokenizerFast

    tmp = tmp_path_factory.mktemp("sd3text")
    torch.manual_seed(0)
    encoders = [randomize_norms(TorchCLIP(CLIPTextConfig(**config)), seed).eval()
                for seed, config in ((0, CLIP), (1, CLIP_G))]
    t5 = TorchT5(T5Config(**T5)).eval()
    folder = t5_tokenizer_folder(tmp / "tokenizer_3")
    theirs = StableDiffusion3Pipeline(
        transformer=None, scheduler=None, vae=None, text_encoder=encoders[0], text_encoder_2=encoders[1],
        text_encoder_3=t5, tokenizer=CLIPTokenizer.from_pretrained(TOKENIZER),
        tokenizer_2=CLIPTokenizer.from_pretrained(TOKENIZER, pad_token="!"),
        tokenizer_3=T5TokenizerFast(tokenizer_file=str(folder / "tokenizer.json")))
    modules, params = {}, {}
    for name, model, cls in (("text_encoder", encoders[0], CLIPTextModelWithProjection),
                             ("text_encoder_2", encoders[1], CLIPTextModelWithProjection),
                             ("text_encoder_3", t5, T5EncoderModel)):
        model.save_pretrained(tmp / name)
        modules[name], params[name] = cls.from_pretrained(tmp / name)
    tokenizers = (load_tokenizer(str(TOKENIZER)), load_tokenizer(str(TOKENIZER), pad_token="!"),
                  T5Tokenizer.from_folder(folder))
    return theirs, modules, params, tokenizers


def their_embeds(theirs, **kwargs):
    with torch.no_grad():
        kwargs = {"prompt_2": None, "prompt_3": None, **kwargs}
        states, _, pooled, _ = theirs.encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                                    max_sequence_length=T5_LENGTH, **kwargs)
    return states.numpy(), pooled.numpy()


@pytest.mark.parametrize("with_t5", [True, False])
def test_states_and_pooled_match_diffusers(both, with_t5):
    theirs, modules, params, tokenizers = both
    prompts_3 = ["the dog on mars", "blue"]
    if not with_t5:  # diffusers then reads T5's width off the transformer's config
        theirs = type(theirs)(**{**theirs.components, "text_encoder_3": None, "tokenizer_3": None})
        object.__setattr__(theirs, "transformer", SimpleNamespace(config=SimpleNamespace(joint_attention_dim=JOINT)))
    states, pooled = their_embeds(theirs, prompt_3=prompts_3)
    piece = SD3Text(modules["text_encoder"], modules["text_encoder_2"], modules["text_encoder_3"] if with_t5 else None,
                    JOINT)
    ids = prepare_sd3_ids(*tokenizers[:2], tokenizers[2] if with_t5 else None, PROMPTS, None, prompts_3, T5_LENGTH)
    assert ids.shape == (2, 2 * 77 + T5_LENGTH)
    ours_states, ours_pooled = jax.jit(piece.encode_prompt)(params, ids)
    assert ours_states.shape == states.shape == (2, 77 + T5_LENGTH, JOINT) and np.abs(states).max() > 0.1
    np.testing.assert_allclose(ours_states, states, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ours_pooled, pooled, rtol=RTOL, atol=ATOL)
    if with_t5:  # the third prompt is T5's: it changes diffusers' states
        assert np.abs(their_embeds(theirs)[0] - states).max() > 1e-3


def test_prompt_counts_are_checked(both):
    _, _, _, tokenizers = both
    with pytest.raises(ValueError, match="1 prompts_3 for 2 prompts: give one per prompt"):
        prepare_sd3_ids(*tokenizers, PROMPTS, None, ["one"], T5_LENGTH)
