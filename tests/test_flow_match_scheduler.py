"""Parity of sdflax's flow-matching Euler (Stable Diffusion 3) with diffusers' FlowMatchEulerDiscreteScheduler:
schedules, custom σ, dynamic shifting, a sampling loop through sdflax.sampling.denoise, img2img's noising and cut."""

import json
from types import SimpleNamespace

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.pipelines.stable_diffusion_3 import pipeline_stable_diffusion_3 as sd3_pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img import (
    StableDiffusion3Img2ImgPipeline,
)
from diffusers.schedulers import scheduling_flow_match_euler_discrete as torch_module

from sdflax import sampling
from sdflax.models.config import ConfigError
from sdflax.schedulers import SCHEDULERS, FlowMatchEulerScheduler, scheduler_from_config
from sdflax.schedulers.flow_match_euler import img2img_start

# Stable Diffusion 3 (and 3.5)'s scheduler/scheduler_config.json, verbatim.
SD3 = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.29.0.dev0",
       "num_train_timesteps": 1000, "shift": 3.0}
DYNAMIC = {**SD3, "use_dynamic_shifting": True}
SHAPE = (2, 16, 8, 8)
rng = np.random.default_rng(0)
X_1, IMAGE, NOISE, SLOPE, TIME, BIAS = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(6))
MY_SIGMAS = [1.0, 0.9, 0.7, 0.45, 0.2]  # diffusers' custom σ: one per step, no final 0


def fake_model(x, t):
    """A fixed random linear function of x and t, as the transformer's velocity; operators only, so numpy and
    jax run the same arithmetic."""
    return SLOPE * 0.3 * x + TIME * (t / 1000) + 0.5 * BIAS


def theirs(config, n=None, sigmas=None, mu=None):
    sched = diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    sched.set_timesteps(n, sigmas=sigmas, mu=mu)
    return sched


def ours(config, sigmas=None, mu=None):
    sched = scheduler_from_config(config)
    sched = sched if sigmas is None else sched.with_schedule(sigmas=[*sigmas, 0.0])
    return sched if mu is None else sched.with_mu(mu)


def assert_same_schedule(state, sched):
    np.testing.assert_array_equal(np.asarray(state.timesteps), sched.timesteps.numpy())
    np.testing.assert_array_equal(np.asarray(state.sigmas), sched.sigmas.numpy())
    assert state.timesteps.dtype == state.sigmas.dtype == jnp.float32


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("n", [1, 2, 4, 28, 50])
def test_schedule_matches_diffusers(shift, n):
    config = {**SD3, "shift": shift}
    state = ours(config).set_timesteps(n)
    assert_same_schedule(state, theirs(config, n))
    assert state.init_noise_sigma == 1.0 and state.sigmas[-1] == 0


@pytest.mark.parametrize("extra", [{"shift_terminal": 0.1}, {"use_karras_sigmas": True},
                                   {"use_exponential_sigmas": True}, {"use_beta_sigmas": True},
                                   {"invert_sigmas": True}], ids=lambda extra: next(iter(extra)))
def test_config_options_match_diffusers(extra):
    config = {**SD3, **extra}
    state, sched = ours(config).set_timesteps(10), theirs(config, 10)
    np.testing.assert_allclose(np.asarray(state.timesteps), sched.timesteps.numpy(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(state.sigmas), sched.sigmas.numpy(), rtol=1e-6)


@pytest.mark.parametrize("config, mu", [(SD3, None), (DYNAMIC, 1.1)], ids=["shift", "dynamic"])
def test_custom_sigmas_match_diffusers(config, mu):
    state = ours(config, MY_SIGMAS, mu).set_timesteps(len(MY_SIGMAS))
    assert_same_schedule(state, theirs(config, sigmas=MY_SIGMAS, mu=mu))


@pytest.mark.parametrize("time_shift_type", ["exponential", "linear"])
@pytest.mark.parametrize("mu", [0.5, 0.93, 1.15])
def test_dynamic_shift_matches_diffusers(time_shift_type, mu):
    config = {**DYNAMIC, "time_shift_type": time_shift_type}
    assert_same_schedule(ours(config, mu=mu).set_timesteps(12), theirs(config, 12, mu=mu))


@pytest.mark.parametrize("height", [512, 1024])
def test_mu_from_the_image_size_is_diffusers_pipelines(height):
    """SD3's pipeline: image_seq_len = (h / 8 / patch 2) (w / 8 / patch 2), mu = calculate_shift(that, config)."""
    seq_len = (height // 16) ** 2
    mu = sd3_pipeline.calculate_shift(seq_len, 256, 4096, 0.5, 1.15)
    sched = ours(DYNAMIC).for_image_seq_len(seq_len)
    assert sched.config.mu == pytest.approx(mu, rel=1e-12)
    assert_same_schedule(sched.set_timesteps(8), theirs(DYNAMIC, 8, mu=mu))
    assert sched.for_image_seq_len(1) is sched  # a given mu stays
    assert ours(SD3).for_image_seq_len(seq_len) == ours(SD3)  # a fixed shift takes none


def their_loop(config, n, start=0, mu=None, sigmas=None):
    """diffusers' SD3 loop from X_1 (or, from `start`, IMAGE noised by scale_noise), and each step's x̂₀."""
    sched = theirs(config, n, sigmas=sigmas, mu=mu)
    sched.set_begin_index(start)
    timesteps = sched.timesteps[start:]
    x = torch.from_numpy(X_1)
    if start:
        x = sched.scale_noise(torch.from_numpy(IMAGE), timesteps[:1].repeat(SHAPE[0]), torch.from_numpy(NOISE))
    samples, x0s = [], []
    for t in timesteps:
        v = torch.from_numpy(fake_model(x.numpy(), np.float32(t)))
        x0s.append((x - sched.sigmas[sched.step_index or start] * v).numpy())
        x = sched.step(v, t, x).prev_sample
        samples.append(x.numpy())
    return np.stack(samples), np.stack(x0s)


def our_loop(config, n, start=0, mu=None, sigmas=None):
    sched = ours(config, sigmas, mu)
    state = sched.set_timesteps(n, shape=SHAPE, start=start)
    x = jnp.asarray(X_1) * state.init_noise_sigma
    if start:
        x = sched.add_noise(state, jnp.asarray(IMAGE), jnp.asarray(NOISE), 0)
    _, trajectory = sampling.denoise(fake_model, sched, x, n, jax.random.key(0), return_trajectory=True,
                                     state=state)
    return np.asarray(trajectory.latents), np.asarray(trajectory.pred_x0)


@pytest.mark.parametrize("config, n, start, mu, sigmas", [
    (SD3, 4, 0, None, None),
    ({**SD3, "shift": 1.0}, 4, 0, None, None),
    (DYNAMIC, 4, 0, 0.8, None),
    (SD3, 5, 0, None, MY_SIGMAS),
    (SD3, 10, 6, None, None),  # img2img at strength 0.4
], ids=["sd3", "no-shift", "dynamic", "custom-sigmas", "img2img"])
def test_sampling_loop_matches_diffusers(config, n, start, mu, sigmas):
    our_samples, our_x0 = our_loop(config, n, start, mu, sigmas)
    their_samples, their_x0 = their_loop(config, n, start, mu, sigmas)
    assert our_samples.shape == (n - start, *SHAPE) and np.isfinite(their_samples).all()
    np.testing.assert_allclose(our_samples, their_samples, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(our_x0, their_x0, rtol=1e-6, atol=1e-6)


def test_scale_noise_matches_diffusers():
    sched, their = ours(SD3), theirs(SD3, 10)
    state = sched.set_timesteps(10)
    for i in range(10):
        their.set_begin_index(i)
        expected = their.scale_noise(torch.from_numpy(IMAGE), their.timesteps[i:i + 1], torch.from_numpy(NOISE))
        noisy = sched.add_noise(state, jnp.asarray(IMAGE), jnp.asarray(NOISE), i)
        np.testing.assert_allclose(np.asarray(noisy), expected.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [1, 4, 10, 28])
@pytest.mark.parametrize("strength", [0.05, 0.3, 0.55, 0.6, 0.9, 1.0])
def test_img2img_cut_matches_diffusers(n, strength):
    their = theirs(SD3, n)
    timesteps, steps_left = StableDiffusion3Img2ImgPipeline.get_timesteps(
        SimpleNamespace(scheduler=their), n, strength, "cpu")
    start = img2img_start(n, strength)
    assert n - start == steps_left >= 1
    np.testing.assert_array_equal(np.asarray(ours(SD3).set_timesteps(n, start=start).timesteps), timesteps.numpy())


def test_stochastic_sampling_matches_diffusers(monkeypatch):
    config, z = {**SD3, "stochastic_sampling": True}, np.random.default_rng(7).standard_normal(SHAPE)
    z = z.astype(np.float32)
    monkeypatch.setattr(torch_module, "randn_tensor", lambda *args, **kwargs: torch.from_numpy(z))
    their, sched = theirs(config, 4), ours(config)
    state = sched.set_timesteps(4)
    v = fake_model(X_1, np.float32(their.timesteps[1]))
    their.set_begin_index(1)
    expected = their.step(torch.from_numpy(v), their.timesteps[1], torch.from_numpy(X_1)).prev_sample
    prev, _ = sched.step(state, jnp.asarray(v), 1, jnp.asarray(X_1), variance_noise=jnp.asarray(z))
    np.testing.assert_allclose(np.asarray(prev), expected.numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="key"):
        sched.step(state, jnp.asarray(v), 1, jnp.asarray(X_1))


def test_registry_and_saved_configs():
    assert SCHEDULERS["flow_match_euler"] is FlowMatchEulerScheduler
    assert type(scheduler_from_config(SD3)) is FlowMatchEulerScheduler
    assert type(scheduler_from_config({}, kind="flow_match_euler")) is FlowMatchEulerScheduler
    saved = json.loads(diffusers.FlowMatchEulerDiscreteScheduler.from_config(DYNAMIC).to_json_string())
    sched = scheduler_from_config(saved)
    assert sched.config.use_dynamic_shifting and sched.config.shift == 3.0 and sched.config.max_shift == 1.15
    assert scheduler_from_config(SD3, overrides={"shift": 5.0}).config.shift == 5.0
    assert ours(SD3) == ours(dict(SD3)) and hash(ours(SD3)) == hash(ours(dict(SD3)))


def test_bad_input_is_one_clear_line():
    with pytest.raises(ValueError, match="needs mu: scheduler.for_image_seq_len"):
        ours(DYNAMIC).check_steps(4)
    with pytest.raises(ValueError, match="needs mu"):
        ours(DYNAMIC).set_timesteps(4)
    with pytest.raises(ValueError, match="mu=nan must be a finite number"):
        ours(DYNAMIC).with_mu(float("nan"))
    with pytest.raises(ValueError, match="not timesteps"):
        ours(SD3).with_schedule(timesteps=[999, 500])
    with pytest.raises(ValueError, match="end at 0"):
        ours(SD3).with_schedule(sigmas=MY_SIGMAS)
    with pytest.raises(ValueError, match="custom schedule has 5 steps"):
        ours(SD3, MY_SIGMAS).check_steps(4)
    with pytest.raises(ValueError, match=r"num_inference_steps must be in \[1, 1000\]"):
        ours(SD3).check_steps(0)
    for key, value in [("time_shift_type", "cosine"), ("shift", 0.0), ("use_dynamic_shifting", "yes")]:
        with pytest.raises(ConfigError, match=key):
            scheduler_from_config({**SD3, key: value})
    with pytest.raises(ConfigError, match="choose one σ schedule"):
        scheduler_from_config({**SD3, "use_karras_sigmas": True, "use_beta_sigmas": True})
    with pytest.raises(ValueError, match="strength must be in"):
        img2img_start(10, 0.0)


def test_bfloat16_sample_keeps_dtype_and_model_input_is_the_sample():
    sched = ours(SD3)
    state = sched.set_timesteps(4)
    x = jnp.asarray(X_1, jnp.bfloat16)
    prev, _ = sched.step(state, x, 0, x)
    assert prev.dtype == jnp.bfloat16 and sched.scale_model_input(state, x, 0) is x
    assert sched.predict_x0(state, x, 0, x).dtype == jnp.float32


def test_a_unet_pipeline_refuses_the_flow_scheduler():
    """SD 1.x / 2.x / SDXL UNets predict noise (or v): a velocity sampler on them is refused at once."""
    from builders import SD1, SD14_SCHEDULER, TOKENIZER

    import sdflax
    from sdflax.loading.folders import load_tokenizer
    from sdflax.models import AutoencoderKL, CLIPTextModel, UNet2DConditionModel
    from sdflax.schedulers import DDIMScheduler

    pipe = sdflax.StableDiffusion(
        text_encoder=CLIPTextModel.from_config(SD1["text_encoder"]), unet=UNet2DConditionModel.from_config(SD1["unet"]),
        vae=AutoencoderKL.from_config(SD1["vae"]), tokenizer=load_tokenizer(str(TOKENIZER)),
        scheduler=DDIMScheduler.from_config(SD14_SCHEDULER))
    with pytest.raises(ValueError, match="FlowMatchEulerScheduler is a flow-matching scheduler, for SD 3.x"):
        pipe.scheduler = "flow_match_euler"


def test_a1111_euler_on_a_flow_config_is_the_flows_euler_and_names_itself_so():
    from sdflax.schedulers import EulerScheduler, a1111_name, scheduler_from_config

    flow = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "num_train_timesteps": 1000}
    for name, karras in (("Euler", False), ("Euler Karras", True)):
        scheduler = scheduler_from_config(flow, name)
        assert type(scheduler) is FlowMatchEulerScheduler and scheduler.config.shift == 3.0
        assert scheduler.config.use_karras_sigmas is karras
        assert a1111_name(scheduler) == name
    assert a1111_name(scheduler_from_config(flow)) == "Euler"
    assert a1111_name(scheduler_from_config({**flow, "stochastic_sampling": True})) is None  # A1111 has no name
    # on an ε / v config "Euler" stays k-diffusion's Euler
    ddpm = {"_class_name": "PNDMScheduler", "num_train_timesteps": 1000, "beta_schedule": "scaled_linear"}
    assert type(scheduler_from_config(ddpm, "Euler")) is EulerScheduler


def test_a1111_kl_optimal_on_a_flow_config_is_honoured_and_align_your_steps_refused():
    """Both gave plain Euler's σ while the name said otherwise: KL Optimal places the flow's σ evenly in atan σ
    between the shifted end points (as Karras does its own); Align Your Steps' levels are SD 1.x's and SDXL's."""
    from sdflax.schedulers import a1111_name, sigma_schedules

    flow = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "num_train_timesteps": 1000}
    plain = scheduler_from_config(flow, "Euler").schedule(6)[1]
    scheduler = scheduler_from_config(flow, "euler  kl optimal")
    timesteps, sigmas = scheduler.schedule(6)
    assert a1111_name(scheduler) == "Euler KL Optimal"
    expected = sigma_schedules.kl_optimal_sigmas(plain[-2], plain[0], 6).astype(np.float32)
    np.testing.assert_allclose(sigmas, [*expected, 0], rtol=1e-6)
    np.testing.assert_allclose(timesteps, expected * 1000, rtol=1e-6)
    assert np.abs(sigmas[1:-2] - plain[1:-2]).min() > 0.05  # not Euler's
    with pytest.raises(ValueError) as info:
        scheduler_from_config(flow, "Euler Align Your Steps")
    assert str(info.value) == ("scheduler 'Euler Align Your Steps': Align Your Steps' noise levels are SD 1.x's and "
                               "SDXL's, not a flow model's (SD 3.x): use Euler, or Euler with Karras, Exponential, "
                               "Beta or KL Optimal")
