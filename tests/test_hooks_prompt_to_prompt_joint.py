"""Prompt-to-prompt on a transformer's joint attention (SD 3.x, Flux.1): source and edit the rows of one batch,
one start noise; in the conditional rows the edit's image queries' probabilities over the text keys become the
source's, mapped and weighted, for the first `cross_steps` of the evaluations. The oracle is diffusers' own
pipeline whose attention processors do the same to its joint attention's probabilities (SD 3.x: [image; text]
with classifier-free guidance, the conditional rows second; Flux.1: [text; image], every block, no CFG), on the
small random checkpoints of test_sd3_pipeline and test_flux_pipeline; images within 1e-3."""

from __future__ import annotations

from unittest import mock

import jax
import numpy as np
import pytest
import torch
import test_flux_pipeline as flux
import test_sd3_pipeline as sd3

from sdflax import Flux, StableDiffusion3, hooks, replicate, shard
from sdflax.parallel import device_mesh

ATOL = 1e-3  # images in [0, 1], float32
SOURCE, EDIT = "a photo of a cat riding a bicycle", "a photo of a dog riding a bicycle"
CROSS = 0.5  # the first half of the evaluations
FAMILIES = {"sd3": (sd3, sd3.torch_sd3_pipeline, StableDiffusion3, dict(guidance_scale=5.0)),
            "flux": (flux, flux.torch_flux_pipeline, Flux, dict(guidance_scale=3.5))}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, diffusers' pipeline, ours, params)."""
    _, build, cls, _ = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    theirs = build(folder)
    theirs.save_pretrained(folder / "checkpoint", safe_serialization=True)
    return (request.param, theirs, *cls.from_pretrained(folder / "checkpoint"))


class Edited:
    """diffusers' attention processor with its attention computed from explicit probabilities, the edit rows' image
    queries' probabilities over the text keys replaced by the source's mapped (in the first `CROSS` of the steps)."""

    def __init__(self, processor, hook, name, state):
        self.processor, self.hook, self.name, self.state = processor, hook, name, state

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, *args, **kwargs):
        joint = encoder_hidden_states is not None or self.name == "flux"  # Flux's single blocks: [text; image]
        sdpa = self.edited if joint else torch.nn.functional.scaled_dot_product_attention
        with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", sdpa):
            return self.processor(attn, hidden_states, encoder_hidden_states, *args, **kwargs)

    def edited(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        probs = torch.softmax((query @ key.transpose(-1, -2)) * query.shape[-1] ** -0.5, dim=-1)  # (B, heads, L, L)
        mapper, alpha, weights = (torch.from_numpy(np.array(x)) for x in (self.hook.mapper, self.hook.alpha,
                                                                           self.hook.weights))
        t, length = mapper.shape[-1], probs.shape[-1]
        image, text = (slice(0, length - t), slice(length - t, length)) if self.name == "sd3" else (
            slice(t, length), slice(0, t))
        first = probs.shape[0] // 2 if self.name == "sd3" else 0  # the conditional rows: [source, edit]
        if self.state["step"] < CROSS * self.state["steps"]:
            probs = probs.clone()
            source = probs[first][:, image, text]
            for e in range(mapper.shape[0]):
                edit = probs[first + 1 + e][:, image, text]
                mapped = torch.einsum("hts,sj->htj", source, mapper[e])
                probs[first + 1 + e][:, image, text] = (alpha[e] * mapped + (1 - alpha[e]) * edit) * weights[e]
        return probs @ value


def theirs_images(name, theirs, hook=None, **kwargs):
    module, _, _, settings = FAMILIES[name]
    transformer = theirs.transformer
    default = transformer.attn_processors
    state = {"step": 0, "steps": module.STEPS}

    def count(pipe, i, t, tensors):
        state["step"] = i + 1
        return {}

    if hook is not None:
        transformer.set_attn_processor({layer: Edited(p, hook, name, state) for layer, p in default.items()})
    try:
        return module.theirs_images(theirs, [SOURCE, EDIT], latents=same_noise(module), callback_on_step_end=count,
                                    **settings, **kwargs)
    finally:
        transformer.set_attn_processor(default)


def same_noise(module):
    return np.repeat(module.latents_for(1), 2, axis=0)  # P2P: one start noise for source and edit


def test_replace_and_reweight_match_diffusers(family):
    name, theirs, pipe, params = family
    module, _, _, settings = FAMILIES[name]
    ids = pipe.prepare_inputs([SOURCE, EDIT], max_sequence_length=module.T5_LENGTH)
    plain = theirs_images(name, theirs)
    previous = None
    for weights in (None, {"dog": 3.0}):
        hook = hooks.prompt_to_prompt(pipe, SOURCE, EDIT, weights=weights, cross_steps=CROSS,
                                      max_sequence_length=module.T5_LENGTH)
        expected = theirs_images(name, theirs, hook)
        assert np.abs(expected[1] - (plain if previous is None else previous)[1]).max() > 3 * ATOL  # it moves
        np.testing.assert_allclose(expected[0], plain[0], rtol=0, atol=1e-5)  # the source is its plain image
        ours = module.ours_images(pipe.with_hooks(hook), params, ids, latents=same_noise(module), **settings)
        np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
        previous = expected


def test_pmap_and_sharded_equal_one_device(family):
    """The hook's batch is one [source, edit] group per program: under pmap and generate_sharded each device makes
    the pair (each equals the one-device images, 1e-5); a group split over two devices, or two groups on one, is
    refused in one line (the edit would not see its source: it came out unedited)."""
    name, _, pipe, params = family
    module, _, _, settings = FAMILIES[name]
    edited = pipe.with_hooks(hooks.prompt_to_prompt(pipe, SOURCE, EDIT, weights={"dog": 3.0}, cross_steps=CROSS,
                                                    max_sequence_length=module.T5_LENGTH))
    ids = pipe.prepare_inputs([SOURCE, EDIT], max_sequence_length=module.T5_LENGTH)
    latents, keys = same_noise(module), jax.random.split(jax.random.PRNGKey(0), 2)
    run = dict(num_inference_steps=2, height=module.SIZE, width=module.SIZE, **settings)
    one = edited(ids, params, keys[0], latents=latents, **run).images
    assert np.abs(one[1] - pipe(ids, params, keys[0], latents=latents, **run).images[1]).max() > 3 * ATOL  # edited
    devices = jax.local_device_count()
    tiled_ids, tiled_latents = np.tile(ids, (devices, 1)), np.tile(latents, (devices, 1, 1, 1))
    pairs = edited(shard(tiled_ids), replicate(params), jax.random.split(keys[0], devices), jit=True,
                   latents=shard(tiled_latents), **run).images
    for device in (0, devices - 1):
        np.testing.assert_allclose(pairs[device], one, rtol=0, atol=1e-5)
    two = device_mesh(jax.local_devices()[:2])
    sharded = edited.generate_sharded(tiled_ids[:4], params, keys, latents=tiled_latents[:4], mesh=two, **run)
    np.testing.assert_allclose(sharded.reshape(2, *one.shape), np.stack([one, one]), rtol=0, atol=1e-5)
    split = r"^prompt_to_prompt edits a group of 2 rows \[source, 1 edit\(s\)\] and {} reach it: give each call one"
    with pytest.raises(ValueError, match=split.format(1)):
        edited.generate_sharded(ids, params, keys, latents=latents, mesh=two, **run)
    with pytest.raises(ValueError, match=split.format(4)):
        edited(tiled_ids[:4], params, keys[0], latents=tiled_latents[:4], **run)


def test_the_text_tokens_are_each_tokenizers_own(family):
    """SD 3.x: CLIP's 77 tokens then T5's, each mapped within itself; Flux.1: T5's; a refine aligns T5's pieces."""
    name, _, pipe, params = family
    length = FAMILIES[name][0].T5_LENGTH
    hook = hooks.prompt_to_prompt(pipe, SOURCE, "a photo of a fluffy cat riding a bicycle", kind="refine",
                                  max_sequence_length=length)
    clip = 77 if name == "sd3" else 0
    assert hook.mapper.shape == (1, clip + length, clip + length)
    assert not np.asarray(hook.mapper[0, :clip, clip:]).any() and not np.asarray(hook.mapper[0, clip:, :clip]).any()
    assert np.asarray(hook.alpha[0, clip:]).min() == 0  # T5's pieces of "fluffy" are new
    ids = pipe.prepare_inputs([SOURCE, EDIT], max_sequence_length=length)
    bad = hooks.prompt_to_prompt(pipe, SOURCE, EDIT, self_steps=0.4, max_sequence_length=length)
    with pytest.raises(ValueError, match=r"^prompt_to_prompt self_steps=0.4: a transformer has no self-attention"):
        pipe.with_hooks(bad)(ids, params, jax.random.PRNGKey(0), num_inference_steps=2)
