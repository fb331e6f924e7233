"""The first-block cache on SD 3.x's and Flux.1's transformers against diffusers' `apply_first_block_cache` /
`enable_cache(FirstBlockCacheConfig(threshold))` on the small random pipelines of test_sd3_pipeline.py and
test_flux_pipeline.py: the same images (atol 1e-3) and the same evaluations skipped, at thresholds that make diffusers
skip some (its image then differs from the uncached one); a new threshold runs the same program; pmap and the
sharded program decide over the whole batch, as one device.

diffusers mended for SD 3, whose pipeline sets no cache context (the test sets one around the call, so that the
batched [uncond; cond] call has one cache, as a context around it would give) and whose last block, text-pre-only,
returns no text tokens, which the cache's tail hook subtracts from (the block returns its input text tokens here:
the transformer reads none of them after the last block).
"""

from __future__ import annotations

import contextlib
import copy

import jax
import numpy as np
import pytest
import test_flux_pipeline as flux_test
import test_sd3_pipeline as sd3_test

from sdflax import Flux, StableDiffusion3, replicate, shard, unshard
from sdflax.hooks import first_block_cache

SD3_THRESHOLD = 0.35  # diffusers' relative changes at 5 steps: 0.34 (skipped), 0.41, 0.28 (skipped), 0.43
SD3_DECISIONS = [True, False, True, False, True]
FLUX_THRESHOLD = 0.8


@contextlib.contextmanager
def recorded():
    """diffusers' decisions, one per transformer call: whether the blocks after the first ran."""
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    decisions, decide = [], FBCHeadBlockHook._should_compute_remaining_blocks

    def recording(self, residual):
        decisions.append(decide(self, residual))
        return decisions[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FBCHeadBlockHook, "_should_compute_remaining_blocks", recording)
        yield decisions


def ran(output) -> np.ndarray:
    """Our decisions (evals, passes): whether the blocks after the first ran, the same for every image."""
    flags = np.asarray(output.trajectory.hooks["first_block_cache"])
    assert (flags == flags[:, :1]).all()
    return flags[:, 0].astype(bool)


# ---- SD 3 ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sd3_fbc")
    theirs = sd3_test.torch_sd3_pipeline(tmp)
    theirs.save_pretrained(tmp / "sd3", safe_serialization=True)
    return (theirs, *StableDiffusion3.from_pretrained(tmp / "sd3"))


def sd3_cached(theirs, threshold):
    """diffusers' SD 3 pipeline with the first-block cache on a copy of its transformer, mended (the module's
    docstring), in one cache context."""
    from diffusers import FirstBlockCacheConfig, StableDiffusion3Pipeline
    from diffusers.hooks import HookRegistry, apply_first_block_cache

    transformer = copy.deepcopy(theirs.transformer)
    last = transformer.transformer_blocks[-1]
    forward = last.forward

    def with_text_tokens(hidden_states, encoder_hidden_states, temb, **kwargs):
        text, image = forward(hidden_states, encoder_hidden_states, temb, **kwargs)
        return encoder_hidden_states if text is None else text, image

    last.forward = with_text_tokens
    apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=threshold))
    HookRegistry.check_if_exists_or_initialize(transformer)._set_context("cond_uncond")
    return StableDiffusion3Pipeline(**{**theirs.components, "transformer": transformer})


def test_sd3_images_and_skipped_steps_match_diffusers(sd3):
    theirs, pipe, params = sd3
    call = dict(latents=sd3_test.latents_for(1), guidance_scale=7.0)
    with recorded() as decisions:
        expected = sd3_test.theirs_images(sd3_cached(theirs, SD3_THRESHOLD), sd3_test.PROMPTS[:1],
                                          negative_prompt=sd3_test.NEGATIVE[:1], **call)
    assert decisions == SD3_DECISIONS  # two of five evaluations skip the blocks after the first
    plain = sd3_test.theirs_images(theirs, sd3_test.PROMPTS[:1], negative_prompt=sd3_test.NEGATIVE[:1], **call)
    assert np.abs(expected - plain).max() > 1e-2

    ids = pipe.prepare_inputs(sd3_test.PROMPTS[:1], max_sequence_length=sd3_test.T5_LENGTH)
    neg = pipe.prepare_inputs(sd3_test.NEGATIVE[:1], max_sequence_length=sd3_test.T5_LENGTH)
    cached = pipe.with_hooks(first_block_cache(SD3_THRESHOLD))
    out = cached(ids, params, jax.random.key(0), sd3_test.STEPS, height=sd3_test.SIZE, width=sd3_test.SIZE,
                 neg_prompt_ids=neg, **call)
    sd3_test.check_images(out.images, expected)
    assert ran(out)[:, 0].tolist() == decisions

    compiled = cached._jitted._cache_size()
    every = pipe.with_hooks(first_block_cache(0.0))  # never below: every block at every step, diffusers' plain image
    out = every(ids, params, jax.random.key(0), sd3_test.STEPS, height=sd3_test.SIZE, width=sd3_test.SIZE,
                neg_prompt_ids=neg, **call)
    sd3_test.check_images(out.images, plain)
    assert ran(out).all() and cached._jitted._cache_size() == compiled  # the threshold is traced


def test_pmap_and_sharded_decide_as_one_device(sd3):
    """One prompt per device over eight devices, the last four's latents three times larger: the decision is over
    the whole batch, so each device's images are the one-device call's on all eight (which skips a step), and
    generate_sharded's too, though a device's row alone decides otherwise."""
    _, pipe, params = sd3
    devices = jax.local_device_count()
    prompts = [f"a painting of a {i}" for i in range(devices)]
    ids = pipe.prepare_inputs(prompts, max_sequence_length=sd3_test.T5_LENGTH)
    neg = pipe.prepare_inputs(["blurry"] * devices, max_sequence_length=sd3_test.T5_LENGTH)
    latents = np.random.default_rng(5).standard_normal((devices, 16, 4, 4), dtype=np.float32)
    latents[devices // 2:] *= 3
    keys = jax.random.split(jax.random.key(0), devices)
    cached = pipe.with_hooks(first_block_cache(0.3))
    settings = dict(num_inference_steps=sd3_test.STEPS, guidance_scale=7.0, height=32, width=32)
    one = cached(ids, params, keys, neg_prompt_ids=neg, latents=latents, **settings)
    assert ran(one)[:, 0].tolist() == [True, True, True, False, True]
    alone = cached(ids[6:7], params, keys[6:7], neg_prompt_ids=neg[6:7], latents=latents[6:7], **settings)
    assert ran(alone)[:, 0].tolist() == [True, False, True, False, True]
    flags = one.trajectory.hooks["first_block_cache"]  # (evals, B, 1)
    pmapped = cached(shard(ids), replicate(params), keys, jit=True, neg_prompt_ids=shard(neg),
                     latents=shard(latents), **settings)
    np.testing.assert_allclose(unshard(pmapped.images), one.images, rtol=0, atol=1e-5)
    per_device = pmapped.trajectory.hooks["first_block_cache"][:, :, 0]  # (devices, evals, 1): one row each
    np.testing.assert_array_equal(per_device, flags.transpose(1, 0, 2))
    sharded, trajectory = cached.generate_sharded(ids, params, keys, neg_prompt_ids=neg, latents=latents, **settings)
    np.testing.assert_allclose(sharded, one.images, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(trajectory.hooks["first_block_cache"], flags)


# ---- Flux.1 -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flux_fbc")
    theirs = flux_test.torch_flux_pipeline(tmp)
    theirs.save_pretrained(tmp / "dev", safe_serialization=True)
    return (theirs, *Flux.from_pretrained(tmp / "dev"))


@pytest.mark.parametrize("true_cfg", [1.0, 4.0], ids=["distilled", "true_cfg"])
def test_flux_images_and_skipped_steps_match_diffusers(dev, true_cfg):
    """Distilled guidance alone (one call a step), and true CFG (two calls a step in diffusers, each with its
    cache: here one call on [negative; prompt] deciding for each half)."""
    from diffusers import FirstBlockCacheConfig

    theirs, pipe, params = dev
    negative = dict(negative_prompt=flux_test.NEGATIVE[:1]) if true_cfg > 1 else {}
    cached = copy.deepcopy(theirs)
    # the plain pipeline's calls left a hook registry on its transformer whose cached list of the blocks'
    # registries (none then) the copy would keep: the cache's contexts would never reach its blocks
    vars(cached.transformer).pop("_diffusers_hook", None)
    cached.transformer.enable_cache(FirstBlockCacheConfig(threshold=FLUX_THRESHOLD))
    call = dict(latents=flux_test.latents_for(1), guidance_scale=3.5, true_cfg_scale=true_cfg)
    with recorded() as decisions:
        expected = flux_test.theirs_images(cached, flux_test.PROMPTS[:1], **negative, **call)
    plain = flux_test.theirs_images(theirs, flux_test.PROMPTS[:1], **negative, **call)
    assert np.abs(expected - plain).max() > 1e-2 and not all(decisions)

    ids = pipe.prepare_inputs(flux_test.PROMPTS[:1], max_sequence_length=flux_test.T5_LENGTH)
    neg = pipe.prepare_inputs(flux_test.NEGATIVE[:1], max_sequence_length=flux_test.T5_LENGTH)
    out = pipe.with_hooks(first_block_cache(FLUX_THRESHOLD))(
        ids, params, jax.random.key(0), flux_test.STEPS, height=flux_test.SIZE, width=flux_test.SIZE,
        neg_prompt_ids=neg if true_cfg > 1 else None, **call)
    flux_test.check_images(out.images, expected)
    # diffusers calls the prompt's pass, then the negative's; ours holds [negative; prompt]
    ours = ran(out)[:, ::-1].reshape(-1) if true_cfg > 1 else ran(out)[:, 0]
    assert ours.tolist() == decisions


def test_refused_on_a_unet_and_for_a_bad_threshold():
    from sdflax.pipeline.denoisers import UNetDenoiser

    with pytest.raises(ValueError, match="first_block_cache works on a transformer's blocks .* deep_cache"):
        first_block_cache().check_model(UNetDenoiser(None))
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match=r"first_block_cache\(threshold=.*\): the threshold is a relative"):
            first_block_cache(bad)
