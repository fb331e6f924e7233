"""DeepCache as a hook: the UNet's shallow branch with a full call's features equals the full call; interval 1
gives the plain images; interval 3 changes them a little."""

from __future__ import annotations

import numpy as np
import pytest
from builders import saved, torch_pipeline

import jax

from sdflax import StableDiffusion
from sdflax.hooks import cross_attention_maps, deep_cache

STEPS = 4
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    return saved(torch_pipeline("sd1", "ddim"), tmp_path_factory.mktemp("sd1"), StableDiffusion)[1:]


@pytest.fixture(scope="module")
def apply(sd1):
    """The UNet's apply jitted once for the module: the plain call is one program for both branches."""
    return jax.jit(sd1[0].unet.apply, static_argnames=("method", "branch"))


@pytest.mark.parametrize("branch", [1, 3])  # within the last up block; past an upsampler
def test_shallow_branch_with_its_own_features_equals_the_full_unet(sd1, apply, branch):
    _, params = sd1
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 16, 16), dtype=np.float32)
    context = rng.standard_normal((2, 77, 32), dtype=np.float32)
    plain = apply(params["unet"], x, np.array([500, 10]), context)
    out, features = apply(params["unet"], x, np.array([500, 10]), context, method="deep", branch=branch)
    np.testing.assert_array_equal(out, plain)
    shallow = apply(params["unet"], x, np.array([500, 10]), context, method="shallow", branch=branch,
                    features=features)
    np.testing.assert_allclose(shallow, plain, rtol=0, atol=1e-5)
    # the shallow branch really uses the features it is given
    other = apply(params["unet"], x, np.array([500, 10]), context, method="shallow", branch=branch,
                  features=features * 1.5)
    assert np.abs(other - plain).max() > 1e-3


def test_interval_1_gives_the_plain_images_and_3_changes_them_a_little(sd1):
    pipe, params = sd1
    ids = pipe.prepare_inputs(PROMPTS)
    latents = np.random.default_rng(0).standard_normal((2, 4, 16, 16), dtype=np.float32)
    run = lambda p: p(ids, params, jax.random.key(0), STEPS, latents=latents).images  # noqa: E731
    plain = run(pipe)
    np.testing.assert_allclose(run(pipe.with_hooks(deep_cache(1))), plain, rtol=0, atol=1e-5)
    cached = run(pipe.with_hooks(deep_cache(3)))
    change = np.abs(cached - plain)
    assert 1e-3 < change.max() and change.mean() < 0.1


def test_hooks_that_emit_inside_its_cond_are_refused_in_one_line(sd1):
    pipe, params = sd1
    hooked = pipe.with_hooks(deep_cache(3), cross_attention_maps())
    with pytest.raises(ValueError, match="DeepCache runs the UNet inside a lax.cond"):
        hooked(pipe.prepare_inputs(PROMPTS[:1]), params, jax.random.key(0), STEPS)
