"""The walkthrough on eight CPU devices: pmap with replicate/shard, pmap(_generate), and jit + NamedSharding."""

from __future__ import annotations

import numpy as np
import pytest
from builders import torch_pipeline

import jax
import jax.numpy as jnp

from sdflax import StableDiffusion, replicate, shard, unshard

STEPS = 2  # test_pipeline.py's, on the same checkpoint: the batch of one is one program per suite (compile cache)
PROMPTS = [f"a painting of a {thing}" for thing in
           ("cat", "dog", "ship", "tree", "house", "mountain", "river", "city at night")]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipe")
    torch_pipeline("sd1").save_pretrained(folder)
    return StableDiffusion.from_pretrained(folder)


@pytest.fixture(scope="module")
def walkthrough(pipeline):
    pipe, params = pipeline
    assert jax.local_device_count() == 8
    prompt_ids = shard(pipe.prepare_inputs(PROMPTS))
    rng = jax.random.split(jax.random.key(0), jax.local_device_count())
    p_params = replicate(params)
    images = pipe(prompt_ids, p_params, rng, STEPS, jit=True).images
    return prompt_ids, p_params, rng, images


def test_each_device_equals_a_single_device_call(pipeline, walkthrough):
    pipe, params = pipeline
    _, _, rng, images = walkthrough
    assert images.shape == (8, 1, 32, 32, 3)
    ids = pipe.prepare_inputs(PROMPTS)
    for i in range(8):
        single = pipe(ids[i:i + 1], params, rng[i], STEPS).images
        np.testing.assert_allclose(images[i], single, rtol=0, atol=1e-5)
    assert np.abs(images[0] - images[1]).max() > 1e-3  # different prompts and keys, different images


def test_pmap_of_generate_directly(pipeline, walkthrough):
    pipe, _ = pipeline
    prompt_ids, p_params, rng, images = walkthrough
    direct = jax.pmap(pipe._generate, static_broadcasted_argnums=(3,))(prompt_ids, p_params, rng, STEPS)
    np.testing.assert_allclose(np.asarray(direct), images, rtol=0, atol=1e-5)


def test_jit_with_named_sharding_equals_pmap(pipeline, walkthrough):
    pipe, params = pipeline
    _, _, rng, images = walkthrough
    sharded = pipe.generate_sharded(pipe.prepare_inputs(PROMPTS), params, rng, STEPS)
    assert sharded.shape == (8, 32, 32, 3)
    np.testing.assert_allclose(sharded, unshard(images), rtol=0, atol=1e-5)


def test_shard_and_unshard_round_trip():
    x = np.arange(16 * 3).reshape(16, 3)
    sharded = shard(x)
    assert sharded.shape == (8, 2, 3)
    assert len(sharded.sharding.device_set) == 8
    np.testing.assert_array_equal(unshard(sharded), x)
    with pytest.raises(ValueError, match="batch of 12 does not split over 8 devices"):
        shard(np.zeros((12, 77)))
    replicated = replicate({"w": jnp.ones((2, 2))})
    assert replicated["w"].shape == (8, 2, 2) and len(replicated["w"].sharding.device_set) == 8


def test_jit_true_rejects_unsharded_or_wrong_shapes(pipeline, walkthrough):
    pipe, _ = pipeline
    _, p_params, rng, _ = walkthrough
    with pytest.raises(ValueError, match=r"prompt_ids has shape \(8, 77\); expected \(devices, batch, 77\)"):
        pipe(pipe.prepare_inputs(PROMPTS), p_params, rng, STEPS, jit=True)
