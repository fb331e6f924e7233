"""Parity of UniPC, DEIS and DPM-Solver++ 2M SDE with diffusers' PyTorch classes, step by step; the exponential and
beta σ schedules of Euler, LMS and DPM-Solver++ 2M; DPM-Solver++(3M) SDE against k-diffusion's
`sample_dpmpp_3m_sde` written out in numpy float64; scan, the protocol, configs; end-to-end images."""

import ast
import dataclasses
import json
from functools import partial

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
import scipy.stats
import test_sigma_schedulers as sigma_tests
import torch
from builders import REPO
from test_pipeline import ATOL, NEGATIVE, run_both
from test_schedulers import SHAPE, X_T, fake_model
from test_sigma_schedulers import (
    ATOL_TIMESTEPS,
    IMAGE,
    IMAGE_NOISE,
    KARRAS,
    LEADING,
    SD1,
    TRAILING,
    V_PRED,
    assert_parity,
    atol_for,
    noises_for,
    run_ours,
)

from sdflax import random_draws
from sdflax.schedulers import (
    SCHEDULERS,
    DEISScheduler,
    DPMPP2MSDEScheduler,
    DPMPP3MSDEScheduler,
    DPMSolverScheduler,
    EulerScheduler,
    LMSScheduler,
    UniPCScheduler,
    common,
    scheduler_from_config,
    sigma_schedules,
)

# numpy 2 on diffusers' numpy calls with torch tensors, thousands of times here
pytestmark = [pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword"),
              pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context")]

EXPONENTIAL = {"use_exponential_sigmas": True}
BETA = {"use_beta_sigmas": True}
SDE = {"algorithm_type": "sde-dpmsolver++"}

TORCH = {
    UniPCScheduler: diffusers.UniPCMultistepScheduler,
    DEISScheduler: diffusers.DEISMultistepScheduler,
    DPMSolverScheduler: diffusers.DPMSolverMultistepScheduler,
}


# ---- the harness: diffusers' loop as its pipelines run it, then test_sigma_schedulers' comparison ---------------


def run_diffusers(cls, config, n, noises=None, start=0, float64=False):
    """Timesteps, init_noise_sigma and per-step model inputs, x̂_0 and samples of diffusers' loop (txt2img, or
    img2img from step `start`); `noises` go to the SDE steps as variance_noise. With `float64` the scheduler runs
    in float64 (its σ table cast up)."""
    sched = TORCH[cls].from_config(config)
    sched.set_timesteps(n)
    dtype = torch.float64 if float64 else torch.float32
    if float64:
        sched.sigmas = sched.sigmas.to(dtype)
    if start:
        sched.set_begin_index(start)
        x = sched.add_noise(torch.from_numpy(IMAGE).to(dtype), torch.from_numpy(IMAGE_NOISE).to(dtype),
                            sched.timesteps[start:start + 1])
    else:
        x = torch.from_numpy(X_T).to(dtype) * sched.init_noise_sigma
    out = {"inputs": [], "samples": [], "x0": []}
    for k, t in enumerate(sched.timesteps[start:]):
        model_input = sched.scale_model_input(x, t)
        prediction = torch.from_numpy(fake_model(model_input.numpy(), float(t)))
        kwargs = {} if noises is None else {"variance_noise": torch.from_numpy(noises[k])}
        step = start + k
        result = sched.step(prediction, t, x, **kwargs)
        newest = sched.model_outputs[-1]
        if cls is DEISScheduler:  # DEIS keeps ε̂ = (x - α x̂_0)/s: x̂_0 back from it
            alpha, s = sched._sigma_to_alpha_sigma_t(sched.sigmas[step])
            newest = (x - s * newest) / alpha
        x = result.prev_sample
        for name, value in (("inputs", model_input), ("samples", x), ("x0", newest)):
            out[name].append(value.numpy().astype(np.float32))
    return sched.timesteps[start:].numpy(), float(sched.init_noise_sigma), {k: np.stack(v) for k, v in out.items()}


def assert_matches(cls, config, n, noises=None, start=0, float64=False):
    atol = atol_for(config)
    their_t, their_sigma, theirs = run_diffusers(cls, config, n, noises, start, float64)
    our_t, our_sigma, ours = run_ours(cls, config, n, noises, start)
    assert our_t.dtype == np.int32
    np.testing.assert_array_equal(our_t, their_t)
    assert our_sigma == their_sigma == 1.0
    for name in ("inputs", "x0", "samples"):
        assert ours[name].dtype == np.float32 and ours[name].shape == theirs[name].shape, name
        assert np.isfinite(theirs[name]).all(), name
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=atol, err_msg=name)
    return theirs


def assert_settings_matter(run, config, n, base=SD1):
    """Every option of `config` beyond `base` changes the oracle's samples: without it they differ."""
    samples = run(config, n)
    for key in set(config) - set(base):
        try:
            without = run({k: v for k, v in config.items() if k != key}, n)
        except RuntimeError:  # the oracle refuses the config without it (a singular solve): it matters
            continue
        assert not np.allclose(without, samples, rtol=0, atol=1e-4), f"{key} changes nothing here"


def oracle_samples(cls, config, n, noises=None, float64=False):
    return run_diffusers(cls, config, n, noises, float64=float64)[2]["samples"]


# ---- UniPC -----------------------------------------------------------------------------------------------------

ORDER_3 = {"solver_order": 3}
# bh1 into σ = 0 is NaN in diffusers (its last step multiplies B(h) = -h = -∞ by 0): see test_unipc_bh1_into_zero
BH1 = {"solver_type": "bh1", "final_sigmas_type": "sigma_min"}

UNIPC_CASES = {
    "sd1-25": (SD1, 25),
    "sd1-10": (SD1, 10),
    "sd1-1": (SD1, 1),
    "sd1-2": (SD1, 2),
    "order-1": ({**SD1, "solver_order": 1}, 10),
    "order-3": ({**SD1, **ORDER_3}, 12),
    "order-3-5-steps": ({**SD1, **ORDER_3}, 5),  # the fewest where a third-order step remains
    "bh1": ({**SD1, **BH1}, 15),
    "bh1-order-3": ({**SD1, **BH1, **ORDER_3}, 10),
    "karras": ({**SD1, **KARRAS}, 15),
    "exponential-order-3": ({**SD1, **EXPONENTIAL, **ORDER_3}, 12),
    "beta": ({**SD1, **BETA}, 15),
    "karras-sigma-min": ({**SD1, **KARRAS, "final_sigmas_type": "sigma_min"}, 10),  # the last σ repeated
    "karras-sigma-range": ({**SD1, **KARRAS, "sigma_min": 0.1, "sigma_max": 10.0}, 10),
    "v-pred": ({**SD1, **V_PRED}, 15),
    "sample-pred": ({**SD1, "prediction_type": "sample"}, 10),
    "trailing-7": ({**SD1, **TRAILING}, 7),
    "leading-10": ({**SD1, **LEADING}, 10),
    "final-sigma-min": ({**SD1, "final_sigmas_type": "sigma_min"}, 10),
    "no-lower-order-final": ({**SD1, **ORDER_3, "lower_order_final": False, "final_sigmas_type": "sigma_min"}, 10),
    "zero-snr": ({**SD1, **V_PRED, **TRAILING, "rescale_betas_zero_snr": True}, 10),
    "linear-defaults": ({}, 10),
}


@pytest.mark.parametrize("name", list(UNIPC_CASES))
def test_unipc_matches_diffusers(name):
    assert_matches(UniPCScheduler, *UNIPC_CASES[name])


def test_unipc_bh1_into_zero():
    """diffusers' bh1 step into σ = 0 is first order and adds α B(h) times an empty sum, -∞ · 0 = NaN; every
    earlier step matches, and ours lands on that step's x̂_0, the first-order step's limit."""
    config, n = {**SD1, "solver_type": "bh1"}, 10
    _, _, theirs = run_diffusers(UniPCScheduler, config, n)
    _, _, ours = run_ours(UniPCScheduler, config, n)
    assert np.isnan(theirs["samples"][-1]).all()
    for name in ("inputs", "x0", "samples"):
        np.testing.assert_allclose(ours[name][:-1], theirs[name][:-1], rtol=0, atol=atol_for(config), err_msg=name)
    np.testing.assert_allclose(ours["samples"][-1], ours["x0"][-1], rtol=0, atol=1e-6)


def test_unipc_refuses_a_higher_order_step_into_zero():
    """Without lower_order_final the last step into σ = 0 is of higher order, h = ∞: diffusers' solve fails (or
    gives NaN); ours refuses when the state is built."""
    config = {**SD1, "lower_order_final": False}
    with pytest.raises(RuntimeError):
        run_diffusers(UniPCScheduler, {**config, **ORDER_3}, 10)
    with pytest.raises(ValueError, match="not finite"):
        UniPCScheduler.from_config(config).set_timesteps(10, shape=SHAPE)


# ---- DEIS ------------------------------------------------------------------------------------------------------

DEIS_CASES = {
    "sd1-25": (SD1, 25),
    "sd1-10": (SD1, 10),
    "sd1-1": (SD1, 1),
    "sd1-2": (SD1, 2),
    "order-1": ({**SD1, "solver_order": 1}, 10),
    "order-3-25": ({**SD1, **ORDER_3}, 25),
    "order-3-10": ({**SD1, **ORDER_3}, 10),  # < 15 steps: the last two steps lower their order
    "order-3-5-steps": ({**SD1, **ORDER_3}, 5),  # the fewest where a third-order step remains
    "karras-order-3": ({**SD1, **KARRAS, **ORDER_3}, 15),  # the last σ repeated: the last step stays
    "exponential": ({**SD1, **EXPONENTIAL}, 15),
    "beta": ({**SD1, **BETA}, 15),
    "v-pred": ({**SD1, **V_PRED}, 15),
    "sample-pred": ({**SD1, "prediction_type": "sample"}, 10),
    "trailing-7": ({**SD1, **TRAILING}, 7),
    "leading-10": ({**SD1, **LEADING}, 10),
    "no-lower-order-final": ({**SD1, **ORDER_3, "lower_order_final": False}, 10),
    "linear-defaults": ({}, 10),
}


@pytest.mark.parametrize("name", list(DEIS_CASES))
def test_deis_matches_diffusers(name):
    """Against diffusers' DEIS run in float64: in float32 its closed-form coefficients lose up to ~1e-4 to
    cancellation (see the next test), more than this tolerance; ours are computed in float64."""
    assert_matches(DEISScheduler, *DEIS_CASES[name], float64=True)


def test_deis_float32_diffusers_differs_by_its_own_rounding():
    """Plain float32 diffusers DEIS (third order, 25 steps) is within 5e-4 of ours, and of itself in float64 by as
    much: that difference is its float32 coefficients', not ours."""
    config, n = DEIS_CASES["order-3-25"]
    plain, exact = oracle_samples(DEISScheduler, config, n), oracle_samples(DEISScheduler, config, n, float64=True)
    ours = run_ours(DEISScheduler, config, n)[2]["samples"]
    plain_error, our_error = np.abs(plain - exact).max(), np.abs(ours - exact).max()
    assert plain_error < 5e-4 and np.abs(plain - ours).max() < 5e-4
    assert our_error < 1e-5 < plain_error


# ---- DPM-Solver++ 2M SDE, and the exponential / beta σ of the existing σ samplers ----------------------------

DPM_SDE_CASES = {
    "sd1-25": ({**SD1, **SDE}, 25),
    "sd1-10": ({**SD1, **SDE}, 10),
    "sd1-1": ({**SD1, **SDE}, 1),
    "heun": ({**SD1, **SDE, "solver_type": "heun"}, 15),
    "karras": ({**SD1, **SDE, **KARRAS}, 15),
    "exponential": ({**SD1, **SDE, **EXPONENTIAL}, 15),
    "beta": ({**SD1, **SDE, **BETA}, 15),
    "v-pred": ({**SD1, **SDE, **V_PRED}, 15),
    "trailing-7": ({**SD1, **SDE, **TRAILING}, 7),
    "leading-10": ({**SD1, **SDE, **LEADING}, 10),
    "final-sigma-min-20": ({**SD1, **SDE, "final_sigmas_type": "sigma_min"}, 20),  # last step second order
    "heun-final-sigma-min-20": ({**SD1, **SDE, "solver_type": "heun", "final_sigmas_type": "sigma_min"}, 20),
    "order-1": ({**SD1, **SDE, "solver_order": 1}, 10),
    "linear-defaults": (SDE, 10),
}


@pytest.mark.parametrize("name", list(DPM_SDE_CASES))
def test_dpm_solver_sde_matches_diffusers_with_same_noise(name):
    config, n = DPM_SDE_CASES[name]
    assert_matches(DPMSolverScheduler, config, n, noises_for(n))


DPM_SCHEDULE_CASES = {  # the ODE (algorithm_type="dpmsolver++") with the new σ schedules
    "exponential-20": ({**SD1, **EXPONENTIAL}, 20),
    "beta-20": ({**SD1, **BETA}, 20),
    "exponential-v-10": ({**SD1, **EXPONENTIAL, **V_PRED}, 10),
    "beta-heun-sigma-min-10": ({**SD1, **BETA, "solver_type": "heun", "final_sigmas_type": "sigma_min"}, 10),
}


@pytest.mark.parametrize("name", list(DPM_SCHEDULE_CASES))
def test_dpm_solver_exponential_and_beta_sigmas_match_diffusers(name):
    assert_parity(DPMSolverScheduler, *DPM_SCHEDULE_CASES[name])


SIGMA_SAMPLER_CASES = {
    "euler-exponential-25": (EulerScheduler, {**SD1, **EXPONENTIAL}, 25),
    "euler-beta-25": (EulerScheduler, {**SD1, **BETA}, 25),
    "euler-beta-3": (EulerScheduler, {**SD1, **BETA}, 3),  # (with 2, just the end points: spaced σ)
    "euler-exponential-v-leading": (EulerScheduler, {**SD1, **EXPONENTIAL, **V_PRED, **LEADING}, 10),
    "euler-beta-sigma-range": (EulerScheduler, {**SD1, **BETA, "sigma_min": 0.1, "sigma_max": 10.0}, 10),
    "euler-exponential-trailing-sigma-min": (
        EulerScheduler, {**SD1, **EXPONENTIAL, **TRAILING, "final_sigmas_type": "sigma_min"}, 8),
    "lms-exponential-20": (LMSScheduler, {**SD1, **EXPONENTIAL}, 20),
    "lms-beta-20": (LMSScheduler, {**SD1, **BETA}, 20),
    "lms-beta-3": (LMSScheduler, {**SD1, **BETA}, 3),
}


@pytest.mark.parametrize("name", list(SIGMA_SAMPLER_CASES))
def test_euler_and_lms_exponential_and_beta_sigmas_match_diffusers(name):
    assert_parity(*SIGMA_SAMPLER_CASES[name])


def test_dpmpp_2m_sde_is_dpm_solver_with_the_sde_algorithm():
    """`dpmpp_2m_sde` takes the schedule from the config it is given and always the SDE algorithm."""
    saved = json.loads(diffusers.DPMSolverMultistepScheduler.from_config({**SD1, **KARRAS}).to_json_string())
    assert saved["algorithm_type"] == "dpmsolver++"
    sde = scheduler_from_config(saved, kind="dpmpp_2m_sde")
    assert type(sde) is DPMPP2MSDEScheduler and sde.config.algorithm_type == "sde-dpmsolver++"
    assert sde.config.use_karras_sigmas
    assert DPMPP2MSDEScheduler.from_config({}).config.algorithm_type == "sde-dpmsolver++"
    plain = DPMSolverScheduler.from_config({**saved, **SDE})
    a, b = sde.set_timesteps(10, shape=SHAPE), plain.set_timesteps(10, shape=SHAPE)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    x, noise = jnp.asarray(X_T), jnp.asarray(noises_for(1)[0])
    np.testing.assert_array_equal(np.asarray(sde.step(a, x, 3, x, variance_noise=noise)[0]),
                                  np.asarray(plain.step(b, x, 3, x, variance_noise=noise)[0]))


# ---- DPM-Solver++(3M) SDE against k-diffusion ------------------------------------------------------------------


def kdiffusion_3m_sde(config, n, noises=None, start=0, eta=1.0, s_noise=1.0):
    """k-diffusion's `sample_dpmpp_3m_sde` in numpy float64, on diffusers' EulerDiscreteScheduler σ (and
    timesteps) for `config`, with CompVis' denoiser wrapper: x̂_0 from the model's output on x / √(σ²+1) at the
    timestep. `noises[k]` stands in for the Brownian tree's normalised increment of the k-th step run."""
    theirs = diffusers.EulerDiscreteScheduler.from_config(config)
    theirs.set_timesteps(n)
    sigmas, timesteps = theirs.sigmas.numpy().astype(np.float64), theirs.timesteps.numpy()
    prediction_type = config.get("prediction_type", "epsilon")

    def model(x, i):
        sigma = sigmas[i]
        model_input = x / np.sqrt(sigma**2 + 1)
        out = fake_model(model_input, float(timesteps[i]))
        if prediction_type == "epsilon":
            return model_input, x - sigma * out
        if prediction_type == "v_prediction":
            return model_input, out * (-sigma / np.sqrt(sigma**2 + 1)) + x / (sigma**2 + 1)
        return model_input, out

    if start:
        x = IMAGE.astype(np.float64) + IMAGE_NOISE.astype(np.float64) * sigmas[start]
    else:
        x = X_T.astype(np.float64) * float(theirs.init_noise_sigma)
    out = {"inputs": [], "samples": [], "x0": []}
    denoised_1, denoised_2 = None, None
    h, h_1, h_2 = None, None, None
    for i in range(start, n):
        model_input, denoised = model(x, i)
        if sigmas[i + 1] == 0:
            x = denoised  # denoising step
        else:
            t, s = -np.log(sigmas[i]), -np.log(sigmas[i + 1])
            h = s - t
            h_eta = h * (eta + 1)
            x = np.exp(-h_eta) * x + -np.expm1(-h_eta) * denoised
            if h_2 is not None:
                r0 = h_1 / h
                r1 = h_2 / h
                d1_0 = (denoised - denoised_1) / r0
                d1_1 = (denoised_1 - denoised_2) / r1
                d1 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1)
                d2 = (d1_0 - d1_1) / (r0 + r1)
                phi_2 = np.expm1(-h_eta) / h_eta + 1
                phi_3 = phi_2 / h_eta - 0.5
                x = x + phi_2 * d1 - phi_3 * d2
            elif h_1 is not None:
                r = h_1 / h
                d = (denoised - denoised_1) / r
                phi_2 = np.expm1(-h_eta) / h_eta + 1
                x = x + phi_2 * d
            if eta:
                x = x + noises[i - start] * sigmas[i + 1] * np.sqrt(-np.expm1(-2 * h * eta)) * s_noise
        denoised_1, denoised_2 = denoised, denoised_1
        h_1, h_2 = h, h_1
        for name, value in (("inputs", model_input), ("samples", x), ("x0", denoised)):
            out[name].append(value)
    return timesteps[start:], float(theirs.init_noise_sigma), {k: np.stack(v) for k, v in out.items()}


THREE_M_CASES = {
    "sd1-25": (SD1, 25),
    "sd1-10": (SD1, 10),
    "sd1-1": (SD1, 1),
    "sd1-2": (SD1, 2),
    "sd1-3": (SD1, 3),
    "karras-15": ({**SD1, **KARRAS}, 15),
    "exponential-15": ({**SD1, **EXPONENTIAL}, 15),
    "beta-15": ({**SD1, **BETA}, 15),
    "v-pred": ({**SD1, **V_PRED}, 15),
    "sample-pred": ({**SD1, "prediction_type": "sample"}, 10),
    "trailing-7": ({**SD1, **TRAILING}, 7),
    "leading-10": ({**SD1, **LEADING}, 10),
    "eta-0.5-s-noise-0.8": ({**SD1, "eta": 0.5, "s_noise": 0.8}, 10),
    "eta-0": ({**SD1, "eta": 0.0}, 10),  # the deterministic DPM-Solver++(3M): no noise needed
    "linear-defaults": ({}, 10),
}


def run_3m_reference(config, n, start=0):
    eta, s_noise = config.get("eta", 1.0), config.get("s_noise", 1.0)
    noises = noises_for(n - start) if eta else None
    diffusers_config = {k: v for k, v in config.items() if k not in ("eta", "s_noise")}
    return kdiffusion_3m_sde(diffusers_config, n, noises, start, eta, s_noise), noises


def assert_3m_matches(config, n, start=0):
    (their_t, their_sigma, theirs), noises = run_3m_reference(config, n, start)
    our_t, our_sigma, ours = run_ours(DPMPP3MSDEScheduler, config, n, noises, start)
    np.testing.assert_allclose(our_t, their_t, rtol=0, atol=ATOL_TIMESTEPS)
    assert our_sigma == pytest.approx(their_sigma, rel=1e-6)
    for name in ("inputs", "x0", "samples"):
        assert ours[name].dtype == np.float32 and ours[name].shape == theirs[name].shape, name
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=atol_for(config), err_msg=name)


@pytest.mark.parametrize("name", list(THREE_M_CASES))
def test_dpmpp_3m_sde_matches_kdiffusion(name):
    assert_3m_matches(*THREE_M_CASES[name])


# ---- every setting under test changes the oracle's output -----------------------------------------------------


def oracle(family):
    """(cases {name: (config, n)}, run(config, n) -> the oracle's samples, the base config) of a family above."""
    if family == "unipc":
        return UNIPC_CASES, partial(oracle_samples, UniPCScheduler), SD1
    if family == "deis":
        return DEIS_CASES, partial(oracle_samples, DEISScheduler, float64=True), SD1
    if family == "dpm-sde":
        return DPM_SDE_CASES, lambda config, n: oracle_samples(DPMSolverScheduler, config, n, noises_for(n)), {
            **SD1, **SDE}
    if family == "dpm-schedules":
        return DPM_SCHEDULE_CASES, partial(oracle_samples, DPMSolverScheduler), SD1
    if family == "3m-sde":
        return THREE_M_CASES, lambda config, n: run_3m_reference(config, n)[0][2]["samples"], SD1
    cls = {"euler": EulerScheduler, "lms": LMSScheduler}[family]
    cases = {name: (config, n) for name, (c, config, n) in SIGMA_SAMPLER_CASES.items() if c is cls}
    return cases, lambda config, n: sigma_tests.run_diffusers(cls, config, n)[2]["samples"], SD1


@pytest.mark.parametrize("family", ["unipc", "deis", "dpm-sde", "dpm-schedules", "euler", "lms", "3m-sde"])
def test_every_setting_under_test_matters(family):
    """Each case's options beyond SD 1.x's schedule (and the SDE algorithm) change the oracle's samples, so that
    the parity above checks each of them."""
    cases, run, base = oracle(family)
    for config, n in cases.values():
        if set(base) <= set(config):  # (the linear-defaults cases check the schedule itself)
            assert_settings_matter(run, config, n, base)


# ---- img2img ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls, config", [
    (UniPCScheduler, {**SD1, **ORDER_3}),
    (UniPCScheduler, {**SD1, **BH1, **KARRAS, **V_PRED}),
    (DEISScheduler, {**SD1, **ORDER_3}),
    (DPMSolverScheduler, {**SD1, **SDE}),
    (DPMSolverScheduler, {**SD1, **EXPONENTIAL}),
    (EulerScheduler, {**SD1, **BETA}),
], ids=["unipc-3", "unipc-bh1-karras-v", "deis-3", "dpmpp-2m-sde", "dpmpp-2m-exponential", "euler-beta"])
@pytest.mark.parametrize("start", [1, 6])
def test_img2img_start_matches_diffusers(cls, config, start):
    """set_timesteps(n, start=k) + add_noise(state, x_0, ε, 0), as diffusers' img2img: set_begin_index(k),
    add_noise at timesteps[k], then the remaining steps (the multistep history restarts)."""
    n = 10
    if cls is EulerScheduler:
        assert_parity(cls, config, n, start=start)
    else:
        noises = noises_for(n - start) if config.get("algorithm_type") == SDE["algorithm_type"] else None
        assert_matches(cls, config, n, noises, start=start, float64=cls is DEISScheduler)
    with pytest.raises(ValueError, match="start"):
        cls.from_config(config).set_timesteps(n, shape=SHAPE, start=n)


@pytest.mark.parametrize("start", [1, 6])
def test_dpmpp_3m_sde_img2img_start_matches_kdiffusion(start):
    assert_3m_matches({**SD1, **KARRAS}, 10, start)


@pytest.mark.parametrize("name", ["unipc", "deis", "dpmpp_2m_sde"])
def test_add_noise_matches_diffusers(name):
    cls = SCHEDULERS[name]
    config = {**SD1, **KARRAS, **(SDE if name == "dpmpp_2m_sde" else {})}
    n = 10
    state = cls.from_config(config).set_timesteps(n, shape=SHAPE)
    noise = noises_for(1)[0]
    for i in range(n):
        ours = cls.from_config(config).add_noise(state, jnp.asarray(X_T), jnp.asarray(noise), i)
        theirs = TORCH.get(cls, diffusers.DPMSolverMultistepScheduler).from_config(config)
        theirs.set_timesteps(n)
        theirs.set_begin_index(i)
        expected = theirs.add_noise(torch.from_numpy(X_T), torch.from_numpy(noise), theirs.timesteps[i:i + 1])
        np.testing.assert_allclose(np.asarray(ours), expected.numpy(), rtol=0, atol=1e-6)


# ---- the stochastic steps' noise ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dpmpp_2m_sde", "dpmpp_3m_sde"])
def test_sde_keys_and_variance(name):
    """Same key, same step; another key, another; the difference of two draws has variance 2 c_i², c_i the
    step's noise scale; without a key (or variance_noise) the step refuses."""
    sched = SCHEDULERS[name].from_config(SD1)
    state = sched.set_timesteps(30, shape=(4, 4, 32, 32))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 4, 32, 32)), jnp.float32)
    i = 10
    step = partial(sched.step, state, 0.9 * x, i, x)
    a, _ = step(key=jax.random.key(1))
    a_again, _ = step(key=jax.random.key(1))
    b, _ = step(key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a_again))
    scale = float(state.coef_noise[i])
    assert scale > 0.1  # the noise is not negligible at this step
    measured = float(np.var(np.asarray(a, np.float64) - np.asarray(b, np.float64)))
    assert measured == pytest.approx(2 * scale**2, rel=0.03)
    per_image = step(key=jax.random.split(jax.random.key(1), 4))[0]  # one key per image works too
    assert per_image.shape == x.shape and not np.allclose(np.asarray(per_image), np.asarray(a))
    with pytest.raises(ValueError, match="key"):
        step()
    with pytest.raises(ValueError, match="either"):
        step(key=jax.random.key(0), variance_noise=x)


def test_sde_noise_scale_matches_the_formula():
    """DPM-Solver++ 2M SDE's noise std s_{i+1} √(1 - e^{-2h}) from diffusers' σ table; the ODE adds none."""
    state = DPMSolverScheduler.from_config({**SD1, **SDE}).set_timesteps(10, shape=SHAPE)
    theirs = diffusers.DPMSolverMultistepScheduler.from_config({**SD1, **SDE})
    theirs.set_timesteps(10)
    sigma = theirs.sigmas.numpy().astype(np.float64)
    with np.errstate(divide="ignore"):
        h = np.log(sigma[:-1]) - np.log(sigma[1:])  # λ = -log σ
    expected = sigma[1:] / np.sqrt(sigma[1:] ** 2 + 1) * np.sqrt(-np.expm1(-2 * h))
    np.testing.assert_allclose(np.asarray(state.coef_noise), expected, rtol=1e-6, atol=0)
    assert not np.asarray(DPMSolverScheduler.from_config(SD1).set_timesteps(10, shape=SHAPE).coef_noise).any()


# ---- scan, protocol, dtype -------------------------------------------------------------------------------------

NEW = ["unipc", "deis", "dpmpp_2m_sde", "dpmpp_3m_sde"]


@pytest.mark.parametrize("name, config", [
    ("unipc", {**SD1, **ORDER_3, **BETA}),
    ("deis", {**SD1, **ORDER_3, **EXPONENTIAL}),
    ("dpmpp_2m_sde", {**SD1, **KARRAS}),
    ("dpmpp_3m_sde", SD1),
], ids=["unipc-3-beta", "deis-3-exponential", "dpmpp-2m-sde-karras", "dpmpp-3m-sde"])
def test_jit_scan_equals_eager(name, config):
    sigma_tests.assert_scan_equals_eager(SCHEDULERS[name].from_config(config), 10, atol_for(config))


@pytest.mark.parametrize("name", NEW)
def test_every_scheduler_follows_the_protocol(name):
    sigma_tests.test_every_scheduler_follows_the_protocol(name)


# ---- σ schedules and configs -----------------------------------------------------------------------------------


def test_beta_quantile_matches_scipy():
    """sdflax's Beta(0.6, 0.6) quantile (numpy bisection / Newton) against scipy's, which diffusers calls."""
    p = np.concatenate([np.linspace(0, 1, 101), [1e-9, 1e-4, 0.3, 1 - 1e-4, 1 - 1e-12]])
    expected = scipy.stats.beta.ppf(p, 0.6, 0.6)
    np.testing.assert_allclose(sigma_schedules.beta_ppf(p, 0.6, 0.6), expected, rtol=1e-13, atol=1e-300)
    assert sigma_schedules.beta_ppf(0.0, 0.6, 0.6) == 0.0 and sigma_schedules.beta_ppf(1.0, 0.6, 0.6) == 1.0
    x = np.linspace(0, 1, 201)
    for a, b in [(0.6, 0.6), (2.0, 0.5), (0.5, 3.0)]:
        np.testing.assert_allclose(sigma_schedules.betainc(x, a, b), scipy.special.betainc(a, b, x), rtol=0, atol=2e-15)
    p = np.array([0.2, 0.9])
    np.testing.assert_allclose(sigma_schedules.beta_ppf(p, 2.0, 0.5), scipy.stats.beta.ppf(p, 2.0, 0.5), rtol=1e-13)


def test_schedulers_do_not_import_scipy():
    """diffusers needs scipy for beta σ; sdflax computes the quantile itself."""
    for path in (REPO / "sdflax").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "scipy" for n in names), path


def test_discrete_sigma_schedule_choices():
    """The schedule comes from the config's flags, or `schedule=`; `karras=True` still means Karras."""
    config = EulerScheduler.from_config({**SD1, **BETA}).config
    beta = common.discrete_sigma_schedule(config, 10)
    np.testing.assert_array_equal(beta[1], common.discrete_sigma_schedule(config, 10, schedule="beta")[1])
    plain = EulerScheduler.from_config(SD1).config
    karras = common.discrete_sigma_schedule(plain, 10, karras=True)
    np.testing.assert_array_equal(karras[1], common.discrete_sigma_schedule(plain, 10, schedule="karras")[1])
    spaced = common.discrete_sigma_schedule(plain, 10)[1]
    for schedule in ("karras", "exponential", "beta"):
        sigmas = common.discrete_sigma_schedule(plain, 10, schedule=schedule)[1]
        assert sigmas[0] == spaced[0] and sigmas[-2] == spaced[-2] and not np.array_equal(sigmas, spaced)
    with pytest.raises(ValueError, match="sigma schedule"):
        common.discrete_sigma_schedule(plain, 10, schedule="polyexponential")


def test_trailing_spacing_is_sgm_uniform_up_to_rounding():
    """A1111 / ComfyUI's `sgm_uniform` (Stability's generative-models LegacyDDPMDiscretization: t_k =
    ⌊(T-1)(1 - k/n)⌋; ComfyUI keeps them fractional) is diffusers' `trailing` but for rounding:
    round(T(1 - k/n)) - 1 differs from it by at most one timestep (first for n = 3: 333 against 332)."""
    config = common.ScheduleConfig(timestep_spacing="trailing")
    for n in (1, 2, 3, 4, 7, 10, 25, 50):
        trailing = common.spaced_timesteps(config, n)
        sgm = np.linspace(999, 0, n, endpoint=False).astype(np.int64)
        comfy = np.linspace(999, 0, n + 1)[:-1]
        assert trailing[0] == sgm[0] == 999 and np.abs(trailing - sgm).max() <= 1
        assert np.abs(trailing - comfy).max() < 1.5
    assert list(common.spaced_timesteps(config, 3)) == [999, 666, 332]


@pytest.mark.parametrize("cls, field, value", [
    (UniPCScheduler, "predict_x0", False),
    (UniPCScheduler, "disable_corrector", [2]),
    (UniPCScheduler, "solver_type", "bh3"),
    (UniPCScheduler, "solver_order", 4),
    (UniPCScheduler, "use_flow_sigmas", True),
    (UniPCScheduler, "thresholding", True),
    (DEISScheduler, "algorithm_type", "unknown"),
    (DEISScheduler, "solver_order", 4),
    (DEISScheduler, "beta_schedule", "squaredcos_cap_v2"),
    (DPMSolverScheduler, "algorithm_type", "sde-dpmsolver"),
    (DPMSolverScheduler, "solver_order", 3),
    (DPMPP2MSDEScheduler, "use_lu_lambdas", True),
    (DPMPP3MSDEScheduler, "final_sigmas_type", "max"),
    (DPMPP3MSDEScheduler, "prediction_type", "flow_prediction"),
])
def test_unsupported_config_values_raise(cls, field, value):
    with pytest.raises(ValueError, match=f"{field}=.*allowed|{field}=.*set it to False"):
        cls.from_config({**SD1, field: value})


@pytest.mark.parametrize("cls", [EulerScheduler, LMSScheduler, DPMSolverScheduler, UniPCScheduler, DEISScheduler,
                                 DPMPP3MSDEScheduler])
def test_one_sigma_schedule_at_most(cls):
    with pytest.raises(ValueError, match="use_karras_sigmas and use_beta_sigmas are both set"):
        cls.from_config({**SD1, **KARRAS, **BETA})


@pytest.mark.parametrize("cls, torch_cls", [
    (UniPCScheduler, diffusers.UniPCMultistepScheduler),
    (DEISScheduler, diffusers.DEISMultistepScheduler),
    (DPMSolverScheduler, diffusers.DPMSolverMultistepScheduler),
    (DPMPP2MSDEScheduler, diffusers.DPMSolverMultistepScheduler),
    (EulerScheduler, diffusers.EulerDiscreteScheduler),
    (LMSScheduler, diffusers.LMSDiscreteScheduler),
    (DPMPP3MSDEScheduler, diffusers.EulerDiscreteScheduler),  # no diffusers class: its schedule is Euler's
])
def test_config_defaults_follow_diffusers(cls, torch_cls):
    ours, theirs = cls.from_config({}).config, torch_cls().config
    for field in dataclasses.fields(ours):
        if field.name in theirs and not (cls is DPMPP2MSDEScheduler and field.name == "algorithm_type"):
            assert getattr(ours, field.name) == theirs[field.name], field.name


def test_saved_configs_load_and_names_resolve():
    for name, torch_cls, extra in [
        ("unipc", diffusers.UniPCMultistepScheduler, {}),
        ("deis", diffusers.DEISMultistepScheduler, {}),
        ("dpmpp_2m_sde", diffusers.DPMSolverMultistepScheduler, SDE),
    ]:
        saved = json.loads(torch_cls.from_config({**SD1, **BETA, **extra}).to_json_string())
        assert type(scheduler_from_config(saved, kind=name)) is SCHEDULERS[name]
        assert scheduler_from_config(saved).config.use_beta_sigmas
    assert type(scheduler_from_config({"_class_name": "UniPCMultistepScheduler"})) is UniPCScheduler
    assert type(scheduler_from_config({"_class_name": "FlaxDEISMultistepScheduler"})) is DEISScheduler
    assert type(scheduler_from_config({}, kind="DPMPP3MSDEScheduler")) is DPMPP3MSDEScheduler


def test_switching_a_dpm_solver_config_to_unipc_and_deis():
    """diffusers maps a DPM-Solver's solver_type / algorithm_type onto UniPC's and DEIS's own; so do we."""
    saved = json.loads(diffusers.DPMSolverMultistepScheduler.from_config(
        {**SD1, "solver_type": "heun"}).to_json_string())
    assert diffusers.UniPCMultistepScheduler.from_config(saved).config.solver_type == "bh2"
    assert UniPCScheduler.from_config(saved).config.solver_type == "bh2"
    theirs = diffusers.DEISMultistepScheduler.from_config(saved).config
    assert (theirs.algorithm_type, theirs.solver_type) == ("deis", "logrho")
    assert DEISScheduler.from_config(saved) == DEISScheduler.from_config(SD1)


# ---- end to end ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheduler, config", [
    ("UniPCMultistepScheduler", {"solver_order": 3}),
    ("DEISMultistepScheduler", {}),
    ("DPMSolverMultistepScheduler", {**SDE, "use_karras_sigmas": True}),
], ids=["unipc-3", "deis", "dpmpp-2m-sde-karras"])
def test_images_match_diffusers(tmp_path, monkeypatch, scheduler, config):
    """The small SD 1.x checkpoint through both pipelines; the SDE's noise is what ours draws from its key
    (image 0's sampler key, folded with the evaluation index), handed to diffusers' steps in order."""
    if config.get("algorithm_type") == SDE["algorithm_type"]:
        shape = (2, 4, 16, 16)
        _, sampler_key = random_draws(jax.random.key(0), shape, 1)
        noises = (torch.from_numpy(np.asarray(common.step_noise(jax.random.fold_in(sampler_key, i), shape)))
                  for i in range(4))
        monkeypatch.setattr(diffusers.schedulers.scheduling_dpmsolver_multistep, "randn_tensor",
                            lambda *args, **kwargs: next(noises))
    pipe, _, ours, expected = run_both(tmp_path, "sd1", scheduler, 4, 7.5, NEGATIVE, **config)
    assert type(pipe.scheduler) is {"UniPCMultistepScheduler": UniPCScheduler, "DEISMultistepScheduler": DEISScheduler,
                                     "DPMSolverMultistepScheduler": DPMSolverScheduler}[scheduler]
    assert ours.shape == expected.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - 0.5).mean() > 0.01  # not a constant image: the comparison means something
