"""A schedule given in place of the scheduler's spacing: `timesteps=` / `sigmas=` in a pipeline call, as diffusers'
pipelines take them (`retrieve_timesteps`), and Align Your Steps (`AYS_SCHEDULES`, diffusers' `AysSchedules`):
images equal diffusers' pipeline given the same lists; bad lists and schedulers that take none are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import torch_pipeline

import jax

from sdflax import StableDiffusion
from sdflax.schedulers import AYS_SCHEDULES

ATOL = 1e-3  # images in [0, 1], float32
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """diffusers' SD 1.x test pipeline and sdflax's loaded from its folder; the latents both start from."""
    theirs = torch_pipeline("sd1", "dpmpp_2m")
    folder = tmp_path_factory.mktemp("sd1")
    theirs.save_pretrained(folder)
    ours, params = StableDiffusion.from_pretrained(folder)
    size = ours.unet.config.sample_size
    latents = np.random.default_rng(0).standard_normal((len(PROMPTS), 4, size, size), dtype=np.float32)
    return theirs, ours, params, latents


def diffusers_images(theirs, latents, **kwargs):
    with torch.no_grad():
        return theirs(PROMPTS, latents=torch.from_numpy(latents), output_type="np", **kwargs).images


@pytest.mark.parametrize("scheduler, schedule", [
    ("DPMSolverMultistepScheduler", {"timesteps": AYS_SCHEDULES["StableDiffusionTimesteps"]}),
    ("EulerDiscreteScheduler", {"sigmas": AYS_SCHEDULES["StableDiffusionSigmas"]}),
    ("EulerDiscreteScheduler", {"timesteps": [999, 980, 960, 940, 500, 10]}),
    ("HeunDiscreteScheduler", {"timesteps": [999, 980, 960, 500, 10]}),  # two evaluations a step
])
def test_images_equal_diffusers_given_the_same_schedule(both, scheduler, schedule):
    import diffusers

    theirs, ours, params, latents = both
    theirs.scheduler = getattr(diffusers, scheduler).from_config(theirs.scheduler.config)
    ours.scheduler = scheduler  # from the checkpoint's config, as diffusers' from_config above
    expected = diffusers_images(theirs, latents, **schedule)
    got = ours(ours.prepare_inputs(PROMPTS), params, jax.random.key(0), latents=latents, **schedule).images
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    # the schedule is what made the image: the scheduler's own spacing with as many steps gives another
    steps = len(schedule.get("timesteps") or schedule["sigmas"][1:])
    assert np.abs(diffusers_images(theirs, latents, num_inference_steps=steps) - expected).max() > 1e-2


def test_bad_schedules_and_schedulers_that_take_none_are_refused(both):
    """One line each, before anything is traced; as diffusers, a scheduler whose diffusers class takes no custom
    timesteps (or σ) refuses them, and so does a Karras schedule given timesteps."""
    _, ours, params, _ = both
    ids, key = ours.prepare_inputs(PROMPTS), jax.random.key(0)
    ours.scheduler = "euler"
    for schedule, message in [
        ({"timesteps": [1, 2]}, "timesteps=[1, 2] must be strictly descending training timesteps in [0, 999], one "
                                "per step"),
        ({"timesteps": [999, 1500]}, "must be strictly descending training timesteps in [0, 999]"),
        ({"timesteps": [999, float("nan")]}, "timesteps must be a list of finite numbers"),
        ({"sigmas": [14.6]}, "sigmas=[14.6] must be strictly descending σ >= 0, one per step and one more where the "
                             "last step lands (0: a clean image)"),
        ({"sigmas": [14.6, -1.0]}, "must be strictly descending σ >= 0"),
        ({"timesteps": [999, 500], "sigmas": [14.6, 0.0]}, "give timesteps or sigmas, not both"),
    ]:
        with pytest.raises(ValueError, match=None) as info:
            ours(ids, params, key, **schedule)
        assert message in str(info.value), (schedule, str(info.value))
    ours.scheduler = "dpmpp_2m"
    with pytest.raises(ValueError, match="DPMSolverScheduler takes no custom sigmas, as its diffusers class"):
        ours(ids, params, key, sigmas=AYS_SCHEDULES["StableDiffusionSigmas"])
    ours.scheduler = "DPM++ 2M Karras"
    with pytest.raises(ValueError, match="timesteps with DPMSolverScheduler's karras σ schedule"):
        ours(ids, params, key, timesteps=AYS_SCHEDULES["StableDiffusionTimesteps"])
    ours.scheduler = "pndm"
    with pytest.raises(ValueError, match="PNDMScheduler takes no custom timesteps"):
        ours(ids, params, key, timesteps=AYS_SCHEDULES["StableDiffusionTimesteps"])


def test_ays_schedules_are_diffusers(both):
    from diffusers.schedulers import AysSchedules

    assert {name: list(values) for name, values in AYS_SCHEDULES.items()} == AysSchedules
