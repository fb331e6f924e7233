"""sdflax's FrequencyDecoupledGuidance against diffusers': its Laplacian pyramid equals kornia's, its prediction
equals diffusers' `forward` at every step for each setting, and its images equal diffusers' pipeline stepping with
diffusers' guider (the oracle of test_guiders) for SD and SDXL."""

from __future__ import annotations

import diffusers.guiders as theirs_guiders
import kornia
import numpy as np
import pytest
import torch
from diffusers.guiders.frequency_decoupled_guidance import build_image_from_pyramid
from test_guiders import ATOL, MOVES, STEPS, diffusers_images, pipes, sdflax_images

from sdflax.guiders.fdg import FrequencyDecoupledGuidance, image_from_pyramid, laplacian_pyramid, pyrdown, pyrup

__all__ = ["pipes"]  # test_guiders' module-scoped pipeline per family, a fixture here too

REL = 1e-6  # float32 against float32 (and float64 where diffusers upcasts), relative to the largest value


def assert_close(ours, theirs, what=""):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, what
    assert np.abs(ours - theirs).max() <= REL * np.abs(theirs).max(), what


def random(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("shape", [(2, 4, 16, 16), (1, 4, 12, 6)])
def test_pyrup_and_pyrdown_are_kornias(shape):
    x = random(*shape)
    assert_close(pyrdown(x), kornia.geometry.pyrdown(torch.from_numpy(x)))
    assert_close(pyrup(x), kornia.geometry.pyrup(torch.from_numpy(x)))


# (shape, levels): no padding, kornia's padding to powers of two (odd sides; sides not multiples of 2^(levels-1))
@pytest.mark.parametrize("shape, levels", [((2, 4, 16, 16), 1), ((2, 4, 16, 16), 2), ((2, 4, 16, 16), 3),
                                           ((2, 4, 16, 12), 3), ((1, 4, 13, 9), 2), ((1, 4, 12, 10), 2)])
def test_laplacian_pyramid_and_its_inverse_are_kornias(shape, levels):
    x = random(*shape)
    ours = laplacian_pyramid(x, levels)
    theirs = kornia.geometry.transform.build_laplacian_pyramid(torch.from_numpy(x), levels)
    assert len(ours) == len(theirs) == levels
    for level, (a, b) in enumerate(zip(ours, theirs)):
        assert_close(a, b, f"level {level}")
    rebuilt = build_image_from_pyramid(theirs)
    assert_close(image_from_pyramid(ours), rebuilt)
    np.testing.assert_allclose(np.asarray(image_from_pyramid(ours))[..., :shape[-2], :shape[-1]], x, rtol=0,
                               atol=1e-5)


def diffusers_prediction(guider, cond, uncond, step):
    guider.set_state(step=step, num_inference_steps=STEPS, timestep=torch.tensor(999))
    return guider.forward(torch.from_numpy(cond), torch.from_numpy(uncond)).pred.numpy()


def sdflax_prediction(guider, cond, uncond, step):
    return np.asarray(guider.guide(cond, uncond, step=step, num_steps=STEPS))


SETTINGS = [dict(guidance_scales=[10.0, 5.0]), dict(guidance_scales=[10.0, 5.0, 2.0]),
            dict(guidance_scales=[10.0, 5.0], parallel_weights=[0.5, 0.2]),
            dict(guidance_scales=[10.0, 5.0], parallel_weights=0.5, upcast_to_double=False),
            dict(guidance_scales=[4.0, 2.0], parallel_weights=0.3, use_original_formulation=True),
            dict(guidance_scales=[10.0, 5.0], guidance_rescale=0.7),
            dict(guidance_scales=[10.0, 5.0], guidance_rescale=[0.7, 0.3], guidance_rescale_space="freq"),
            dict(guidance_scales=[10.0, 5.0], start=0.25, stop=0.75),
            dict(guidance_scales=[10.0, 5.0], start=[0.25, 0.25], stop=[0.75, 0.75]),
            dict(guidance_scales=[1.0, 1.0]), dict(guidance_scales=[0.0, 0.0], use_original_formulation=True)]


@pytest.mark.parametrize("settings", SETTINGS, ids=[str(s) for s in SETTINGS])
def test_prediction_is_diffusers_at_every_step(settings):
    cond, uncond = random(2, 4, 16, 16, seed=1), random(2, 4, 16, 16, seed=2)
    theirs, ours = theirs_guiders.FrequencyDecoupledGuidance(**settings), FrequencyDecoupledGuidance(**settings)
    for step in range(STEPS):
        assert_close(sdflax_prediction(ours, cond, uncond, step), diffusers_prediction(theirs, cond, uncond, step))


def test_odd_latents_give_diffusers_prediction_cropped_to_their_size():
    """kornia pads a 13 × 9 image to 16 × 16; diffusers returns that size, sdflax the latents'."""
    cond, uncond = random(2, 4, 13, 9, seed=1), random(2, 4, 13, 9, seed=2)
    settings = dict(guidance_scales=[10.0, 5.0], parallel_weights=0.5)
    theirs = diffusers_prediction(theirs_guiders.FrequencyDecoupledGuidance(**settings), cond, uncond, 0)
    assert theirs.shape == (2, 4, 16, 16)
    assert_close(sdflax_prediction(FrequencyDecoupledGuidance(**settings), cond, uncond, 0), theirs[..., :13, :9])


def test_a_level_off_keeps_the_conditional_level():
    """Where one level is off and another on, diffusers' loop appends a stale level and fails; sdflax keeps the
    level of ε(c), which is diffusers' guidance at that level's scale 1 (to float32 rounding)."""
    cond, uncond = random(2, 4, 16, 16, seed=1), random(2, 4, 16, 16, seed=2)
    almost_off = theirs_guiders.FrequencyDecoupledGuidance(guidance_scales=[10.0, 1.0 + 1e-6])
    both_on = theirs_guiders.FrequencyDecoupledGuidance(guidance_scales=[10.0, 5.0])
    scale_off = FrequencyDecoupledGuidance(guidance_scales=[10.0, 1.0])
    interval_off = FrequencyDecoupledGuidance(guidance_scales=[10.0, 5.0], start=[0.0, 0.5], stop=[1.0, 1.0])
    for step in range(STEPS):
        assert_close(sdflax_prediction(scale_off, cond, uncond, step),
                     diffusers_prediction(almost_off, cond, uncond, step))
        assert_close(sdflax_prediction(interval_off, cond, uncond, step),
                     diffusers_prediction(almost_off if step < STEPS // 2 else both_on, cond, uncond, step))


def test_bad_settings_get_one_clear_line():
    with pytest.raises(ValueError, match="parallel_weights has 3 values but guidance_scales has 2 levels"):
        FrequencyDecoupledGuidance(parallel_weights=[0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="guidance_rescale_space='pixel' must be 'data' or 'freq'"):
        FrequencyDecoupledGuidance(guidance_rescale_space="pixel")
    with pytest.raises(ValueError, match=r"stop=0.2 \(level 1\) must be in \[start, 1\]"):
        FrequencyDecoupledGuidance(start=[0.0, 0.5], stop=[1.0, 0.2])


# (the settings of the case, the settings it is compared with): the case must move diffusers' image
CASES = [({"guidance_scales": [10.0, 5.0]}, {"guidance_scales": [7.5, 7.5]}),
         ({"guidance_scales": [10.0, 5.0], "parallel_weights": 0.0}, {"guidance_scales": [10.0, 5.0]})]
IDS = [(arch, i) for arch in ("sd1", "sdxl") for i in range(len(CASES))]


@pytest.mark.parametrize("pipes, case", IDS, ids=[f"{a}-{i}" for a, i in IDS], indirect=["pipes"])
def test_images_match_diffusers(pipes, case):
    _, theirs, _, _, latents = pipes
    kwargs, baseline = CASES[case]
    expected = diffusers_images(theirs, latents, theirs_guiders.FrequencyDecoupledGuidance(**kwargs))
    moved_from = diffusers_images(theirs, latents, theirs_guiders.FrequencyDecoupledGuidance(**baseline))
    assert np.abs(expected - moved_from).max() > MOVES
    np.testing.assert_allclose(sdflax_images(pipes, FrequencyDecoupledGuidance(**kwargs)), expected, rtol=0,
                               atol=ATOL)
