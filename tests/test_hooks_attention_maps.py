"""Cross-attention maps as a hook: equal to the softmax probabilities a recording AttnProcessor captures in
diffusers' PyTorch UNet, for one layer at one step and aggregated; a gradient through the hooked sampler; the
hooked pipeline under pmap and sharding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import saved, torch_pipeline

import jax
import jax.numpy as jnp

from sdflax import StableDiffusion, replicate, shard, unshard
from sdflax.hooks.attention_maps import KEY, cross_attention_maps, save_overlay, word_map
from sdflax.pipeline.runner import compiler_options

MAP_ATOL = 1e-5  # probabilities, float32
IMAGE_ATOL = 1e-3
STEPS = 2
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
LAYER = "mid_block.attentions.0.transformer_blocks.0.attn2"


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    return saved(torch_pipeline("sd1", "ddim"), tmp_path_factory.mktemp("sd1"), StableDiffusion)


def torch_maps(theirs, latents):
    """diffusers' images and, per UNet call, each cross-attention layer's probabilities: conditional rows, heads'
    mean, (B, h', w', S), recorded by an AttnProcessor."""
    from diffusers.models.attention_processor import AttnProcessor

    records = []

    class Recorder(AttnProcessor):
        def __init__(self, name):
            self.name = name

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
            if encoder_hidden_states is not None:
                q = attn.head_to_batch_dim(attn.to_q(hidden_states))
                k = attn.head_to_batch_dim(attn.to_k(encoder_hidden_states))
                probs = attn.get_attention_scores(q, k, None)  # (rows * heads, T, S)
                rows, side = hidden_states.shape[0], int(np.sqrt(q.shape[1]))
                mean = probs.reshape(rows, attn.heads, *probs.shape[1:]).mean(1)[rows // 2:]  # conditional half
                records.append((self.name, mean.reshape(rows // 2, side, side, -1).numpy()))
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, temb)

    unet = theirs.unet
    default = unet.attn_processors
    unet.set_attn_processor({name: Recorder(name.removesuffix(".processor")) for name in default})
    with torch.no_grad():
        images = theirs(PROMPTS, num_inference_steps=STEPS, latents=torch.from_numpy(latents), output_type="np").images
    unet.set_attn_processor(default)
    per_call = len({name for name, _ in records})
    calls = [records[i:i + per_call] for i in range(0, len(records), per_call)]
    return images, calls


def upsample(maps, size):
    f = size // maps.shape[1]
    return maps.repeat(f, 1).repeat(f, 2)


def test_maps_equal_diffusers_probabilities(pipes, tmp_path):
    theirs, ours, params = pipes
    latents = np.random.default_rng(0).standard_normal((2, 4, 16, 16), dtype=np.float32)
    expected_images, calls = torch_maps(theirs, latents)
    ids = ours.prepare_inputs(PROMPTS)
    out = ours.with_hooks(cross_attention_maps(per_layer=True))(ids, params, jax.random.key(0), STEPS,
                                                                  latents=latents)
    np.testing.assert_allclose(out.images, expected_images, rtol=0, atol=IMAGE_ATOL)  # images unchanged
    maps = out.trajectory.hooks[KEY]
    assert maps.shape == (STEPS, 2, 16, 16, 77) and len(calls) == STEPS
    assert out.trajectory.latents is None  # only what the hooks emitted
    layer = dict(calls[0])[LAYER]  # one layer, the first step
    assert layer.shape[1] == 8  # a deeper layer: upsampled to the latents
    np.testing.assert_allclose(out.trajectory.hooks[LAYER][0], upsample(layer, 16), rtol=0, atol=MAP_ATOL)
    aggregated = np.stack([np.mean([upsample(m, 16) for _, m in call], 0) for call in calls])
    np.testing.assert_allclose(maps, aggregated, rtol=0, atol=MAP_ATOL)
    # random weights attend nearly uniformly (1/77): the maps still vary over tokens and steps well beyond MAP_ATOL
    assert np.abs(maps[0] - maps[1]).max() > 1e-3 and maps.std(-1).mean() > 1e-4

    horse = word_map(maps, ids, theirs.tokenizer("horse").input_ids[1:-1])
    assert horse.shape == (2, 16, 16) and horse[0].max() > 0 and horse[1].max() == 0  # in prompt 0 only
    path = save_overlay(out.images[0], horse[0], tmp_path / "horse.png")
    from PIL import Image
    assert Image.open(path).size == out.images.shape[2:0:-1]


def test_gradient_of_a_word_map_matches_central_differences(pipes):
    _, ours, params = pipes
    hooked = ours.with_hooks(cross_attention_maps())
    ids = ours.prepare_inputs(PROMPTS[:1])
    position = list(ids[0]).index(ours.tokenizer("horse").input_ids[1])

    def loss(latents, params):
        _, trajectory = hooked._generate(ids, params, jax.random.key(0), STEPS, latents=latents)
        return trajectory.hooks[KEY][..., :8, :8, position].mean()  # the horse in the top-left quarter

    # one program for the loss and its gradient, the params its arguments (not constants baked into it)
    loss_and_grad = jax.jit(jax.value_and_grad(loss), compiler_options=compiler_options())
    rng = np.random.default_rng(1)
    latents = jnp.asarray(rng.standard_normal((1, 4, 16, 16), dtype=np.float32))
    _, grad = loss_and_grad(latents, params)
    # along the gradient: the largest change of a loss this flat, so that float32 rounding stays far below it
    direction = grad / jnp.linalg.norm(grad)
    eps = 1e-2
    numeric = (loss_and_grad(latents + eps * direction, params)[0]
               - loss_and_grad(latents - eps * direction, params)[0]) / (2 * eps)
    analytic = jnp.vdot(grad, direction)
    assert abs(float(numeric)) > 1e-6
    np.testing.assert_allclose(float(analytic), float(numeric), rtol=2e-2)


def test_hooked_pmap_and_sharded_equal_single_device(pipes):
    _, ours, params = pipes
    hooked = ours.with_hooks(cross_attention_maps())
    devices = jax.local_device_count()
    prompts = [f"a painting of a {thing}" for thing in ("cat", "dog", "ship", "tree", "house", "hill", "river", "city")]
    ids = ours.prepare_inputs(prompts[:devices])
    rng = jax.random.split(jax.random.key(0), devices)
    out = hooked(shard(ids), replicate(params), rng, STEPS, jit=True)
    maps = out.trajectory.hooks[KEY]  # (devices, evals, 1, h, w, S)
    for i in (0, devices - 1):
        single = hooked(ids[i:i + 1], params, rng[i], STEPS)
        np.testing.assert_allclose(out.images[i], single.images, rtol=0, atol=1e-5)
        np.testing.assert_allclose(maps[i], single.trajectory.hooks[KEY], rtol=0, atol=1e-6)
    images, trajectory = hooked.generate_sharded(ids, params, rng, STEPS)
    np.testing.assert_allclose(images, unshard(out.images), rtol=0, atol=1e-5)
    np.testing.assert_allclose(trajectory.hooks[KEY], np.concatenate(list(maps), axis=1), rtol=0, atol=1e-6)
