"""Parity of the DDPM, LCM and TCD samplers with diffusers' PyTorch DDPMScheduler, LCMScheduler and TCDScheduler,
step by step (every model input, x̂₀ and sample at float32, stochastic steps fed the same noise); img2img starts;
jit + scan; the Scheduler protocol; the step-count check; their noise; LCM images through the pipeline."""

import json
from functools import partial

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.schedulers import scheduling_ddpm, scheduling_lcm, scheduling_tcd
from test_pipeline import ATOL, NEGATIVE, run_both
from test_schedulers import SD14, SHAPE, X_T, fake_model, outcome
from test_sigma_schedulers import (IMAGE, IMAGE_NOISE, SD1, assert_scan_equals_eager, atol_for,
                                   noises_for, run_ours)
from test_sigma_schedulers import test_every_scheduler_follows_the_protocol as follows_the_protocol

from sdflax import random_draws
from sdflax.schedulers import (
    DDPMScheduler,
    LCMScheduler,
    TCDScheduler,
    common,
    scheduler_from_config,
)

TORCH = {DDPMScheduler: diffusers.DDPMScheduler, LCMScheduler: diffusers.LCMScheduler,
         TCDScheduler: diffusers.TCDScheduler}
NOISE_MODULES = {DDPMScheduler: scheduling_ddpm, LCMScheduler: scheduling_lcm, TCDScheduler: scheduling_tcd}

V_PRED = {"prediction_type": "v_prediction"}
SAMPLE_PRED = {"prediction_type": "sample"}
TRAILING = {"timestep_spacing": "trailing"}
LINSPACE = {"timestep_spacing": "linspace"}
ZERO_SNR = {**V_PRED, "rescale_betas_zero_snr": True}  # ᾱ_{T-1} = 0: only v-prediction defines x̂_0 there


def torch_config(config):
    return {k: v for k, v in config.items() if k != "eta"}  # TCD's eta goes to diffusers' step, not its config


def run_diffusers(cls, config, n, noises, monkeypatch, start=0):
    """diffusers' loop as its pipelines run it (txt2img, or img2img from step `start` as
    StableDiffusionImg2ImgPipeline: set_begin_index where the class has it, add_noise at timesteps[start]).
    Step k's randn_tensor returns noises[k]; returns timesteps, per-step arrays and the steps that drew noise."""
    sched = TORCH[cls].from_config(torch_config(config))
    sched.set_timesteps(n)
    current, drew = [0], []

    def randn(shape, **kwargs):
        drew.append(current[0])
        return torch.from_numpy(noises[current[0]])

    monkeypatch.setattr(NOISE_MODULES[cls], "randn_tensor", randn)
    if start:
        if hasattr(sched, "set_begin_index"):
            sched.set_begin_index(start)
        x = sched.add_noise(torch.from_numpy(IMAGE), torch.from_numpy(IMAGE_NOISE), sched.timesteps[start:start + 1])
    else:
        x = torch.from_numpy(X_T) * sched.init_noise_sigma
    kwargs = {"eta": config.get("eta", 0.0)} if cls is TCDScheduler else {}
    out = {"inputs": [], "samples": [], "x0": []}
    for k, t in enumerate(sched.timesteps[start:]):
        current[0] = k
        model_input = sched.scale_model_input(x, t)
        prediction = torch.from_numpy(fake_model(model_input.numpy(), float(t)))
        result = sched.step(prediction, t, x, **kwargs)
        if cls is DDPMScheduler:
            x0 = result.pred_original_sample
        elif cls is LCMScheduler:
            x0 = result.denoised  # the consistency function c_skip x + c_out x̂_0
        else:  # TCD returns no x̂_0: diffusers' own formula with its ᾱ_t
            a = sched.alphas_cumprod[t]
            x0 = {"epsilon": (x - (1 - a) ** 0.5 * prediction) / a**0.5, "sample": prediction,
                  "v_prediction": a**0.5 * x - (1 - a) ** 0.5 * prediction}[config.get("prediction_type", "epsilon")]
        x = result.prev_sample
        for name, value in (("inputs", model_input), ("samples", x), ("x0", x0)):
            out[name].append(value.numpy())
    return sched.timesteps[start:].numpy(), {k: np.stack(v) for k, v in out.items()}, drew


def assert_parity(cls, config, n, monkeypatch, start=0):
    noises = noises_for(n - start)
    their_t, theirs, drew = run_diffusers(cls, config, n, noises, monkeypatch, start)
    our_t, init_noise_sigma, ours = run_ours(cls, config, n, noises, start)
    state = cls.from_config(config).set_timesteps(n, shape=SHAPE, start=start)
    assert our_t.dtype == np.int32
    np.testing.assert_array_equal(our_t, their_t)
    assert init_noise_sigma == 1.0
    # The steps that add noise are the ones where diffusers draws it: a static flag says whether any does.
    assert state.stochastic == bool(drew)
    for name in ("inputs", "x0", "samples"):
        assert ours[name].dtype == np.float32 and ours[name].shape == theirs[name].shape, name
        assert np.isfinite(theirs[name]).all(), name
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=atol_for(config), err_msg=name)
    return drew


# name: (config, n, the (config, n) it differs from in one setting, or None)
DDPM_CASES = {
    "sd1-10": (SD1, 10, None),  # leading, steps_offset 1, clip_sample, fixed_small
    "sd1-1": (SD1, 1, None),
    "no-clip": ({**SD1, "clip_sample": False}, 10, (SD1, 10)),
    "clip-range-2": ({**SD1, "clip_sample_range": 2.0}, 10, (SD1, 10)),
    "v-pred": ({**SD1, **V_PRED}, 10, (SD1, 10)),
    "sample-pred": ({**SD1, **SAMPLE_PRED}, 10, (SD1, 10)),
    "trailing-7": ({**SD1, **TRAILING}, 7, (SD1, 7)),
    "linspace-7": ({**SD1, **LINSPACE}, 7, (SD1, 7)),
    "fixed-large": ({**SD1, "variance_type": "fixed_large"}, 10, (SD1, 10)),
    # exp(½ log β̃) is √β̃ in exact arithmetic: the same samples as fixed_small but for rounding (checked below)
    "fixed-small-log": ({**SD1, "variance_type": "fixed_small_log"}, 10, None),
    "zero-snr": ({**SD1, **TRAILING, **ZERO_SNR}, 10, ({**SD1, **TRAILING, **V_PRED}, 10)),
    "linear-defaults": ({}, 10, None),
}
LCM_CASES = {
    "sd1-1": (SD1, 1, None),
    "sd1-2": (SD1, 2, None),
    "sd1-4": (SD1, 4, None),
    "sd1-8": (SD1, 8, None),
    "original-20": ({**SD1, "original_inference_steps": 20}, 4, (SD1, 4)),
    "v-pred": ({**SD1, **V_PRED}, 4, (SD1, 4)),
    "sample-pred": ({**SD1, **SAMPLE_PRED}, 4, (SD1, 4)),
    "clip-sample": ({**SD1, "clip_sample": True}, 4, (SD1, 4)),
    # at the default scaling 10, c_skip(t) < 1e-6 for every t on the grid: a small one makes the boundary
    # condition's weights matter
    "timestep-scaling": ({**SD1, "timestep_scaling": 0.05}, 4, (SD1, 4)),
    "zero-snr": ({**SD1, **ZERO_SNR}, 4, ({**SD1, **V_PRED}, 4)),
    "linear": ({"beta_schedule": "linear", "beta_start": 0.0001, "beta_end": 0.02}, 4, (SD1, 4)),
}
ETA = {"eta": 0.3}
TCD_CASES = {
    "eta-0": ({**SD1, "eta": 0.0}, 4, None),
    "eta-0.3": ({**SD1, **ETA}, 4, ({**SD1, "eta": 0.0}, 4)),
    "eta-0.3-8": ({**SD1, **ETA}, 8, ({**SD1, "eta": 0.0}, 8)),
    "eta-0.3-1": ({**SD1, **ETA}, 1, None),  # one step maps to s = 0 whatever γ
    "eta-1": ({**SD1, "eta": 1.0}, 4, ({**SD1, **ETA}, 4)),
    "original-20": ({**SD1, **ETA, "original_inference_steps": 20}, 4, ({**SD1, **ETA}, 4)),
    "v-pred": ({**SD1, **ETA, **V_PRED}, 4, ({**SD1, **ETA}, 4)),
    "sample-pred": ({**SD1, **ETA, **SAMPLE_PRED}, 4, ({**SD1, **ETA}, 4)),
    "zero-snr": ({**SD1, **ETA, **ZERO_SNR}, 4, ({**SD1, **ETA, **V_PRED}, 4)),
}
CASES = {DDPMScheduler: DDPM_CASES, LCMScheduler: LCM_CASES, TCDScheduler: TCD_CASES}
ALL_CASES = [pytest.param(cls, name, id=f"{cls.__name__[:-9].lower()}-{name}")
             for cls, cases in CASES.items() for name in cases]


@pytest.mark.parametrize("cls, name", ALL_CASES)
def test_matches_diffusers_step_by_step(cls, name, monkeypatch):
    config, n, _ = CASES[cls][name]
    drew = assert_parity(cls, config, n, monkeypatch)
    if cls is LCMScheduler:
        assert drew == list(range(n - 1))  # re-noised between steps, not after the last
    if cls is TCDScheduler:
        assert drew == (list(range(n - 1)) if config["eta"] > 0 else [])


@pytest.mark.parametrize("cls, name", [p for p in ALL_CASES if CASES[p.values[0]][p.values[1]][2] is not None])
def test_each_setting_changes_diffusers_output(cls, name, monkeypatch):
    """Every setting the parity cases vary changes diffusers' samples well beyond the tolerance (a setting that
    did nothing would test nothing): each case against the case without it, with the same noise."""
    config, n, (base, base_n) = CASES[cls][name]
    assert base_n == n
    theirs = run_diffusers(cls, config, n, noises_for(n), monkeypatch)[1]["samples"]
    baseline = run_diffusers(cls, base, n, noises_for(n), monkeypatch)[1]["samples"]
    assert np.abs(theirs - baseline).max() > 1e-3


def test_ddpm_fixed_small_log_is_fixed_small_up_to_rounding(monkeypatch):
    noises = noises_for(10)
    small = run_diffusers(DDPMScheduler, SD1, 10, noises, monkeypatch)[1]["samples"]
    small_log = run_diffusers(DDPMScheduler, DDPM_CASES["fixed-small-log"][0], 10, noises, monkeypatch)[1]["samples"]
    np.testing.assert_allclose(small_log, small, rtol=0, atol=1e-5)


@pytest.mark.parametrize("config", [SD1, {**SD1, "variance_type": "fixed_large"}, {**SD1, "steps_offset": 0}],
                         ids=["offset-1", "offset-1-fixed-large", "offset-0"])
def test_ddpm_adds_noise_where_diffusers_draws_it(config, monkeypatch):
    """diffusers adds noise wherever t > 0: with steps_offset 1 the last step (t = 1, ᾱ_{t'} = 1) too, with σ ~1e-10
    for fixed_small but √β_1 for fixed_large; with steps_offset 0 the last step is at t = 0 and noise-free."""
    n = 10
    drew = run_diffusers(DDPMScheduler, config, n, noises_for(n), monkeypatch)[2]
    state = DDPMScheduler.from_config(config).set_timesteps(n)
    assert list(np.flatnonzero(np.asarray(state.noise_std) > 0)) == drew
    theirs = diffusers.DDPMScheduler.from_config(config)
    theirs.set_timesteps(n)
    for i in drew:
        std = float(theirs._get_variance(int(theirs.timesteps[i]))) ** 0.5
        assert float(state.noise_std[i]) == pytest.approx(std, rel=1e-6)


@pytest.mark.parametrize("cls, config", [
    (DDPMScheduler, SD1),
    (DDPMScheduler, {**SD1, **V_PRED, **TRAILING}),
    (LCMScheduler, SD1),
    (TCDScheduler, {**SD1, **ETA}),
], ids=["ddpm", "ddpm-v-trailing", "lcm", "tcd-eta-0.3"])
@pytest.mark.parametrize("start", [2, 5])
def test_img2img_start_matches_diffusers(cls, config, start, monkeypatch):
    """set_timesteps(n, start=k) + add_noise(state, x_0, ε, 0), as diffusers' StableDiffusionImg2ImgPipeline:
    set_begin_index(k) (LCM, TCD; DDPM finds each step's successor by value), add_noise at timesteps[k], then the
    remaining steps, the last still returning the denoised sample."""
    n = 8
    drew = assert_parity(cls, config, n, monkeypatch, start=start)
    if cls is not DDPMScheduler:
        assert drew == list(range(n - start - 1))
    with pytest.raises(ValueError, match="start"):
        cls.from_config(config).set_timesteps(n, shape=SHAPE, start=n)


@pytest.mark.parametrize("cls, config", [
    (DDPMScheduler, SD1),
    (LCMScheduler, SD1),
    (TCDScheduler, {**SD1, **ETA}),
    (TCDScheduler, SD1),
], ids=["ddpm", "lcm", "tcd-eta-0.3", "tcd-eta-0"])
def test_jit_scan_equals_eager(cls, config):
    assert_scan_equals_eager(cls.from_config(config), 8, 1e-5)


@pytest.mark.parametrize("name", ["ddpm", "lcm", "tcd"])
def test_follows_the_protocol(name):
    """test_sigma_schedulers' protocol check (isinstance, hashable config, a compiled scan over exactly the
    protocol's calls), for these three as registered in SCHEDULERS."""
    follows_the_protocol(name)


# ---- noise: keys, variance, errors -----------------------------------------------------------------------------


def their_noise_std(cls, config, n, i):
    """The std of step i's fresh noise from diffusers' own tables."""
    theirs = TORCH[cls].from_config(torch_config(config))
    theirs.set_timesteps(n)
    a = theirs.alphas_cumprod
    t, t_next = int(theirs.timesteps[i]), int(theirs.timesteps[i + 1])
    if cls is DDPMScheduler:
        return float(theirs._get_variance(t)) ** 0.5
    if cls is LCMScheduler:
        return float(1 - a[t_next]) ** 0.5
    s = int(np.floor((1 - config["eta"]) * t_next))
    return float(1 - a[t_next] / a[s]) ** 0.5


@pytest.mark.parametrize("cls, config", [(DDPMScheduler, SD1), (LCMScheduler, SD1), (TCDScheduler, {**SD1, **ETA})],
                         ids=["ddpm", "lcm", "tcd"])
def test_keys_and_variance(cls, config):
    sched = cls.from_config(config)
    shape = (2, 4, 100, 250)  # 200k elements
    n, i = 8, 2
    state = sched.set_timesteps(n, shape=shape)
    x = jax.random.normal(jax.random.key(3), shape)
    step = partial(sched.step, state, 0.9 * x, i, x)
    a, _ = step(key=jax.random.key(1))
    a_again, _ = step(key=jax.random.key(1))
    b, _ = step(key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a_again))
    # a - b = σ (z_a - z_b): var = 2 σ²
    std = their_noise_std(cls, config, n, i)
    assert std > 0.1  # the noise is not negligible at this step
    measured = float(np.var(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
    assert measured == pytest.approx(2 * std**2, rel=0.02)
    # One key per image: image b's noise is what a batch of one with key b draws.
    keys = jax.random.split(jax.random.key(4), 2)
    both, _ = sched.step(state, 0.9 * x, i, x, key=keys)
    one, _ = sched.step(state, 0.9 * x[1:], i, x[1:], key=keys[1])
    np.testing.assert_allclose(np.asarray(both[1:]), np.asarray(one), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cls, config", [(DDPMScheduler, SD1), (LCMScheduler, SD1), (TCDScheduler, {**SD1, **ETA})],
                         ids=["ddpm", "lcm", "tcd"])
def test_stochastic_steps_need_a_key(cls, config):
    sched = cls.from_config(config)
    state = sched.set_timesteps(4)
    x = jnp.asarray(X_T)
    with pytest.raises(ValueError, match="key"):
        sched.step(state, x, 0, x)
    with pytest.raises(ValueError, match="either"):
        sched.step(state, x, 0, x, key=jax.random.key(0), variance_noise=x)


def test_deterministic_schedules_need_no_key():
    """One LCM step (it returns x̂_0 at once) and TCD with eta 0 add no noise: no key needed, none used."""
    x = jnp.asarray(X_T)
    for sched, n in [(LCMScheduler.from_config(SD1), 1), (TCDScheduler.from_config(SD1), 4)]:
        state = sched.set_timesteps(n)
        assert not state.stochastic
        plain, _ = sched.step(state, 0.9 * x, 0, x)
        keyed, _ = sched.step(state, 0.9 * x, 0, x, key=jax.random.key(0))
        np.testing.assert_array_equal(np.asarray(plain), np.asarray(keyed))


# ---- step counts and configs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ddpm", "lcm", "tcd"])
@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
def test_check_steps_refuses_what_set_timesteps_refuses(kind, spacing):
    """As test_schedulers' test of the same name (T = 100); LCM and TCD refuse exactly what diffusers'
    set_timesteps refuses: n > original_inference_steps (50 here), whatever the spacing, which they ignore."""
    config = {**SD14, "num_train_timesteps": 100, "timestep_spacing": spacing}
    sched = scheduler_from_config(config, kind=kind)
    refused = set()
    for n in [*range(-1, 12), 33, 49, 50, 51, 99, 100, 101, np.int64(20), 2.5, True]:
        expected = outcome(lambda: sched.set_timesteps(n, shape=SHAPE))
        assert outcome(lambda: sched.check_steps(n)) == expected, n
        if expected is not None:
            refused.add(repr(n))
    assert {"-1", "0", "101", "2.5", "True"} <= refused
    assert not {"1", "2", "3", "11", "np.int64(20)"} & refused
    with pytest.raises(ValueError, match=r"num_inference_steps must be in \[1, 100\]"):
        sched.check_steps(101)
    with pytest.raises(TypeError, match="num_inference_steps must be an int"):
        sched.check_steps(2.5)
    if kind != "ddpm":
        assert {"51", "99", "100"} <= refused and "50" not in refused
        theirs = TORCH[type(sched)].from_config(config)
        for n in range(1, 102):
            assert (outcome(lambda: theirs.set_timesteps(n)) is None) == (outcome(lambda: sched.check_steps(n)) is None)
        with pytest.raises(ValueError, match="more than original_inference_steps=50"):
            sched.check_steps(51)


def test_consistency_schedule_matches_diffusers_for_every_step_count():
    """The shared LCM / TCD schedule (lcm.consistency_timesteps) for every n and a few distillation grids."""
    for original in (50, 20, 7, 1000):
        config = {**SD1, "original_inference_steps": original}
        theirs = diffusers.LCMScheduler.from_config(config)
        ours = LCMScheduler.from_config(config)
        for n in range(1, original + 1, max(1, original // 60)):
            theirs.set_timesteps(n)
            np.testing.assert_array_equal(np.asarray(ours.set_timesteps(n).timesteps), theirs.timesteps.numpy())


def test_tcd_mapped_timestep_matches_diffusers_rounding():
    """s = ⌊(1-γ) t'⌋ in float32, as diffusers computes it, for every γ = k/20 and every t'."""
    theirs = diffusers.TCDScheduler.from_config({**SD1, "original_inference_steps": 1000})
    theirs.set_timesteps(1000)
    for k in range(21):
        eta = k / 20
        state = TCDScheduler.from_config({**SD1, "original_inference_steps": 1000, "eta": eta}).set_timesteps(1000)
        t_next = torch.cat([theirs.timesteps[1:], torch.tensor([0])])
        s = torch.floor((1 - eta) * t_next).to(torch.long)
        np.testing.assert_array_equal(np.asarray(state.alpha_prod_s), theirs.alphas_cumprod[s].numpy())


@pytest.mark.parametrize("field, value", [
    ("variance_type", "learned"),
    ("variance_type", "learned_range"),
    ("variance_type", "fixed_large_log"),
    ("beta_schedule", "squaredcos_cap_v2"),
    ("prediction_type", "flow_prediction"),
    ("timestep_spacing", "karras"),
    ("thresholding", True),
])
def test_ddpm_unsupported_config_values_raise(field, value):
    with pytest.raises(ValueError, match=f"{field}=.*allowed|{field}=.*set it to False"):
        DDPMScheduler.from_config({**SD1, field: value})


@pytest.mark.parametrize("cls, field, value", [
    (LCMScheduler, "original_inference_steps", 0),
    (LCMScheduler, "original_inference_steps", 1001),
    (LCMScheduler, "beta_schedule", "squaredcos_cap_v2"),
    (LCMScheduler, "thresholding", True),
    (TCDScheduler, "original_inference_steps", 2000),
    (TCDScheduler, "eta", 1.5),
    (TCDScheduler, "eta", -0.1),
])
def test_consistency_unsupported_config_values_raise(cls, field, value):
    with pytest.raises(ValueError, match=field if field != "eta" else "eta"):
        cls.from_config({**SD1, field: value})


def test_configs_follow_diffusers_defaults_and_names():
    for cls, torch_cls in TORCH.items():
        saved = json.loads(torch_cls().to_json_string())  # every key diffusers writes, at its defaults
        sched = scheduler_from_config(saved)
        assert type(sched) is cls and sched == cls.from_config({})
        for field in sched.config.__dataclass_fields__:
            if field in saved and field != "trained_betas":
                assert getattr(sched.config, field) == saved[field], (cls, field)
        assert type(scheduler_from_config({**SD1, "_class_name": torch_cls.__name__})) is cls
        assert hash(cls.from_config(SD1)) == hash(cls.from_config(dict(SD1)))


# ---- end to end ------------------------------------------------------------------------------------------------


def same_step_noise(monkeypatch, module, shape):
    """diffusers' step draws (randn_tensor in the scheduler's module) replaced by what our pipeline's step i draws:
    step_noise(fold_in(sampler key, i)), the sampler key being random_draws' for jax.random.key(0) (run_both's)."""
    _, sampler_key = random_draws(jax.random.key(0), shape, 1)
    drawn = []

    def randn(noise_shape, **kwargs):
        assert tuple(noise_shape) == shape
        noise = common.step_noise(jax.random.fold_in(sampler_key, len(drawn)), shape)
        drawn.append(len(drawn))
        return torch.from_numpy(np.array(noise))

    monkeypatch.setattr(module, "randn_tensor", randn)
    return drawn


def test_images_match_diffusers(tmp_path, monkeypatch):
    """StableDiffusionPipeline with LCMScheduler, 4 steps: re-noised between steps, with our pipeline's noise."""
    drawn = same_step_noise(monkeypatch, scheduling_lcm, (2, 4, 16, 16))
    pipe, _, ours, expected = run_both(tmp_path, "sd1", "LCMScheduler", 4, 7.5, NEGATIVE)
    assert type(pipe.scheduler) is LCMScheduler
    assert len(drawn) == 3
    assert ours.shape == expected.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - 0.5).mean() > 0.01  # not a constant image: the comparison means something


def test_tcd_eta_default_is_what_diffusers_pipelines_pass():
    """diffusers' pipelines pass their `eta` (0.0 unless given) to any scheduler whose step takes one, TCD's
    included, overriding its step's 0.3: our config's default is that 0.0, so a TCD checkpoint gives diffusers'
    image. (Its deterministic step is checked against diffusers' step by step above.)"""
    import inspect

    assert inspect.signature(diffusers.StableDiffusionPipeline.__call__).parameters["eta"].default == 0.0
    assert "eta" in inspect.signature(diffusers.TCDScheduler.step).parameters
    assert TCDScheduler.from_config({}).config.eta == 0.0
