"""Parity of the Euler, Euler ancestral, LMS and DPM-Solver++ 2M schedulers with diffusers' PyTorch classes, step by
step; predict_x0 / add_noise for every scheduler (PNDM and DDIM too); scan compatibility; the
Scheduler protocol for every scheduler (and scripts/example_scheduler.py); end-to-end images."""

import json
import sys
from functools import partial

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from builders import REPO, torch_pipeline
from test_pipeline import ATOL, NEGATIVE, PROMPTS, run_both
from test_schedulers import SD14, SHAPE, X_T, fake_model

from sdflax import StableDiffusion
from sdflax.schedulers import (
    SCHEDULERS,
    DDIMScheduler,
    DPMSolverScheduler,
    EulerAncestralScheduler,
    EulerScheduler,
    LMSScheduler,
    PNDMScheduler,
    Scheduler,
    SchedulerState,
    scheduler_from_config,
)

sys.path.insert(0, str(REPO / "scripts"))
from example_scheduler import DDPMAncestral  # noqa: E402

ATOL_SAMPLES = 1e-5  # every intermediate sample, float32, for SD's schedule: samples start at σ_max ≈ 14.6 × N(0, 1)
# Fractional timesteps (linspace spacing, Karras σ) come from log σ; torch's float32 sqrt is not correctly rounded,
# so σ and these timesteps may differ from diffusers' in the last bits (a float32 ulp at 999 is 6e-5).
ATOL_TIMESTEPS = 1e-4

# SD 1.x's schedule; timestep_spacing is left to each class's default ("linspace" for these four), as diffusers'
# `from_config` of an SD 1.x scheduler_config.json does.
SD1 = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
       "steps_offset": 1}

TORCH = {
    EulerScheduler: diffusers.EulerDiscreteScheduler,
    EulerAncestralScheduler: diffusers.EulerAncestralDiscreteScheduler,
    LMSScheduler: diffusers.LMSDiscreteScheduler,
    DPMSolverScheduler: diffusers.DPMSolverMultistepScheduler,
    PNDMScheduler: diffusers.PNDMScheduler,
    DDIMScheduler: diffusers.DDIMScheduler,
}


def noises_for(n, seed=2):
    return np.random.default_rng(seed).standard_normal((n, *SHAPE)).astype(np.float32)


IMAGE = 0.5 * np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)  # img2img's x_0 latents
IMAGE_NOISE = np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32)


def run_diffusers(cls, config, n, noises=None, monkeypatch=None, start=0):
    """The diffusers loop as its pipelines run it (txt2img, or img2img from step `start`); returns timesteps,
    init_noise_sigma and per-step arrays."""
    sched = TORCH[cls].from_config(config)
    sched.set_timesteps(n)
    if noises is not None:  # Euler ancestral draws its noise with randn_tensor: hand it ours, in order
        it = iter(torch.from_numpy(z) for z in noises)
        monkeypatch.setattr(diffusers.schedulers.scheduling_euler_ancestral_discrete, "randn_tensor",
                            lambda *args, **kwargs: next(it))
    if start:
        sched.set_begin_index(start)
        x = sched.add_noise(torch.from_numpy(IMAGE), torch.from_numpy(IMAGE_NOISE), sched.timesteps[start:start + 1])
    else:
        x = torch.from_numpy(X_T) * sched.init_noise_sigma
    out = {"inputs": [], "samples": [], "x0": []}
    for t in sched.timesteps[start:]:
        model_input = sched.scale_model_input(x, t)
        prediction = torch.from_numpy(fake_model(model_input.numpy(), float(t)))
        result = sched.step(prediction, t, x)
        # DPM-Solver keeps its converted output (x̂_0) as the newest history entry
        x0 = sched.model_outputs[-1] if cls is DPMSolverScheduler else result.pred_original_sample
        x = result.prev_sample
        for name, value in (("inputs", model_input), ("samples", x), ("x0", x0)):
            out[name].append(value.numpy())
    return sched.timesteps[start:].numpy(), float(sched.init_noise_sigma), {k: np.stack(v) for k, v in out.items()}


def run_ours(cls, config, n, noises=None, start=0):
    sched = cls.from_config(config)
    state = sched.set_timesteps(n, shape=SHAPE, start=start)
    if start:
        x = sched.add_noise(state, jnp.asarray(IMAGE), jnp.asarray(IMAGE_NOISE), 0)
    else:
        x = jnp.asarray(X_T) * state.init_noise_sigma
    out = {"inputs": [], "samples": [], "x0": []}
    for i in range(len(state.timesteps)):
        model_input = sched.scale_model_input(state, x, i)
        prediction = jnp.asarray(fake_model(np.asarray(model_input), float(state.timesteps[i])))
        x0 = sched.predict_x0(state, prediction, i, x)
        kwargs = {} if noises is None else {"variance_noise": jnp.asarray(noises[i])}
        x, state = sched.step(state, prediction, i, x, **kwargs)
        for name, value in (("inputs", model_input), ("samples", x), ("x0", x0)):
            out[name].append(np.asarray(value))
    return np.asarray(state.timesteps), state.init_noise_sigma, {k: np.stack(v) for k, v in out.items()}


def sigma_max(config):
    return float(diffusers.EulerDiscreteScheduler.from_config(config).sigmas.max())


def atol_for(config):
    """ATOL_SAMPLES for SD's schedule. A schedule with a larger σ_max (157 for diffusers' default linear β)
    starts from proportionally larger samples, and float32 resolution (and x̂_0 = x - σ ε̂'s cancellation)
    scales with them: the same relative accuracy."""
    return ATOL_SAMPLES * max(1.0, sigma_max(config) / sigma_max(SD1))


def assert_parity(cls, config, n, noises=None, monkeypatch=None, start=0):
    atol = atol_for(config)
    their_t, their_sigma, theirs = run_diffusers(cls, config, n, noises, monkeypatch, start)
    our_t, our_sigma, ours = run_ours(cls, config, n, noises, start)
    assert our_t.shape == their_t.shape
    if cls is DPMSolverScheduler:
        assert our_t.dtype == np.int32
        np.testing.assert_array_equal(our_t, their_t)
    else:
        assert our_t.dtype == np.float32
        np.testing.assert_allclose(our_t, their_t, rtol=0, atol=ATOL_TIMESTEPS)
    assert our_sigma == pytest.approx(their_sigma, rel=1e-6)
    if config.get("timestep_spacing", "linspace") != "leading" and n > 1:  # then it does not depend on n
        assert cls.from_config(config).set_timesteps(2, shape=SHAPE).init_noise_sigma == pytest.approx(
            their_sigma, rel=1e-6)
    for name in ("inputs", "x0", "samples"):
        assert ours[name].dtype == np.float32 and ours[name].shape == theirs[name].shape, name
        assert np.isfinite(theirs[name]).all(), name
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=atol, err_msg=name)


KARRAS = {"use_karras_sigmas": True}
V_PRED = {"prediction_type": "v_prediction"}
TRAILING = {"timestep_spacing": "trailing"}
LINSPACE = {"timestep_spacing": "linspace"}
LEADING = {"timestep_spacing": "leading"}

EULER_CASES = {
    "sd1-25": (SD1, 25),
    "sd1-1": (SD1, 1),
    "sd1-2": (SD1, 2),
    "karras-25": ({**SD1, **KARRAS}, 25),
    "karras-8": ({**SD1, **KARRAS}, 8),
    "v-pred": ({**SD1, **V_PRED}, 20),
    "v-pred-karras": ({**SD1, **V_PRED, **KARRAS}, 20),
    "sample-pred": ({**SD1, "prediction_type": "sample"}, 10),
    "trailing-7": ({**SD1, **TRAILING}, 7),
    "linspace-7": ({**SD1, **LINSPACE}, 7),
    "leading-10": ({**SD1, **LEADING}, 10),
    "leading-karras-10": ({**SD1, **LEADING, **KARRAS}, 10),
    "final-sigma-min": ({**SD1, "final_sigmas_type": "sigma_min"}, 10),
    "karras-sigma-range": ({**SD1, **KARRAS, "sigma_min": 0.1, "sigma_max": 10.0}, 10),
    "zero-snr": ({**SD1, **V_PRED, **TRAILING, "rescale_betas_zero_snr": True}, 10),  # σ_max = 4096
    "linear-defaults": ({}, 10),
}


@pytest.mark.parametrize("name", list(EULER_CASES))
def test_euler_matches_diffusers(name):
    assert_parity(EulerScheduler, *EULER_CASES[name])


EULER_ANCESTRAL_CASES = {
    "sd1-25": (SD1, 25),
    "v-pred": ({**SD1, **V_PRED}, 20),
    "trailing-7": ({**SD1, **TRAILING}, 7),
    "leading-10": ({**SD1, **LEADING}, 10),
    "zero-snr": ({**SD1, **V_PRED, **TRAILING, "rescale_betas_zero_snr": True}, 10),  # σ_max = 4096
    "linear-defaults": ({}, 10),
}


@pytest.mark.parametrize("name", list(EULER_ANCESTRAL_CASES))
def test_euler_ancestral_matches_diffusers_with_same_noise(name, monkeypatch):
    config, n = EULER_ANCESTRAL_CASES[name]
    assert_parity(EulerAncestralScheduler, config, n, noises_for(n), monkeypatch)


LMS_CASES = {
    "sd1-25": (SD1, 25),
    "sd1-1": (SD1, 1),
    "sd1-3": (SD1, 3),  # fewer steps than the order
    "karras-25": ({**SD1, **KARRAS}, 25),
    "karras-6": ({**SD1, **KARRAS}, 6),
    "v-pred": ({**SD1, **V_PRED}, 20),
    "sample-pred": ({**SD1, "prediction_type": "sample"}, 10),
    "trailing-7": ({**SD1, **TRAILING}, 7),
    "leading-10": ({**SD1, **LEADING}, 10),
    "linear-defaults": ({}, 10),
}


@pytest.mark.parametrize("name", list(LMS_CASES))
def test_lms_matches_diffusers(name):
    assert_parity(LMSScheduler, *LMS_CASES[name])


DPM_CASES = {
    "sd1-25": (SD1, 25),
    "sd1-10": (SD1, 10),  # < 15 steps: lower_order_final
    "sd1-1": (SD1, 1),
    "sd1-2": (SD1, 2),
    "karras-25": ({**SD1, **KARRAS}, 25),
    "karras-10": ({**SD1, **KARRAS}, 10),
    "v-pred": ({**SD1, **V_PRED}, 20),
    "v-pred-karras": ({**SD1, **V_PRED, **KARRAS}, 20),
    "sample-pred": ({**SD1, "prediction_type": "sample"}, 10),
    "trailing-7": ({**SD1, **TRAILING}, 7),
    "leading-10": ({**SD1, **LEADING}, 10),
    "heun": ({**SD1, "solver_type": "heun"}, 20),
    "order-1": ({**SD1, "solver_order": 1}, 10),
    "final-sigma-min-20": ({**SD1, "final_sigmas_type": "sigma_min"}, 20),  # last step second order
    "final-sigma-min-10": ({**SD1, "final_sigmas_type": "sigma_min"}, 10),
    "no-lower-order-final": ({**SD1, "lower_order_final": False, "final_sigmas_type": "sigma_min"}, 10),
    "euler-at-final": ({**SD1, "euler_at_final": True, "final_sigmas_type": "sigma_min"}, 20),
    "zero-snr": ({**SD1, **V_PRED, **TRAILING, "rescale_betas_zero_snr": True}, 10),  # σ_max = 4096
    "linear-defaults": ({}, 10),
}


@pytest.mark.parametrize("name", list(DPM_CASES))
def test_dpm_solver_matches_diffusers(name):
    assert_parity(DPMSolverScheduler, *DPM_CASES[name])


@pytest.mark.parametrize("cls, config", [
    (EulerScheduler, {**SD1, **KARRAS}),
    (EulerAncestralScheduler, SD1),
    (LMSScheduler, SD1),
    (DPMSolverScheduler, SD1),
    (DPMSolverScheduler, {**SD1, **KARRAS, **V_PRED}),
], ids=["euler-karras", "euler-ancestral", "lms", "dpmpp-2m", "dpmpp-2m-karras-v"])
@pytest.mark.parametrize("start", [1, 6])
def test_img2img_start_matches_diffusers(cls, config, start, monkeypatch):
    """set_timesteps(n, start=k) + add_noise(state, x_0, ε, 0), as diffusers' img2img: set_begin_index(k),
    add_noise at timesteps[k], then the remaining steps (LMS and DPM-Solver restart their history)."""
    n = 10
    noises = noises_for(n - start) if cls is EulerAncestralScheduler else None
    assert_parity(cls, config, n, noises, monkeypatch, start=start)
    with pytest.raises(ValueError, match="start"):
        cls.from_config(config).set_timesteps(n, shape=SHAPE, start=n)


# ---- predict_x0 and add_noise for every scheduler ------------------------------------------------------------


def their_add_noise(cls, config, n, i, original, noise):
    """diffusers' add_noise at the i-th timestep, as its img2img pipeline calls it (set_begin_index, then
    add_noise(x, noise, timesteps[i:i+1]))."""
    sched = TORCH[cls].from_config(config)
    sched.set_timesteps(n)
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(i)
    return sched.add_noise(torch.from_numpy(original), torch.from_numpy(noise), sched.timesteps[i : i + 1]).numpy()


ALL_SCHEDULERS = {
    "pndm": (PNDMScheduler, SD14),
    "pndm-prk-v": (PNDMScheduler, {**SD14, "skip_prk_steps": False, **V_PRED}),
    "ddim": (DDIMScheduler, {**SD14, "_class_name": "DDIMScheduler"}),
    "ddim-clip-v": (DDIMScheduler, {**SD14, "clip_sample": True, **V_PRED}),
    "euler": (EulerScheduler, SD1),
    "euler-karras-v": (EulerScheduler, {**SD1, **KARRAS, **V_PRED}),
    "euler-ancestral": (EulerAncestralScheduler, SD1),
    "lms-karras": (LMSScheduler, {**SD1, **KARRAS}),
    "dpmpp-2m": (DPMSolverScheduler, SD1),
    "dpmpp-2m-karras-v": (DPMSolverScheduler, {**SD1, **KARRAS, **V_PRED}),
}


@pytest.mark.parametrize("name", list(ALL_SCHEDULERS))
def test_add_noise_matches_diffusers(name):
    cls, config = ALL_SCHEDULERS[name]
    n = 10
    state = cls.from_config(config).set_timesteps(n, shape=SHAPE)
    original, noise = X_T, noises_for(1)[0]
    for i in range(len(state.timesteps)):
        ours = cls.from_config(config).add_noise(state, jnp.asarray(original), jnp.asarray(noise), i)
        theirs = their_add_noise(cls, config, n, i, original, noise)
        np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=ATOL_SAMPLES, err_msg=f"evaluation {i}")


@pytest.mark.parametrize("name", ["ddim", "ddim-clip-v"])
def test_ddim_predict_x0_matches_pred_original_sample(name):
    """(The σ samplers' x̂_0 is compared at every step in assert_parity.)"""
    cls, config = ALL_SCHEDULERS[name]
    sched, theirs = cls.from_config(config), TORCH[cls].from_config(config)
    state = sched.set_timesteps(10, shape=SHAPE)
    theirs.set_timesteps(10)
    x = X_T
    for i, t in enumerate(theirs.timesteps):
        prediction = fake_model(x, float(t))
        result = theirs.step(torch.from_numpy(prediction), t, torch.from_numpy(x))
        ours = sched.predict_x0(state, jnp.asarray(prediction), i, jnp.asarray(x))
        np.testing.assert_allclose(np.asarray(ours), result.pred_original_sample.numpy(), rtol=0, atol=ATOL_SAMPLES)
        x = result.prev_sample.numpy()


@pytest.mark.parametrize("name", ["pndm", "pndm-prk-v"])
def test_pndm_predict_x0_from_the_current_timestep(name):
    """diffusers' PNDM step returns no x̂_0; ours is (x - √(1-ᾱ_t) ε̂) / √ᾱ_t with diffusers' ᾱ at timesteps[i]
    (ε̂ = √ᾱ v + √(1-ᾱ) x for v-prediction), checked along diffusers' own trajectory."""
    cls, config = ALL_SCHEDULERS[name]
    sched, theirs = cls.from_config(config), TORCH[cls].from_config(config)
    state = sched.set_timesteps(10, shape=SHAPE)
    theirs.set_timesteps(10)
    np.testing.assert_array_equal(np.asarray(state.timesteps), theirs.timesteps.numpy())
    x = torch.from_numpy(X_T)
    for i, t in enumerate(theirs.timesteps):
        prediction = torch.from_numpy(fake_model(x.numpy(), float(t)))
        a = theirs.alphas_cumprod[t]
        if config.get("prediction_type") == "v_prediction":
            expected = a**0.5 * x - (1 - a) ** 0.5 * prediction
        else:
            expected = (x - (1 - a) ** 0.5 * prediction) / a**0.5
        ours = sched.predict_x0(state, jnp.asarray(prediction.numpy()), i, jnp.asarray(x.numpy()))
        np.testing.assert_allclose(np.asarray(ours), expected.numpy(), rtol=0, atol=ATOL_SAMPLES)
        x = theirs.step(prediction, t, x).prev_sample


# ---- Euler ancestral's noise ---------------------------------------------------------------------------------


def test_euler_ancestral_keys_and_variance():
    sched = EulerAncestralScheduler.from_config(SD1)
    shape = (2, 4, 100, 250)  # 200k elements
    state = sched.set_timesteps(30, shape=shape)
    i = 10
    x = jax.random.normal(jax.random.key(3), shape) * 3.0
    step = partial(sched.step, state, 0.9 * x, i, x)
    a, _ = step(key=jax.random.key(1))
    a_again, _ = step(key=jax.random.key(1))
    b, _ = step(key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a_again))
    assert not np.allclose(np.asarray(a), np.asarray(b))

    # a - b = σ_up (z_a - z_b): var = 2 σ_up², σ_up² = σ_to² (σ_from² - σ_to²) / σ_from² from diffusers' σ table.
    theirs = diffusers.EulerAncestralDiscreteScheduler.from_config(SD1)
    theirs.set_timesteps(30)
    s_from, s_to = float(theirs.sigmas[i]), float(theirs.sigmas[i + 1])
    sigma_up_sq = s_to**2 * (s_from**2 - s_to**2) / s_from**2
    measured = float(np.var(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
    assert measured == pytest.approx(2 * sigma_up_sq, rel=0.02)
    assert sigma_up_sq > 0.1  # the noise is not negligible at this step


def test_euler_ancestral_needs_a_key():
    sched = EulerAncestralScheduler.from_config(SD1)
    state = sched.set_timesteps(5)
    x = jnp.asarray(X_T)
    with pytest.raises(ValueError, match="key"):
        sched.step(state, x, 0, x)
    with pytest.raises(ValueError, match="either"):
        sched.step(state, x, 0, x, key=jax.random.key(0), variance_noise=x)


# ---- scan compatibility ----------------------------------------------------------------------------------------


@partial(jax.jit, static_argnums=0)
def scan_loop(sched, state, x, keys):
    def body(carry, i):
        x, state = carry
        out = fake_model(sched.scale_model_input(state, x, i), state.timesteps[i])
        x0 = sched.predict_x0(state, out, i, x)
        x, state = sched.step(state, out, i, x, key=keys[i])
        return (x, state), (x, x0)

    return jax.lax.scan(body, (x, state), jnp.arange(state.timesteps.shape[0]))[1]


def eager_loop(sched, state, x, keys):
    samples, x0s = [], []
    for i in range(len(state.timesteps)):
        out = fake_model(sched.scale_model_input(state, x, i), state.timesteps[i])
        x0s.append(sched.predict_x0(state, out, i, x))
        x, state = sched.step(state, out, i, x, key=keys[i])
        samples.append(x)
    return jnp.stack(samples), jnp.stack(x0s)


@pytest.mark.parametrize("cls, config", [
    (EulerScheduler, {**SD1, **KARRAS}),
    (EulerAncestralScheduler, SD1),
    (LMSScheduler, SD1),
    (DPMSolverScheduler, {**SD1, **KARRAS}),
], ids=["euler-karras", "euler-ancestral", "lms", "dpmpp-2m-karras"])
def test_jit_scan_equals_eager(cls, config):
    assert_scan_equals_eager(cls.from_config(config), 10, ATOL_SAMPLES)


def assert_scan_equals_eager(sched, n, atol):
    """The compiled scan and the Python loop take the same steps (every sample and x̂₀), from X_T."""
    state = sched.set_timesteps(n, shape=SHAPE)
    evals = state.timesteps.shape[0]
    keys = jax.random.split(jax.random.key(0), evals)
    x = jnp.asarray(X_T) * state.init_noise_sigma
    scanned, eager = scan_loop(sched, state, x, keys), eager_loop(sched, state, x, keys)
    assert scanned[0].shape == (evals, *SHAPE)
    for s, e in zip(scanned, eager):  # compiled and eager float32 round differently (fusion)
        np.testing.assert_allclose(np.asarray(s), np.asarray(e), rtol=0, atol=atol)


PROTOCOL_CASES = {**{kind: cls.from_config(SD14) for kind, cls in SCHEDULERS.items()},
                  "outside": DDPMAncestral.from_config(SD14)}  # scripts/example_scheduler.py


@pytest.mark.parametrize("name", list(PROTOCOL_CASES))
def test_every_scheduler_follows_the_protocol(name):
    """isinstance checks the names; a compiled scan over exactly the protocol's calls checks that they work."""
    sched = PROTOCOL_CASES[name]
    assert isinstance(sched, Scheduler)
    assert type(sched).from_config(SD14) == sched and hash(sched) == hash(type(sched).from_config(dict(SD14)))
    assert not hasattr(sched, "init_noise_sigma")  # one place: the state
    sched.check_steps(5)
    state = sched.set_timesteps(5, shape=SHAPE)
    assert isinstance(state, SchedulerState)
    evals = state.timesteps.shape[0]
    assert state.timesteps.shape == (evals,) and evals >= 5
    assert isinstance(state.init_noise_sigma, float) and state.init_noise_sigma >= 1.0

    x = jnp.asarray(X_T) * state.init_noise_sigma
    samples, x0 = scan_loop(sched, state, x, jax.random.split(jax.random.key(0), evals))
    assert samples.shape == x0.shape == (evals, *SHAPE) and x0.dtype == jnp.float32
    assert np.isfinite(np.asarray(samples)).all() and np.isfinite(np.asarray(x0)).all()
    noisy = sched.add_noise(state, jnp.asarray(IMAGE), jnp.asarray(IMAGE_NOISE), 0)
    assert noisy.shape == SHAPE and np.isfinite(np.asarray(noisy)).all()


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_low_precision_sample_keeps_dtype(kind):
    """Every scheduler: a bfloat16 sample stays bfloat16 through both stages of a step (the math is float32
    inside), the model input too, and x̂₀ is float32."""
    sched = SCHEDULERS[kind].from_config(SD1)
    state = sched.set_timesteps(5, shape=SHAPE)
    x = jnp.asarray(X_T, jnp.bfloat16)
    for i in (0, 1):
        prev, state = sched.step(state, x, i, x, key=jax.random.key(0))
        assert prev.dtype == jnp.bfloat16
    assert sched.scale_model_input(state, x, 1).dtype == jnp.bfloat16
    assert sched.predict_x0(state, x, 1, x).dtype == jnp.float32


# ---- configs -------------------------------------------------------------------------------------------------


def test_scheduler_names_resolve():
    for kind, cls in [("euler", EulerScheduler), ("euler_ancestral", EulerAncestralScheduler),
                      ("dpmpp_2m", DPMSolverScheduler), ("lms", LMSScheduler)]:
        assert isinstance(scheduler_from_config(SD1, kind=kind), cls)
    for cls, torch_cls in TORCH.items():
        name = torch_cls.__name__
        assert type(scheduler_from_config({**SD1, "_class_name": cls.__name__})) is cls
        assert type(scheduler_from_config({**SD1, "_class_name": name})) is cls
        assert type(scheduler_from_config({**SD1, "_class_name": "Flax" + name})) is cls
    # A saved diffusers config (every key diffusers writes) loads, unknown keys ignored.
    for cls, torch_cls in TORCH.items():
        saved = json.loads(torch_cls.from_config(SD1).to_json_string())  # as in scheduler_config.json
        assert saved["_class_name"] == torch_cls.__name__
        assert type(scheduler_from_config(saved)) is cls


def test_class_defaults_follow_diffusers():
    for cls in (EulerScheduler, EulerAncestralScheduler, LMSScheduler, DPMSolverScheduler):
        assert cls.from_config({}).config.timestep_spacing == "linspace"
    dpm = DPMSolverScheduler.from_config({}).config
    assert (dpm.solver_order, dpm.algorithm_type, dpm.lower_order_final, dpm.final_sigmas_type) == (
        2, "dpmsolver++", True, "zero")
    assert DPMSolverScheduler.from_config(SD1).set_timesteps(10, shape=SHAPE).init_noise_sigma == 1.0
    a, b = EulerScheduler.from_config({**SD1, **KARRAS}), EulerScheduler.from_config(dict({**SD1, **KARRAS}))
    assert a == b and hash(a) == hash(b)  # usable as a jit static argument


def test_leading_spacing_init_noise_sigma_depends_on_steps():
    """diffusers' √(σ_first² + 1) for `leading` spacing needs the step count: it lives on the state, which has it."""
    sched = EulerScheduler.from_config({**SD1, **LEADING})
    ours = {}
    for n in (10, 50):
        theirs = diffusers.EulerDiscreteScheduler.from_config({**SD1, **LEADING})
        theirs.set_timesteps(n)
        ours[n] = sched.set_timesteps(n).init_noise_sigma
        assert ours[n] == pytest.approx(float(theirs.init_noise_sigma), rel=1e-6)
    assert ours[10] != pytest.approx(ours[50], rel=1e-3)  # it does depend on n


@pytest.mark.parametrize("cls, field, value", [
    (EulerScheduler, "interpolation_type", "log_linear"),
    (EulerScheduler, "timestep_type", "continuous"),
    (EulerScheduler, "final_sigmas_type", "max"),
    (EulerScheduler, "timestep_spacing", "karras"),
    (EulerScheduler, "prediction_type", "flow_prediction"),
    (EulerAncestralScheduler, "prediction_type", "sample"),
    (LMSScheduler, "beta_schedule", "squaredcos_cap_v2"),
    (DPMSolverScheduler, "algorithm_type", "sde-dpmsolver"),
    (DPMSolverScheduler, "solver_order", 3),
    (DPMSolverScheduler, "solver_type", "bh2"),
    (DPMSolverScheduler, "use_lu_lambdas", True),
    (DPMSolverScheduler, "lambda_min_clipped", -5.1),
    (DPMSolverScheduler, "variance_type", "learned_range"),
    (DPMSolverScheduler, "thresholding", True),
])
def test_unsupported_config_values_raise(cls, field, value):
    with pytest.raises(ValueError, match=f"{field}=.*allowed|{field}=.*set it to False"):
        cls.from_config({**SD1, field: value})


def test_multistep_schedulers_need_the_shape():
    for cls in (LMSScheduler, DPMSolverScheduler):
        with pytest.raises(ValueError, match="shape"):
            cls.from_config(SD1).set_timesteps(10)


def test_lms_coefficients_integrate_the_interpolating_polynomial():
    """Σ_j c_ij d_j is exact for derivatives that are polynomials of degree < order in σ (here d = σ³ - 2σ)."""
    from sdflax.schedulers.lms import lms_coefficients

    sigmas = np.array([14.6, 9.0, 5.5, 3.1, 1.2, 0.4, 0.0], np.float32).astype(np.float64)
    c = lms_coefficients(sigmas)
    for i in range(3, len(sigmas) - 1):
        d = np.array([sigmas[i - j] ** 3 - 2 * sigmas[i - j] for j in range(4)])
        exact = (sigmas[i + 1] ** 4 / 4 - sigmas[i + 1] ** 2) - (sigmas[i] ** 4 / 4 - sigmas[i] ** 2)
        assert c[i] @ d == pytest.approx(exact, rel=1e-12)


# ---- end to end ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler, config", [
    ("euler", {}),
    ("dpmpp_2m", {"use_karras_sigmas": True}),
], ids=["euler", "dpmpp-2m-karras"])
def test_images_match_diffusers(tmp_path, scheduler, config):
    pipe, _, ours, expected = run_both(tmp_path, "sd1", scheduler, 4, 7.5, NEGATIVE, **config)
    assert type(pipe.scheduler) is {"euler": EulerScheduler, "dpmpp_2m": DPMSolverScheduler}[scheduler]
    assert ours.shape == expected.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - 0.5).mean() > 0.01  # not a constant image: the comparison means something


def test_switching_to_euler_karras_on_a_pndm_checkpoint(tmp_path):
    """from_pretrained(folder, scheduler="euler", scheduler_config=...) as diffusers'
    `EulerDiscreteScheduler.from_config(pipe.scheduler.config, ...)`: the checkpoint's schedule is kept."""
    theirs = torch_pipeline("sd1")  # PNDM, saved with timestep_spacing="leading"
    theirs.save_pretrained(tmp_path)
    pipe, params = StableDiffusion.from_pretrained(tmp_path, scheduler="euler", scheduler_config=KARRAS)
    assert type(pipe.scheduler) is EulerScheduler and pipe.scheduler.config.use_karras_sigmas
    assert pipe.scheduler.config.timestep_spacing == "leading" and pipe.scheduler.config.beta_end == 0.012
    saved = json.loads((tmp_path / "scheduler" / "scheduler_config.json").read_text())  # what from_pretrained read
    leading = diffusers.EulerDiscreteScheduler.from_config({**saved, **KARRAS})
    assert leading.config.timestep_spacing == "leading"
    leading.set_timesteps(3)  # the initial noise scale depends on the step count: the state has it
    assert pipe.scheduler.set_timesteps(3).init_noise_sigma == pytest.approx(float(leading.init_noise_sigma), rel=1e-6)

    overrides = {**KARRAS, **TRAILING}
    pipe, params = StableDiffusion.from_pretrained(tmp_path, scheduler="euler", scheduler_config=overrides)
    theirs.scheduler = diffusers.EulerDiscreteScheduler.from_config(theirs.scheduler.config, **overrides)
    latents = np.random.default_rng(0).standard_normal((2, 4, 16, 16), dtype=np.float32)
    with torch.no_grad():
        expected = theirs(PROMPTS, guidance_scale=7.5, num_inference_steps=3, latents=torch.from_numpy(latents),
                          output_type="np").images
    ours = pipe(pipe.prepare_inputs(PROMPTS), params, jax.random.key(0), 3, latents=latents).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
