"""Prompt-to-prompt as a hook: source and edit as rows of one batch; at strength 0 (no injected steps) each row
is the plain image; the replace edit equals a second diffusers run into which the source run's recorded attention
probabilities are injected; reweighting a word changes the edit, weight 1 does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import saved, torch_pipeline

import jax

from sdflax import StableDiffusion
from sdflax.hooks.prompt_to_prompt import prompt_to_prompt

ATOL = 1e-3  # images in [0, 1], float32
STEPS = 4
SOURCE, EDIT = "a photo of a cat riding a bicycle", "a photo of a dog riding a bicycle"
CROSS, SELF = 0.5, 0.25  # injected in evaluations 0-1 (cross-attention) and 0 (self-attention)


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    theirs, ours, params = saved(torch_pipeline("sd1", "ddim"), tmp_path_factory.mktemp("sd1"), StableDiffusion)
    latent = np.random.default_rng(0).standard_normal((1, 4, 16, 16), dtype=np.float32)
    return theirs, ours, params, np.concatenate([latent, latent])  # P2P: one start noise for source and edit


def run(ours, params, latents, *hooks):
    ids = ours.prepare_inputs([SOURCE, EDIT])
    return ours.with_hooks(*hooks)(ids, params, jax.random.key(0), STEPS, latents=latents).images


def torch_injected(theirs, latent):
    """diffusers' source image, recording the conditional row's attention probabilities in every layer and call,
    then the edit prompt's image with the source's probabilities put in for the injected calls."""
    from diffusers.models.attention_processor import AttnProcessor

    recorded = {}

    class Processor(AttnProcessor):
        def __init__(self, name, inject):
            self.name, self.inject, self.call = name, inject, 0

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
            cross = encoder_hidden_states is not None
            context = encoder_hidden_states if cross else hidden_states
            q, k, v = (attn.head_to_batch_dim(f(x)) for f, x in ((attn.to_q, hidden_states), (attn.to_k, context),
                                                                  (attn.to_v, context)))
            probs = attn.get_attention_scores(q, k, None)  # (2 * heads, T, S): unconditional row, conditional row
            if not self.inject:
                recorded[self.name, self.call] = probs[attn.heads:].clone()
            elif self.call < STEPS * (CROSS if cross else SELF) and (cross or q.shape[1] <= 256):
                probs = torch.cat([probs[:attn.heads], recorded[self.name, self.call]])
            self.call += 1
            out = attn.batch_to_head_dim(torch.bmm(probs, v))
            return attn.to_out[1](attn.to_out[0](out))

    unet = theirs.unet
    default = unet.attn_processors
    images = []
    for prompt, inject in ((SOURCE, False), (EDIT, True)):
        unet.set_attn_processor({name: Processor(name, inject) for name in default})
        with torch.no_grad():
            images.append(theirs(prompt, num_inference_steps=STEPS, latents=torch.from_numpy(latent),
                                 output_type="np").images[0])
    unet.set_attn_processor(default)
    return np.stack(images)


def test_replace_equals_diffusers_with_injected_probabilities(pipes):
    theirs, ours, params, latents = pipes
    expected = torch_injected(theirs, latents[:1])
    edited = run(ours, params, latents, prompt_to_prompt(ours, SOURCE, EDIT, cross_steps=CROSS, self_steps=SELF))
    np.testing.assert_allclose(edited, expected, rtol=0, atol=ATOL)
    plain = run(ours, params, latents)
    assert np.abs(edited[1] - plain[1]).max() > 3 * ATOL  # the injection changes the edit (random weights: a little)
    # strength 0: nothing injected, each row its plain image
    none = run(ours, params, latents, prompt_to_prompt(ours, SOURCE, EDIT, cross_steps=0.0, self_steps=0.0))
    np.testing.assert_allclose(none, plain, rtol=0, atol=1e-5)


def test_reweight_and_refine(pipes):
    _, ours, params, latents = pipes
    replace = run(ours, params, latents, prompt_to_prompt(ours, SOURCE, EDIT))
    same = run(ours, params, latents, prompt_to_prompt(ours, SOURCE, EDIT, weights={"dog": 1.0}))
    np.testing.assert_allclose(same, replace, rtol=0, atol=1e-6)  # one program: weights are traced
    stronger = run(ours, params, latents, prompt_to_prompt(ours, SOURCE, EDIT, weights={"dog": 3.0}))
    assert np.abs(stronger[1] - replace[1]).max() > 1e-3 and np.abs(stronger[0] - replace[0]).max() < 1e-6
    hook = prompt_to_prompt(ours, SOURCE, "a photo of a fluffy cat riding a red bicycle", kind="refine")
    mapper, alpha = np.asarray(hook.mapper[0]), np.asarray(hook.alpha[0])
    # tokens: <start> a photo of a fluffy cat ...: "fluffy" is new, "cat" takes the map of the source's, one before
    assert alpha[:7].tolist() == [1, 1, 1, 1, 1, 0, 1] and mapper[5, 6] == 1
    with pytest.raises(ValueError, match="another number of tokens"):
        prompt_to_prompt(ours, SOURCE, "a photo of a fluffy cat riding a bicycle")
