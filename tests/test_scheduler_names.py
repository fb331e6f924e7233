"""A1111 sampler names resolve to the schedulers and configs diffusers' scheduler overview names, and back."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest

from sdflax.cli import png_info
from sdflax.schedulers import SCHEDULERS, a1111_name, names, scheduler_from_config

SD1 = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
       "steps_offset": 1, "_class_name": "PNDMScheduler", "skip_prk_steps": True}

# diffusers' scheduler overview: A1111 name -> (diffusers class, arguments)
OVERVIEW = {
    "DPM++ 2M": (diffusers.DPMSolverMultistepScheduler, {}),
    "DPM++ 2M Karras": (diffusers.DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
    "DPM++ 2M SDE": (diffusers.DPMSolverMultistepScheduler, {"algorithm_type": "sde-dpmsolver++"}),
    "DPM++ 2M SDE Karras": (diffusers.DPMSolverMultistepScheduler,
                            {"use_karras_sigmas": True, "algorithm_type": "sde-dpmsolver++"}),
    "DPM++ SDE": (diffusers.DPMSolverSDEScheduler, {}),
    "DPM++ SDE Karras": (diffusers.DPMSolverSDEScheduler, {"use_karras_sigmas": True}),
    "DPM2": (diffusers.KDPM2DiscreteScheduler, {}),
    "DPM2 Karras": (diffusers.KDPM2DiscreteScheduler, {"use_karras_sigmas": True}),
    "DPM2 a": (diffusers.KDPM2AncestralDiscreteScheduler, {}),
    "DPM2 a Karras": (diffusers.KDPM2AncestralDiscreteScheduler, {"use_karras_sigmas": True}),
    "Euler": (diffusers.EulerDiscreteScheduler, {}),
    "Euler a": (diffusers.EulerAncestralDiscreteScheduler, {}),
    "Heun": (diffusers.HeunDiscreteScheduler, {}),
    "LMS": (diffusers.LMSDiscreteScheduler, {}),
    "LMS Karras": (diffusers.LMSDiscreteScheduler, {"use_karras_sigmas": True}),
    "UniPC": (diffusers.UniPCMultistepScheduler, {}),
    "DEIS": (diffusers.DEISMultistepScheduler, {}),
    "DDIM": (diffusers.DDIMScheduler, {}),
    "PLMS": (diffusers.PNDMScheduler, {}),
    "Euler Exponential": (diffusers.EulerDiscreteScheduler, {"use_exponential_sigmas": True}),
    "DPM++ 2M Beta": (diffusers.DPMSolverMultistepScheduler, {"use_beta_sigmas": True}),
    "Euler a SGM Uniform": (diffusers.EulerAncestralDiscreteScheduler, {"timestep_spacing": "trailing"}),
}


@pytest.mark.parametrize("name", sorted(OVERVIEW))
def test_names_give_diffusers_schedules(name):
    """The same class family and the same timesteps as diffusers' class with the overview's arguments, starting
    from a checkpoint config whose own choices the name overrides (Karras on, the SDE algorithm)."""
    cls, kwargs = OVERVIEW[name]
    checkpoint = {**SD1, "use_karras_sigmas": "Karras" not in name, "algorithm_type": "dpmsolver++"}
    ours = scheduler_from_config(checkpoint, name)
    theirs = cls.from_config({**SD1, **kwargs})
    theirs.set_timesteps(10)
    state = ours.set_timesteps(10, shape=(1, 4, 8, 8))
    np.testing.assert_allclose(np.asarray(state.timesteps, np.float64), theirs.timesteps.numpy(), rtol=0, atol=1e-3)
    for key, value in kwargs.items():
        assert getattr(ours.config, key) == value, key
    assert a1111_name(ours) == name  # "Euler a SGM Uniform" too: trailing spacing is part of the name


def test_every_name_and_schedule_round_trips():
    count = 0
    for sampler, (kind, _) in names.SAMPLERS.items():
        for suffix in ("", *names.SIGMA_SCHEDULES, names.SGM_UNIFORM):
            name = f"{sampler} {suffix}".strip()
            try:
                scheduler = scheduler_from_config(SD1, name.upper())  # case and spacing are ignored
            except ValueError as e:
                assert suffix and f"{sampler} has no {suffix} σ schedule" in str(e)
                continue
            assert type(scheduler) is SCHEDULERS[kind]
            assert a1111_name(scheduler) == name
            count += 1
    assert count >= 75


def parameters_line(tmp_path, sampler):
    from PIL import Image

    settings = {"prompt": "a fox", "negative_prompt": "", "steps": 20, "scheduler": "dpmpp_2m", "sampler": sampler,
                "guidance_scale": 7.5, "seed": 3, "width": 512, "height": 512, "model": "m"}
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png", pnginfo=png_info(settings))
    return Image.open(tmp_path / "x.png").text["parameters"]


def test_parameters_line_names_the_sampler(tmp_path):
    assert "\nSteps: 20, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7.5, Seed: 3," in parameters_line(
        tmp_path, "DPM++ 2M Karras")


def test_the_tables_dpmpp_2m_sde_heun_spelling_is_a_name():
    """Friction: README's table names the sampler "DPM++ 2M SDE (Heun)", which the CLI and the API refused."""
    for name, flag in (("DPM++ 2M SDE (Heun)", None), ("dpm++ 2m sde (heun) Karras", "use_karras_sigmas")):
        scheduler = scheduler_from_config({**SD1, "use_karras_sigmas": flag is None}, name)
        assert type(scheduler) is SCHEDULERS["dpmpp_2m_sde"] and scheduler.config.solver_type == "heun"
        assert scheduler.config.use_karras_sigmas == (flag is not None)
    assert a1111_name(scheduler_from_config(SD1, "DPM++ 2M SDE (Heun)")) == "DPM++ 2M SDE Heun"


def test_parameters_line_writes_the_schedule_type_that_runs_the_same_schedule(tmp_path):
    """Friction: "Euler a SGM Uniform" was written "Sampler: Euler a", which A1111 runs with leading spacing.
    A1111 1.9+ writes `Sampler: S, Schedule type: T` and reads a missing type as the sampler's "Automatic" (Karras
    for DPM++ 2M): every sampler with σ schedules gets its type written out, and sampler + type read back by
    sdflax is the scheduler that wrote it."""
    import re

    assert "Sampler: Euler a, Schedule type: SGM Uniform, CFG" in parameters_line(tmp_path, "Euler a SGM Uniform")
    assert "Sampler: DPM++ 2M, Schedule type: Uniform, CFG" in parameters_line(tmp_path, "DPM++ 2M")
    assert "Sampler: PLMS, CFG" in parameters_line(tmp_path, "PLMS")  # A1111's PLMS has no schedule types
    for sampler, (kind, _) in names.SAMPLERS.items():
        for suffix in ("", *names.SIGMA_SCHEDULES, names.SGM_UNIFORM):
            try:
                scheduler = scheduler_from_config(SD1, f"{sampler} {suffix}")
            except ValueError:
                continue  # no such σ schedule for this sampler
            line = parameters_line(tmp_path, a1111_name(scheduler))
            written, schedule = re.search(r"Sampler: ([^,]+), (?:Schedule type: ([^,]+), )?CFG", line).groups()
            assert written == sampler
            assert schedule == (suffix or ("Uniform" if "use_karras_sigmas" in dir(scheduler.config) else None))
            again = scheduler_from_config(SD1, f"{written} {schedule or ''}")
            assert type(again) is type(scheduler) and again.config == scheduler.config, line


def test_sdflax_names_keep_the_config_and_overrides_win():
    karras = {**SD1, "use_karras_sigmas": True}
    assert scheduler_from_config(karras, "euler").config.use_karras_sigmas  # "euler" is sdflax's, not A1111's
    assert scheduler_from_config(karras, "lms").config.use_karras_sigmas
    assert not scheduler_from_config(karras, "LMS").config.use_karras_sigmas  # A1111's spelling: its meaning
    assert not scheduler_from_config(karras, "DPM++ 2M").config.use_karras_sigmas  # A1111's name says no Karras
    assert scheduler_from_config(SD1, "DPM++ 2M", {"use_karras_sigmas": True}).config.use_karras_sigmas


@pytest.mark.parametrize("schedule", ["Karras", "Exponential", "Beta"])
def test_euler_a_with_a_sigma_schedule_is_k_diffusions_sampler(schedule):
    """diffusers' Euler ancestral has no σ schedules; "Euler a Karras" is k-diffusion's sample_euler_ancestral on
    Euler's Karras σ (written out here in float64, with the same noise)."""
    import jax.numpy as jnp

    ours = scheduler_from_config(SD1, f"Euler a {schedule}")
    sigmas = np.asarray(scheduler_from_config(SD1, f"Euler {schedule}").set_timesteps(6).sigmas, np.float64)
    state = ours.set_timesteps(6)
    np.testing.assert_array_equal(np.asarray(state.sigmas, np.float64), sigmas)
    assert np.abs(sigmas - np.asarray(scheduler_from_config(SD1, "Euler a").set_timesteps(6).sigmas)).max() > 1e-2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, 8, 8)) * sigmas[0]
    expected, got = x.copy(), jnp.asarray(x, jnp.float32)
    for i in range(6):
        eps = np.tanh(expected) * 0.5  # a stand-in model output (epsilon)
        noise = rng.standard_normal(x.shape)
        denoised = expected - sigmas[i] * eps
        up = min(sigmas[i + 1], np.sqrt(sigmas[i + 1] ** 2 * (sigmas[i] ** 2 - sigmas[i + 1] ** 2) / sigmas[i] ** 2))
        down = np.sqrt(sigmas[i + 1] ** 2 - up ** 2)
        expected = expected + (expected - denoised) / sigmas[i] * (down - sigmas[i]) + noise * up
        got, state = ours.step(state, jnp.tanh(got) * 0.5, i, got, variance_noise=jnp.asarray(noise, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=1e-4 * np.abs(expected).max())
