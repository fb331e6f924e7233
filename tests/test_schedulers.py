"""Parity of sdflax.schedulers with diffusers' PyTorch PNDMScheduler / DDIMScheduler, step by step."""

from functools import partial

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sdflax.schedulers import SCHEDULERS, DDIMScheduler, PNDMScheduler, scheduler_from_config

# Stable Diffusion 1.4's scheduler/scheduler_config.json (PNDM), verbatim.
SD14 = {
    "_class_name": "PNDMScheduler",
    "_diffusers_version": "0.7.0.dev0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
    "clip_sample": False,
}
SD14_DDIM = {**SD14, "_class_name": "DDIMScheduler"}
SHAPE = (2, 4, 8, 8)

TORCH_CLASSES = {PNDMScheduler: diffusers.PNDMScheduler, DDIMScheduler: diffusers.DDIMScheduler}


def fake_model(x, t):
    """A deterministic stand-in for the UNet: depends on the current sample, so errors would compound.
    Written with operators only so it runs on numpy, torch and jax arrays alike."""
    return 0.9 * x + 0.1 * MODEL_NOISE + 0.02 * (t / 1000.0)


MODEL_NOISE = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
X_T = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)


def run_diffusers(cls, config, n, noises=None, **step_kwargs):
    sched = TORCH_CLASSES[cls].from_config(config)
    sched.set_timesteps(n)
    x = torch.from_numpy(X_T)
    trajectory = []
    for k, t in enumerate(sched.timesteps):
        x = sched.scale_model_input(x, t)
        out = torch.from_numpy(fake_model(x.numpy(), int(t)))
        if noises is not None:
            step_kwargs["variance_noise"] = torch.from_numpy(noises[k])
        x = sched.step(out, t, x, **step_kwargs).prev_sample
        trajectory.append(x.numpy())
    return sched.timesteps.numpy(), np.stack(trajectory)


def run_ours(cls, config, n, noises=None, **step_kwargs):
    sched = cls.from_config(config)
    state = sched.set_timesteps(n, shape=SHAPE)
    x = jnp.asarray(X_T) * state.init_noise_sigma
    trajectory = []
    for i in range(len(state.timesteps)):
        x = sched.scale_model_input(state, x, i)
        out = fake_model(np.asarray(x), int(state.timesteps[i]))
        if noises is not None:
            step_kwargs["variance_noise"] = jnp.asarray(noises[i])
        x, state = sched.step(state, jnp.asarray(out), i, x, **step_kwargs)
        trajectory.append(np.asarray(x))
    return np.asarray(state.timesteps), np.stack(trajectory)


def assert_parity(cls, config, n, noises=None, **step_kwargs):
    their_t, theirs = run_diffusers(cls, config, n, noises, **step_kwargs)
    our_t, ours = run_ours(cls, config, n, noises, **step_kwargs)
    np.testing.assert_array_equal(our_t, their_t)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.isfinite(theirs).all()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


PNDM_CASES = {
    "sd14-1": (SD14, 1),
    "sd14-2": (SD14, 2),
    "sd14-3": (SD14, 3),
    "sd14-5": (SD14, 5),
    "sd14-50": (SD14, 50),
    "prk-4": ({**SD14, "skip_prk_steps": False}, 4),
    "prk-10": ({**SD14, "skip_prk_steps": False}, 10),
    "prk-50": ({**SD14, "skip_prk_steps": False}, 50),
    "v-pred": ({**SD14, "prediction_type": "v_prediction"}, 20),
    "v-pred-prk": ({**SD14, "prediction_type": "v_prediction", "skip_prk_steps": False}, 8),
    "linear-defaults": ({}, 10),
    "trailing": ({**SD14, "timestep_spacing": "trailing"}, 7),
    "linspace": ({**SD14, "timestep_spacing": "linspace"}, 7),
    "alpha-one": ({**SD14, "set_alpha_to_one": True}, 5),
    "trained-betas": ({"trained_betas": np.linspace(1e-4, 0.02, 1000).tolist(), "skip_prk_steps": True}, 10),
}


@pytest.mark.parametrize("name", list(PNDM_CASES))
def test_pndm_matches_diffusers(name):
    config, n = PNDM_CASES[name]
    assert_parity(PNDMScheduler, config, n)


DDIM_CASES = {
    "sd14-1": (SD14_DDIM, 1),
    "sd14-2": (SD14_DDIM, 2),
    "sd14-50": (SD14_DDIM, 50),
    "trailing-7": ({**SD14_DDIM, "timestep_spacing": "trailing"}, 7),
    "trailing-50": ({**SD14_DDIM, "timestep_spacing": "trailing"}, 50),
    "linspace-7": ({**SD14_DDIM, "timestep_spacing": "linspace"}, 7),
    "v-pred": ({**SD14_DDIM, "prediction_type": "v_prediction"}, 20),
    "sample-pred": ({**SD14_DDIM, "prediction_type": "sample"}, 20),
    "clip-sample": ({**SD14_DDIM, "clip_sample": True}, 20),
    "clip-sample-range": ({**SD14_DDIM, "clip_sample": True, "clip_sample_range": 0.5}, 20),
    "alpha-one": ({**SD14_DDIM, "set_alpha_to_one": True}, 10),
    "linear-defaults": ({}, 10),
    "zero-snr": (
        {**SD14_DDIM, "prediction_type": "v_prediction", "timestep_spacing": "trailing", "rescale_betas_zero_snr": True},
        25,
    ),
}


@pytest.mark.parametrize("name", list(DDIM_CASES))
def test_ddim_matches_diffusers(name):
    config, n = DDIM_CASES[name]
    assert_parity(DDIMScheduler, config, n)


@pytest.mark.parametrize("eta", [0.5, 1.0])
def test_ddim_eta_matches_diffusers_with_same_noise(eta):
    n = 20
    noises = np.random.default_rng(2).standard_normal((n, *SHAPE)).astype(np.float32)
    assert_parity(DDIMScheduler, SD14_DDIM, n, noises=noises, eta=eta)


def test_pndm_timesteps_length():
    sched = PNDMScheduler.from_config(SD14)
    assert len(sched.set_timesteps(1, SHAPE).timesteps) == 1
    assert len(sched.set_timesteps(50, SHAPE).timesteps) == 51
    prk = PNDMScheduler.from_config({**SD14, "skip_prk_steps": False})
    assert len(prk.set_timesteps(50, SHAPE).timesteps) == 59
    with pytest.raises(ValueError, match="PRK"):
        prk.set_timesteps(3, SHAPE)


@partial(jax.jit, static_argnums=0)
def scan_loop(sched, state, x, keys, eta):
    def body(carry, i):
        x, state = carry
        out = fake_model(sched.scale_model_input(state, x, i), state.timesteps[i])
        kwargs = {} if keys is None else {"key": keys[i], "eta": eta}
        x, state = sched.step(state, out, i, x, **kwargs)
        return (x, state), x

    (_, _), trajectory = jax.lax.scan(body, (x, state), jnp.arange(state.timesteps.shape[0]))
    return trajectory


def eager_loop(sched, state, x, keys, eta):
    trajectory = []
    for i in range(len(state.timesteps)):
        out = fake_model(x, state.timesteps[i])
        kwargs = {} if keys is None else {"key": keys[i], "eta": eta}
        x, state = sched.step(state, out, i, x, **kwargs)
        trajectory.append(x)
    return jnp.stack(trajectory)


@pytest.mark.parametrize(
    "sched, n, eta",
    [
        (PNDMScheduler.from_config({**SD14, "skip_prk_steps": False}), 10, None),
        (PNDMScheduler.from_config(SD14), 10, None),
        (DDIMScheduler.from_config(SD14_DDIM), 10, 0.7),  # traced eta, per-step keys
    ],
    ids=["pndm-prk", "pndm", "ddim-eta"],
)
def test_jit_scan_equals_eager(sched, n, eta):
    state = sched.set_timesteps(n, shape=SHAPE)
    keys = None if eta is None else jax.random.split(jax.random.key(0), len(state.timesteps))
    x = jnp.asarray(X_T)
    scanned = scan_loop(sched, state, x, keys, eta)
    eager = eager_loop(sched, state, x, keys, eta)
    assert scanned.shape == (len(state.timesteps), *SHAPE)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(eager), rtol=0, atol=1e-6)


def test_ddim_eta_noise_keys_and_variance():
    sched = DDIMScheduler.from_config(SD14_DDIM)
    shape = (2, 4, 100, 250)  # 200k elements
    state = sched.set_timesteps(50, shape=shape)
    i, eta = 10, 1.0
    x = jax.random.normal(jax.random.key(3), shape)
    eps = 0.9 * x
    step = partial(sched.step, state, eps, i, x, eta=eta)
    a, _ = step(key=jax.random.key(1))
    a_again, _ = step(key=jax.random.key(1))
    b, _ = step(key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a_again))
    assert not np.allclose(np.asarray(a), np.asarray(b))

    # a - b = σ_t (z_a - z_b), so var(a - b) = 2 σ_t², σ_t = η √variance from diffusers' own formula.
    torch_sched = diffusers.DDIMScheduler.from_config(SD14_DDIM)
    torch_sched.set_timesteps(50)
    t = int(torch_sched.timesteps[i])
    std_dev_t = eta * float(torch_sched._get_variance(t, t - 1000 // 50)) ** 0.5
    assert int(state.timesteps[i]) == t
    measured = float(np.var(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
    assert measured == pytest.approx(2 * std_dev_t**2, rel=0.02)


def test_ddim_eta_requires_key():
    sched = DDIMScheduler.from_config(SD14_DDIM)
    state = sched.set_timesteps(5)
    x = jnp.asarray(X_T)
    with pytest.raises(ValueError, match="key"):
        sched.step(state, x, 0, x, eta=0.5)
    with pytest.raises(ValueError, match="either"):
        sched.step(state, x, 0, x, eta=0.5, key=jax.random.key(0), variance_noise=x)
    sched.step(state, x, 0, x, eta=0.0)  # deterministic DDIM needs none


@pytest.mark.parametrize("cls", [PNDMScheduler, DDIMScheduler])
def test_low_precision_sample_keeps_dtype(cls):
    sched = cls.from_config(SD14)
    state = sched.set_timesteps(5, shape=SHAPE)
    x = jnp.asarray(X_T, jnp.bfloat16)
    prev, _ = sched.step(state, x, 0, x)
    assert prev.dtype == jnp.bfloat16
    prev32, _ = sched.step(state, x.astype(jnp.float32), 0, x.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(prev, np.float32), np.asarray(prev32), rtol=1e-2, atol=1e-2)


def test_scheduler_from_config_and_hashing():
    assert isinstance(scheduler_from_config(SD14), PNDMScheduler)
    assert isinstance(scheduler_from_config(SD14_DDIM), DDIMScheduler)
    assert isinstance(scheduler_from_config({**SD14, "_class_name": "FlaxDDIMScheduler"}), DDIMScheduler)
    assert isinstance(scheduler_from_config(SD14, kind="ddim"), DDIMScheduler)
    assert set(SCHEDULERS) == {"pndm", "ddim", "euler", "euler_ancestral", "dpmpp_2m", "lms", "heun", "dpm2",
                               "dpm2_ancestral", "dpmpp_2s_ancestral", "dpmpp_sde", "dpmpp_2m_sde", "dpmpp_3m_sde",
                               "unipc", "deis", "ddpm", "lcm", "tcd", "euler_cfg_pp", "euler_ancestral_cfg_pp",
                               "dpmpp_2m_cfg_pp", "flow_match_euler"}
    with pytest.raises(ValueError, match="pndm"):
        scheduler_from_config(SD14, kind="warp")
    with pytest.raises(ValueError, match="known"):
        scheduler_from_config({"beta_start": 0.1})
    a, b = PNDMScheduler.from_config(SD14), PNDMScheduler.from_config(dict(SD14))
    assert a == b and hash(a) == hash(b)
    assert PNDMScheduler.from_config({}).config.set_alpha_to_one is False  # diffusers' per-class defaults
    assert DDIMScheduler.from_config({}).config.set_alpha_to_one is True
    assert DDIMScheduler.from_config({}).config.clip_sample is True
    assert a.set_timesteps(10, SHAPE).init_noise_sigma == 1.0
    assert DDIMScheduler.from_config(SD14).set_timesteps(10).init_noise_sigma == 1.0
    with pytest.raises(ValueError, match="shape"):
        a.set_timesteps(10)


@pytest.mark.parametrize("cls", [PNDMScheduler, DDIMScheduler])
@pytest.mark.parametrize(
    "field, value",
    [("prediction_type", "x0"), ("beta_schedule", "cosine"), ("timestep_spacing", "karras"), ("thresholding", True)],
)
def test_bad_config_values_raise(cls, field, value):
    with pytest.raises(ValueError, match=field):
        cls.from_config({**SD14, field: value})


def test_pndm_rejects_sample_prediction():
    with pytest.raises(ValueError, match="prediction_type"):
        PNDMScheduler.from_config({**SD14, "prediction_type": "sample"})


# ---- the step-count check --------------------------------------------------------------------------------------------


def outcome(call):
    try:
        call()
    except (ValueError, TypeError) as error:
        return type(error), str(error)
    return None


@pytest.mark.parametrize("kind", [*SCHEDULERS, "pndm-prk"])
@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
def test_check_steps_refuses_what_set_timesteps_refuses(kind, spacing):
    """`scheduler.check_steps(n)` raises exactly when `set_timesteps(n)` would, so a caller (pipeline, CLI) can
    run it before compiling anything."""
    cls = SCHEDULERS[kind.removesuffix("-prk")]
    sched = cls.from_config({**SD14, "num_train_timesteps": 100, "timestep_spacing": spacing,
                             "skip_prk_steps": not kind.endswith("-prk")})
    refused = set()
    for n in [*range(-1, 12), 33, 49, 50, 51, 99, 100, 101, np.int64(20), 2.5, True]:
        with np.errstate(divide="ignore", invalid="ignore"):  # DPM-Solver at n + 1 > T points: h = 0, as diffusers
            expected = outcome(lambda: sched.set_timesteps(n, shape=SHAPE))
        assert outcome(lambda: sched.check_steps(n)) == expected, n
        if expected is not None:
            refused.add(repr(n))
    assert {"-1", "0", "101", "2.5", "True"} <= refused
    if kind != "pndm-prk":
        assert not {"1", "2", "3", "11", "np.int64(20)"} & refused
    with pytest.raises(ValueError, match=r"num_inference_steps must be in \[1, 100\]"):
        sched.check_steps(101)
    with pytest.raises(TypeError, match="num_inference_steps must be an int"):
        sched.check_steps(2.5)
    if kind == "pndm-prk":
        assert {"1", "2", "3"} <= refused
        with pytest.raises(ValueError, match="PRK"):
            sched.check_steps(3)
    # LCM and TCD refuse n > original_inference_steps first; a flow schedule has no spacing to refuse by
    if spacing == "leading" and kind not in ("lcm", "tcd", "flow_match_euler"):
        # steps_offset = 1 would put the first of 100 steps at t = 100
        with pytest.raises(ValueError, match="first step at t=100, past the last training timestep 99"):
            sched.check_steps(100)


@pytest.mark.parametrize("cls", [PNDMScheduler, DDIMScheduler])
def test_start_past_the_schedule_raises(cls):
    sched = cls.from_config(SD14)
    evals = sched.set_timesteps(10, shape=SHAPE).timesteps.shape[0]
    assert sched.set_timesteps(10, shape=SHAPE, start=evals - 1).timesteps.shape == (1,)
    with pytest.raises(ValueError, match="start"):
        sched.set_timesteps(10, shape=SHAPE, start=evals)
