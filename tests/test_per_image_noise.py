"""Noise per image, not per batch: with one key per image, every stochastic sampler draws image b's noise from
key b alone, so image b is the same made alone or in a batch (the samplers and a per-sample model, bit for bit)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_flags import XLA_DEFAULTS

from sdflax import sampling
from sdflax.schedulers import SCHEDULERS

SD1 = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
       "steps_offset": 1}
STOCHASTIC = {  # kind -> the config that makes it add noise
    "euler_ancestral": {}, "ddim": {"eta": 1.0}, "ddpm": {}, "dpm2_ancestral": {}, "dpmpp_2s_ancestral": {},
    "dpmpp_sde": {}, "dpmpp_2m_sde": {}, "dpmpp_3m_sde": {}, "lcm": {}, "tcd": {"eta": 0.3},
}
SHAPE = (4, 4, 8, 8)


def model(x, t):
    """A per-sample stand-in for the UNet: each image's output depends on that image alone."""
    return 0.3 * jnp.tanh(x) + 1e-4 * t


def sampler(scheduler):
    """`sample(latents, key)`: 4 steps of `scheduler`, jitted once (one program per batch shape and kind of key), with
    XLA's own options: the bits promised are those of a user's compile, not the suite's (compile_flags.FAST_COMPILE),
    whose level 0 leaves a batch of one and a batch of four rounding differently."""

    @functools.partial(jax.jit, compiler_options=XLA_DEFAULTS)
    def run(latents, key):
        state = scheduler.set_timesteps(4, shape=latents.shape)
        return sampling.denoise(model, scheduler, latents * state.init_noise_sigma, 4, key)

    return lambda latents, key: np.asarray(run(latents, key))


@pytest.mark.parametrize("kind", sorted(STOCHASTIC))
def test_image_b_is_the_same_alone_or_in_a_batch(kind):
    sample = sampler(SCHEDULERS[kind].from_config({**SD1, **STOCHASTIC[kind]}))
    latents = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    keys = jax.random.split(jax.random.key(7), SHAPE[0])
    batch = sample(latents, keys)
    for b in range(SHAPE[0]):
        alone = sample(latents[b:b + 1], keys[b])  # a batch of one with image b's key
        np.testing.assert_array_equal(batch[b:b + 1], alone)
    same_start = sample(np.broadcast_to(latents[:1], SHAPE), keys)
    assert np.abs(same_start[0] - same_start[1]).max() > 1e-3  # the noise is each image's own
