"""A schedule given in place of the scheduler's spacing: `timesteps=` / `sigmas=` in a pipeline call, as diffusers'
pipelines take them (`retrieve_timesteps`), and Align Your Steps (`AYS_SCHEDULES`, diffusers' `AysSchedules`):
images equal diffusers' pipeline given the same lists; bad lists and schedulers that take none are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import torch_pipeline

import jax
import jax.numpy as jnp

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
        # fractional timesteps slipped past the step cap: 4,000 steps ran for minutes
        ({"timesteps": list(np.linspace(999, 0, 4000))}, "timesteps asks for 4000 steps: at most 1000 "
                                                         "(num_train_timesteps), as num_inference_steps"),
        ({"sigmas": list(np.linspace(14.6, 0, 1002))}, "sigmas asks for 1001 steps: at most 1000"),
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


@pytest.mark.parametrize("name, ends", [("Euler KL Optimal", "spaced"), ("DPM++ 2M KL Optimal", "training"),
                                        ("Heun KL Optimal", "spaced")])
def test_kl_optimal_sigma_are_even_in_atan_sigma(name, ends):
    """A1111's and ComfyUI's "KL Optimal" (Sabour et al. 2024): σ_i = tan((1 - i/(n-1)) atan σ_max + i/(n-1)
    atan σ_min), float64, written here from the formula. diffusers has no such schedule: the end points are the
    ones each scheduler's Karras σ span (Euler's and Heun's the spaced schedule's, DPM-Solver's the training range),
    and the timesteps follow the σ."""
    import math

    from sdflax.schedulers import common, scheduler_from_config

    config = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1,
              "timestep_spacing": "leading"}
    n = 9
    ours = scheduler_from_config(config, name)
    assert ours.config.use_kl_optimal_sigmas and common.sigma_schedule(ours.config) == "kl_optimal"
    state = ours.set_timesteps(n, shape=(1, 4, 8, 8))
    plain = scheduler_from_config(config, name.replace(" KL Optimal", "")).set_timesteps(n, shape=(1, 4, 8, 8))
    train = common.train_sigmas(ours.config)
    def levels(state):  # the n σ steps start from, descending (Heun repeats each; the final 0 left out)
        distinct = np.unique(np.asarray(state.sigmas, np.float64))[::-1]
        return distinct[distinct > 0]

    spaced = levels(plain)
    hi, lo = (spaced[0], spaced[-1]) if ends == "spaced" else (float(train[-1]), float(train[0]))
    ramp = np.arange(n) / (n - 1)
    expected = np.array([math.tan((1 - r) * math.atan(hi) + r * math.atan(lo)) for r in ramp])
    np.testing.assert_allclose(levels(state), expected, rtol=1e-6)
    assert np.abs(levels(state) - spaced).max() > 0.1  # not the spaced schedule


def test_align_your_steps_by_name_at_ten_steps_runs_diffusers_ays_sigmas(both):
    """A1111's "Euler Align Your Steps" at 10 steps: the images of diffusers' Euler given
    sigmas=AysSchedules["StableDiffusionSigmas"]; the pipeline picks its family's levels."""
    import diffusers

    theirs, ours, params, latents = both
    theirs.scheduler = diffusers.EulerDiscreteScheduler.from_config(theirs.scheduler.config)
    ours.scheduler = "euler a align your steps"  # case and spacing ignored
    assert ours.scheduler.config.align_your_steps == "sd1"
    ours.scheduler = "Euler Align Your Steps"
    assert ours.scheduler.config.align_your_steps == "sd1"
    expected = diffusers_images(theirs, latents, sigmas=AYS_SCHEDULES["StableDiffusionSigmas"])
    got = ours(ours.prepare_inputs(PROMPTS), params, jax.random.key(0), 10, latents=latents).images
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("family, n", [("sd1", 20), ("sd1", 4), ("sdxl", 10), ("sdxl", 7)])
def test_align_your_steps_for_any_step_count_is_log_linear_in_the_levels(family, n):
    """ComfyUI's AlignYourStepsScheduler (which A1111 follows), written here from its code in float64: the eleven
    levels (diffusers' ten-step σ and 0.029 where they end), interpolated in log σ at n + 1 evenly spaced
    positions, the last set to 0; at 10 steps diffusers' list itself."""
    from sdflax.schedulers import common, scheduler_from_config

    key = {"sd1": "StableDiffusionSigmas", "sdxl": "StableDiffusionXLSigmas"}[family]
    levels = np.array([*AYS_SCHEDULES[key][:-1], 0.029])
    expected = np.exp(np.interp(np.linspace(0, 1, n + 1), np.linspace(0, 1, 11), np.log(levels[::-1])))[::-1]
    expected[-1] = 0
    if n == 10:
        np.testing.assert_allclose(expected, AYS_SCHEDULES[key], rtol=1e-12)
    config = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1}
    scheduler = common.for_family(scheduler_from_config(config, "DPM++ 2M Align Your Steps"), family)
    assert scheduler.config.align_your_steps == family
    state = scheduler.set_timesteps(n, shape=(1, 4, 8, 8))
    np.testing.assert_allclose(np.asarray(state.sigmas), expected, rtol=1e-6)
    # the timesteps follow the σ (truncated, as DPM-Solver's other σ schedules)
    train = common.train_sigmas(scheduler.config)
    np.testing.assert_array_equal(np.asarray(state.timesteps),
                                  common.sigma_to_t(expected[:-1], np.log(train)).astype(np.int64))


@pytest.mark.parametrize("name, config, timesteps", [
    ("DDPMScheduler", {"clip_sample": False}, [999, 850, 600, 310, 90]),
    ("LCMScheduler", {}, [999, 759, 510, 259]),  # 510 is off LCM's grid of 50 (j·20 − 1): diffusers warns, runs it
    ("TCDScheduler", {"eta": 0.3}, [999, 759, 510, 259]),
])
def test_timesteps_equal_diffusers_step_by_step(monkeypatch, name, config, timesteps):
    """diffusers' DDPM, LCM and TCD `set_timesteps(timesteps=...)` step from each listed timestep to the next (the
    last to ᾱ = 1 or x̂₀); sdflax's the same, fed the same noise, and the list moves diffusers' samples from its
    spacing."""
    import diffusers
    from diffusers.schedulers import scheduling_ddpm, scheduling_lcm, scheduling_tcd

    from sdflax import schedulers

    schedule = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", **config}
    shape = (1, 4, 8, 8)
    rng = np.random.default_rng(0)
    x_t = rng.standard_normal(shape).astype(np.float32)
    noises = rng.standard_normal((len(timesteps), *shape)).astype(np.float32)
    module = {"DDPMScheduler": scheduling_ddpm, "LCMScheduler": scheduling_lcm, "TCDScheduler": scheduling_tcd}[name]
    extra = {"eta": config["eta"]} if "eta" in config else {}  # TCD's eta goes to diffusers' step

    def model(x, t):  # a stand-in UNet on numpy, torch and jax arrays alike
        return 0.9 * x + 0.02 * (t / 1000)

    def diffusers_samples(**steps):
        scheduler = getattr(diffusers, name).from_config({k: v for k, v in schedule.items() if k != "eta"})
        scheduler.set_timesteps(**steps)
        drawn = iter(torch.from_numpy(z) for z in noises)
        monkeypatch.setattr(module, "randn_tensor", lambda *args, **kwargs: next(drawn))
        x, out = torch.from_numpy(x_t), []
        for t in scheduler.timesteps:
            x = scheduler.step(model(x, float(t)), t, x, **extra).prev_sample
            out.append(x.numpy())
        return np.stack(out)

    scheduler = getattr(schedulers, name).from_config(schedule).with_schedule(timesteps=timesteps)
    state = scheduler.set_timesteps(len(timesteps))
    assert np.asarray(state.timesteps).tolist() == timesteps
    x, ours = jnp.asarray(x_t), []
    for i in range(len(timesteps)):
        x, state = scheduler.step(state, model(x, float(state.timesteps[i])), i, x,
                                  variance_noise=jnp.asarray(noises[i]))
        ours.append(np.asarray(x))
    expected = diffusers_samples(timesteps=timesteps)
    np.testing.assert_allclose(np.stack(ours), expected, rtol=0, atol=1e-5)
    assert np.abs(diffusers_samples(num_inference_steps=len(timesteps)) - expected).max() > 1e-2
