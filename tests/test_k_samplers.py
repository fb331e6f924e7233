"""Parity of the two-evaluation samplers with their oracles at every model evaluation: Heun, DPM2, DPM2 ancestral and
DPM++ SDE against diffusers' PyTorch classes, DPM++ 2S ancestral against k-diffusion's `sample_dpmpp_2s_ancestral`
written out in float64 numpy below; img2img starts, noise, scan compatibility, the Scheduler protocol, configs and
end-to-end images."""

import dataclasses
import hashlib
import json

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_sigma_schedulers as sigma_tests
import torch
from builders import torch_pipeline
from test_pipeline import ATOL, NEGATIVE, PROMPTS
from test_schedulers import SHAPE, X_T, fake_model
from test_sigma_schedulers import (ATOL_TIMESTEPS, IMAGE, IMAGE_NOISE, SD1, atol_for, noises_for,
                                   run_ours)

from sdflax import StableDiffusion
from sdflax.schedulers import (DPM2AncestralScheduler, DPM2Scheduler, DPMpp2SAncestralScheduler, DPMSolverSDEScheduler,
                               EulerScheduler, HeunScheduler, scheduler_from_config)

# diffusers' KDPM2 set_timesteps feeds torch tensors to numpy, which warns once per σ.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TORCH = {
    HeunScheduler: diffusers.HeunDiscreteScheduler,
    DPM2Scheduler: diffusers.KDPM2DiscreteScheduler,
    DPM2AncestralScheduler: diffusers.KDPM2AncestralDiscreteScheduler,
    DPMSolverSDEScheduler: diffusers.DPMSolverSDEScheduler,
}
KINDS = {"heun": HeunScheduler, "dpm2": DPM2Scheduler, "dpm2_ancestral": DPM2AncestralScheduler,
         "dpmpp_2s_ancestral": DPMpp2SAncestralScheduler, "dpmpp_sde": DPMSolverSDEScheduler}
STOCHASTIC = (DPM2AncestralScheduler, DPMpp2SAncestralScheduler, DPMSolverSDEScheduler)

# Two evaluations per step, each at σ that may differ from torch's in the last bit or two (torch's float32 sqrt,
# log and exp are not correctly rounded, and the midpoints go through all three): twice the σ samplers' ATOL_SAMPLES,
# still a few float32 ulps of samples that reach |x| ≈ 50.
ULPS = 2


def evaluations(n):
    return 2 * n - 1  # the last step, to σ = 0, is a single (Euler) evaluation


def patch_noise(cls, noises, monkeypatch, current):
    """diffusers' stochastic samplers get `noises[j]` at evaluation j = current[0]."""
    if cls is DPM2AncestralScheduler:
        monkeypatch.setattr(diffusers.schedulers.scheduling_k_dpm_2_ancestral_discrete, "randn_tensor",
                            lambda *args, **kwargs: torch.from_numpy(noises[current[0]]))
    if cls is DPMSolverSDEScheduler:  # instead of its torchsde Brownian tree
        monkeypatch.setattr(diffusers.schedulers.scheduling_dpmsolver_sde, "BrownianTreeNoiseSampler",
                            lambda *args, **kwargs: lambda sigma, sigma_next: torch.from_numpy(noises[current[0]]))


# run_diffusers' results by its arguments: the parity tests and the "setting changes the oracle" test ask for many
# of the same runs, and diffusers' KDPM2 runs are slow (they interpolate σ -> t in torch, σ by σ).
DIFFUSERS_RUNS = {}


def run_diffusers(cls, config, n, noises=None, monkeypatch=None, start=0):
    """diffusers' loop as its pipelines run it (txt2img, or img2img from step `start`: set_begin_index(start *
    order)); `noises[j]` is what evaluation j draws. Returns timesteps, init_noise_sigma and per-evaluation arrays
    (read-only: they are memoized)."""
    noise_digest = None if noises is None else hashlib.sha256(np.ascontiguousarray(noises).tobytes()).hexdigest()
    key = (cls, json.dumps(config, sort_keys=True), n, start, noise_digest)
    if key not in DIFFUSERS_RUNS:
        DIFFUSERS_RUNS[key] = _run_diffusers(cls, config, n, noises, monkeypatch, start)
    return DIFFUSERS_RUNS[key]


def _run_diffusers(cls, config, n, noises, monkeypatch, start):
    sched = TORCH[cls].from_config(config)
    sched.set_timesteps(n)
    begin = start * sched.order
    current = [0]
    if noises is not None:
        patch_noise(cls, noises, monkeypatch, current)
    if start:
        sched.set_begin_index(begin)
        x = sched.add_noise(torch.from_numpy(IMAGE), torch.from_numpy(IMAGE_NOISE), sched.timesteps[begin:begin + 1])
    else:
        x = torch.from_numpy(X_T) * sched.init_noise_sigma
    out = {"inputs": [], "samples": [], "x0": []}
    for j, t in enumerate(sched.timesteps[begin:]):
        current[0] = j
        model_input = sched.scale_model_input(x, t)
        prediction = torch.from_numpy(fake_model(model_input.numpy(), float(t)))
        result = sched.step(prediction, t, x)
        x = result.prev_sample
        for name, value in (("inputs", model_input), ("samples", x), ("x0", result.pred_original_sample)):
            out[name].append(value.numpy())
    arrays = {k: np.stack(v) for k, v in out.items()}
    timesteps = sched.timesteps[begin:].numpy().copy()
    for array in (timesteps, *arrays.values()):
        array.setflags(write=False)
    return timesteps, float(sched.init_noise_sigma), arrays


def assert_close(ours, theirs, atol):
    for name in ("inputs", "x0", "samples"):
        assert ours[name].dtype == np.float32 and ours[name].shape == theirs[name].shape, name
        assert np.isfinite(theirs[name]).all(), name
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=atol, err_msg=name)


def assert_parity(cls, config, n, monkeypatch=None, start=0, ulps=ULPS):
    noises = noises_for(evaluations(n) - 2 * start) if cls in STOCHASTIC else None
    their_t, their_sigma, theirs = run_diffusers(cls, config, n, noises, monkeypatch, start)
    our_t, our_sigma, ours = run_ours(cls, config, n, noises, start)
    assert our_t.dtype == np.float32 and our_t.shape == their_t.shape == (evaluations(n) - 2 * start,)
    np.testing.assert_allclose(our_t, their_t, rtol=0, atol=ATOL_TIMESTEPS)
    assert our_sigma == pytest.approx(their_sigma, rel=1e-6)
    assert_close(ours, theirs, ulps * atol_for(config))


KARRAS = {"use_karras_sigmas": True}
EXPONENTIAL = {"use_exponential_sigmas": True}
BETA = {"use_beta_sigmas": True}
V_PRED = {"prediction_type": "v_prediction"}
TRAILING = {"timestep_spacing": "trailing"}
LEADING = {"timestep_spacing": "leading"}

# Two steps: one two-evaluation step and the final Euler one. With linspace spacing the second σ is σ_min ≈ 0.03,
# where Heun's corrector divides x̃ - x̂_0 by it and DPM2 ancestral's σ_down² = σ_1² - σ_up² cancels to 4e-9: float32
# rounding differences (torch's sqrt) grow far past an ulp there, in diffusers as much as here. Trailing spacing
# keeps the same structure well conditioned. For the same reason the beta σ (which keep both end points and crowd
# at them) are tested at 10 steps, not 3: with 3 the second step jumps from σ ≈ 7.3 to σ_min.
CASES = {
    "sd1-20": (SD1, 20),
    "sd1-1": (SD1, 1),
    "trailing-2": ({**SD1, **TRAILING}, 2),
    "karras-10": ({**SD1, **KARRAS}, 10),
    "v-pred": ({**SD1, **V_PRED}, 10),
    "v-pred-karras": ({**SD1, **V_PRED, **KARRAS}, 10),
    "exponential-10": ({**SD1, **EXPONENTIAL}, 10),
    "beta-10": ({**SD1, **BETA}, 10),
    "v-pred-exponential": ({**SD1, **V_PRED, **EXPONENTIAL}, 10),
    "trailing-7": ({**SD1, **TRAILING}, 7),
    "leading-10": ({**SD1, **LEADING}, 10),
    "linear-defaults": ({}, 10),  # σ_max = 157 (atol_for scales the tolerance)
}
HEUN_CASES = {
    **CASES,
    "sample-pred": ({**SD1, "prediction_type": "sample"}, 10),
    "clip-sample": ({**SD1, "prediction_type": "sample", "clip_sample": True, "clip_sample_range": 0.5}, 10),
}


@pytest.mark.parametrize("name", list(HEUN_CASES))
def test_heun_matches_diffusers(name):
    assert_parity(HeunScheduler, *HEUN_CASES[name])


@pytest.mark.parametrize("name", list(CASES))
def test_dpm2_matches_diffusers(name):
    assert_parity(DPM2Scheduler, *CASES[name])


@pytest.mark.parametrize("name", list(CASES))
def test_dpm2_ancestral_matches_diffusers_with_same_noise(name, monkeypatch):
    # Two steps, σ_0 = 14.6 to σ_1 = 1.6: σ_down² = σ_1² - σ_up² keeps 1.2% of σ_1², so its float32 rounding
    # (diffusers' and ours) is 6 bits coarser, and the midpoint √(σ_0 σ_down) with it.
    assert_parity(DPM2AncestralScheduler, *CASES[name], monkeypatch, ulps=4 if name == "trailing-2" else ULPS)


@pytest.mark.parametrize("name", list(CASES))
def test_dpmpp_sde_matches_diffusers_with_same_noise(name, monkeypatch):
    # The beta σ crowd at σ_max, so the first steps keep samples at |x| up to 57 (x_T's 3.9σ entries), 2.7-3.9x the
    # σ_max ATOL_SAMPLES is set for; there the fourth evaluation's samples differed by 4.2e-5 (11 ulps at |x| = 39)
    # on a CPU with AVX-512, where torch's and XLA's exp and log round otherwise; elsewhere within 2 ulps.
    assert_parity(DPMSolverSDEScheduler, *CASES[name], monkeypatch, ulps=3 * ULPS if name == "beta-10" else ULPS)


@pytest.mark.parametrize("cls", list(TORCH), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("start", [1, 6])
def test_img2img_start_matches_diffusers(cls, start, monkeypatch):
    """set_timesteps(n, start=k) + add_noise(state, x_0, ε, 0), as diffusers' img2img: set_begin_index(k · order),
    add_noise at timesteps[2k], then the remaining 2(n - k) - 1 evaluations."""
    config = {**SD1, **KARRAS} if cls is HeunScheduler else SD1
    assert_parity(cls, config, 10, monkeypatch, start=start)
    with pytest.raises(ValueError, match="start"):
        cls.from_config(config).set_timesteps(10, shape=SHAPE, start=10)


SIGMA_RANGE = {"sigma_min": 0.1, "sigma_max": 10.0}


@pytest.mark.parametrize("cls, schedule", [
    (HeunScheduler, KARRAS), (DPM2Scheduler, BETA), (DPM2AncestralScheduler, EXPONENTIAL),
    (DPMSolverSDEScheduler, EXPONENTIAL), (DPMSolverSDEScheduler, KARRAS),
], ids=["heun-karras", "dpm2-beta", "dpm2-ancestral-exponential", "dpmpp-sde-exponential", "dpmpp-sde-karras"])
def test_config_sigma_range_as_diffusers(cls, schedule, monkeypatch):
    """A config's sigma_min / sigma_max (which diffusers' `from_config` keeps from a compatible class's config, e.g.
    Euler's) bound the redistributed σ as diffusers' class reads them: but for DPMSolverSDEScheduler's Karras σ,
    which keep the spaced end points."""
    config = {**SD1, **schedule, **SIGMA_RANGE}
    assert_parity(cls, config, 10, monkeypatch)
    sigmas = np.asarray(cls.from_config(config).set_timesteps(10, shape=SHAPE).step_sigmas)
    ignored = cls is DPMSolverSDEScheduler and schedule is KARRAS
    assert sigmas[0] == pytest.approx(14.6146 if ignored else 10.0, rel=1e-5)
    assert sigmas[-1] == pytest.approx(0.0291675 if ignored else 0.1, rel=1e-5)


# ---- DPM++ 2S ancestral: k-diffusion's sampler in float64 --------------------------------------------------------


def dpmpp_2s_ancestral_float64(config, n, noises):
    """k-diffusion's `sample_dpmpp_2s_ancestral` (eta = 1, s_noise = 1) in float64 on diffusers' Euler σ schedule,
    the model wrapped as k-diffusion's CompVis denoisers wrap it; `noises[j]` is what evaluation j adds. Returns
    per-evaluation model inputs, x̂_0 and samples."""
    euler = diffusers.EulerDiscreteScheduler.from_config(config)  # Euler ancestral's σ too, and Karras'
    euler.set_timesteps(n)
    sigmas, timesteps = euler.sigmas.numpy().astype(np.float64), euler.timesteps.numpy().astype(np.float64)
    alphas_cumprod = euler.alphas_cumprod.numpy().astype(np.float64)
    log_train_sigmas = np.log(np.sqrt((1 - alphas_cumprod) / alphas_cumprod))  # increasing in t
    prediction_type = euler.config.prediction_type
    out = {"inputs": [], "samples": [], "x0": []}

    def denoise(x, sigma, t):
        model_input = x / np.sqrt(sigma**2 + 1)
        prediction = fake_model(model_input, t).astype(np.float64)
        out["inputs"].append(model_input)
        if prediction_type == "epsilon":
            x0 = x - sigma * prediction
        elif prediction_type == "v_prediction":
            x0 = prediction * (-sigma / np.sqrt(sigma**2 + 1)) + x / (sigma**2 + 1)
        else:
            x0 = prediction
        out["x0"].append(x0)
        return x0

    def sigma_to_t(sigma):  # k-diffusion's DiscreteSchedule.sigma_to_t: linear in log σ between training σ
        return np.interp(np.log(sigma), log_train_sigmas, np.arange(len(log_train_sigmas)))

    x = X_T.astype(np.float64) * float(euler.init_noise_sigma)
    for i in range(n):
        denoised = denoise(x, sigmas[i], timesteps[i])
        sigma_from, sigma_to = sigmas[i], sigmas[i + 1]  # k-diffusion's get_ancestral_step
        sigma_up = min(sigma_to, (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** 0.5)
        sigma_down = (sigma_to**2 - sigma_up**2) ** 0.5
        if sigma_down == 0:  # Euler method
            d = (x - denoised) / sigmas[i]
            x = x + d * (sigma_down - sigmas[i])
        else:  # DPM-Solver++(2S)
            t, t_next = -np.log(sigmas[i]), -np.log(sigma_down)
            r = 1 / 2
            h = t_next - t
            s = t + r * h
            x_2 = (np.exp(-s) / np.exp(-t)) * x - np.expm1(-h * r) * denoised
            out["samples"].append(x_2)
            denoised_2 = denoise(x_2, np.exp(-s), sigma_to_t(np.exp(-s)))
            x = (np.exp(-t_next) / np.exp(-t)) * x - np.expm1(-h) * denoised_2
        if sigmas[i + 1] > 0:  # noise, at the step's second evaluation
            x = x + noises[len(out["samples"])] * sigma_up
        out["samples"].append(x)
    return timesteps, float(euler.init_noise_sigma), {k: np.stack(v) for k, v in out.items()}


DPMPP_2S_CASES = {**CASES, "sample-pred": ({**SD1, "prediction_type": "sample"}, 10)}


@pytest.mark.parametrize("name", list(DPMPP_2S_CASES))
def test_dpmpp_2s_ancestral_matches_k_diffusion_in_float64(name):
    config, n = DPMPP_2S_CASES[name]
    noises = noises_for(evaluations(n))
    their_t, their_sigma, theirs = dpmpp_2s_ancestral_float64(config, n, noises)
    our_t, our_sigma, ours = run_ours(DPMpp2SAncestralScheduler, config, n, noises)
    np.testing.assert_allclose(our_t[::2], their_t, rtol=0, atol=ATOL_TIMESTEPS)  # the midpoints' are checked by x̂_0
    assert our_sigma == pytest.approx(their_sigma, rel=1e-6)
    assert_close(ours, theirs, ULPS * atol_for(config))


@pytest.mark.parametrize("schedule", [EXPONENTIAL, BETA, {**EXPONENTIAL, **SIGMA_RANGE}],
                         ids=["exponential", "beta", "exponential-sigma-range"])
def test_dpmpp_2s_ancestral_sigmas_are_euler_s(schedule):
    """The use_*_sigmas flags (and sigma_min / sigma_max) place σ as Euler's: each step's first evaluation is at
    Euler's σ_k (ours exactly; diffusers' up to torch's float32 sqrt), and the step lands on its σ_{k+1}."""
    config = {**SD1, **schedule}
    state = DPMpp2SAncestralScheduler.from_config(config).set_timesteps(10, shape=SHAPE)
    ours = np.asarray(EulerScheduler.from_config(config).set_timesteps(10).sigmas)
    theirs = diffusers.EulerDiscreteScheduler.from_config(config)
    theirs.set_timesteps(10)
    np.testing.assert_array_equal(np.asarray(state.sigmas)[::2], ours[:-1])
    np.testing.assert_array_equal(np.asarray(state.step_sigmas)[1::2], ours[1:-1])
    np.testing.assert_allclose(np.asarray(state.sigmas)[::2], theirs.sigmas.numpy()[:-1], rtol=1e-6, atol=0)
    spaced = np.asarray(EulerScheduler.from_config(SD1).set_timesteps(10).sigmas)
    assert np.abs(ours - spaced).max() > 0.1  # the schedule is not the spaced one


def test_dpmpp_2s_ancestral_img2img_start_is_the_schedule_tail():
    sched = DPMpp2SAncestralScheduler.from_config({**SD1, **KARRAS})
    full, tail = sched.set_timesteps(10, shape=SHAPE), sched.set_timesteps(10, shape=SHAPE, start=3)
    assert tail.timesteps.shape == (evaluations(10) - 6,)
    for field in ("timesteps", "sigmas", "step_sigmas", "coef_sample", "coef_x0", "sigma_up", "second"):
        np.testing.assert_array_equal(np.asarray(getattr(tail, field)), np.asarray(getattr(full, field))[6:], field)
    assert tail.init_noise_sigma == full.init_noise_sigma
    with pytest.raises(ValueError, match="start"):
        sched.set_timesteps(10, shape=SHAPE, start=10)


# ---- the settings under test change the oracles ----------------------------------------------------------------


def oracle_samples(cls, config, n, monkeypatch):
    if cls is DPMpp2SAncestralScheduler:
        return dpmpp_2s_ancestral_float64(config, n, noises_for(evaluations(n)))[2]["samples"]
    noises = noises_for(evaluations(n)) if cls in STOCHASTIC else None
    return run_diffusers(cls, config, n, noises, monkeypatch)[2]["samples"]


@pytest.mark.parametrize("cls, cases", [
    (HeunScheduler, HEUN_CASES), (DPM2Scheduler, CASES), (DPM2AncestralScheduler, CASES),
    (DPMSolverSDEScheduler, CASES), (DPMpp2SAncestralScheduler, DPMPP_2S_CASES),
], ids=lambda value: value.__name__ if isinstance(value, type) else "")
def test_every_setting_under_test_changes_the_oracle(cls, cases, monkeypatch):
    """Each setting a case adds to SD 1.x's schedule, set back to its default, gives other samples."""
    for name, (config, n) in cases.items():
        changed = [key for key in config if SD1.get(key) != config[key]] or ([] if config else ["all of SD1"])
        theirs = oracle_samples(cls, config, n, monkeypatch) if changed else None
        for key in changed:
            default = SD1 if key == "all of SD1" else {k: v for k, v in config.items() if k != key}
            default_theirs = oracle_samples(cls, default, n, monkeypatch)
            assert np.abs(theirs[-1] - default_theirs[-1]).max() > 1e-3, f"{name}: {key}"


# ---- noise -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", STOCHASTIC, ids=lambda cls: cls.__name__)
def test_noise_comes_from_the_key(cls):
    sched = cls.from_config(SD1)
    shape = (2, 4, 64, 64)
    state = sched.set_timesteps(10, shape=shape)
    i = 3  # a second evaluation: every stochastic sampler adds noise there
    x = jax.random.normal(jax.random.key(3), shape) * 3.0
    step = lambda key: sched.step(state, 0.9 * x, i, x, key=key)[0]  # noqa: E731
    a, a_again, b = step(jax.random.key(1)), step(jax.random.key(1)), step(jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(a_again))
    # a - b = σ_up (z_a - z_b) scaled by the fresh share of the noise (DPM++ SDE: the rest is the first stage's)
    fresh = state.noise_fresh[i] if cls is DPMSolverSDEScheduler else 1.0
    expected = 2 * float(state.sigma_up[i] * fresh) ** 2
    assert expected > 0.01
    assert float(np.var(np.asarray(a, np.float64) - np.asarray(b, np.float64))) == pytest.approx(expected, rel=0.03)
    with pytest.raises(ValueError, match="key"):
        sched.step(state, x, i, x)
    with pytest.raises(ValueError, match="either"):
        sched.step(state, x, i, x, key=jax.random.key(0), variance_noise=x)


def test_dpmpp_sde_noise_is_brownian_as_diffusers_tree():
    """A step's two noises are increments of one Brownian path over [σ_mid, σ_k] and [σ_{k+1}, σ_k], each divided
    by its std: correlation √((σ_k - σ_mid) / (σ_k - σ_{k+1})), as diffusers' torchsde BrownianTreeNoiseSampler."""
    sched = DPMSolverSDEScheduler.from_config(SD1)
    shape = (1, 4, 64, 64)
    state = sched.set_timesteps(10, shape=shape)
    k = 3
    sigma, sigma_mid, sigma_next = (float(state.sigmas[2 * k]), float(state.sigmas[2 * k + 1]),
                                    float(state.step_sigmas[2 * k + 1]))
    expected = np.sqrt((sigma - sigma_mid) / (sigma - sigma_next))

    # With x = 0 and a zero ε prediction, x̂_0 = 0 and a step returns σ_up z: z as the sampler adds it.
    zero = jnp.zeros(shape)
    first, state = sched.step(state, zero, 2 * k, zero, key=jax.random.key(1))
    second, _ = sched.step(state, zero, 2 * k + 1, zero, key=jax.random.key(2))
    z1 = np.asarray(first, np.float64) / float(state.sigma_up[2 * k])
    z2 = np.asarray(second, np.float64) / float(state.sigma_up[2 * k + 1])
    assert np.var(z1) == pytest.approx(1, abs=0.04) and np.var(z2) == pytest.approx(1, abs=0.04)
    assert np.mean(z1 * z2) == pytest.approx(expected, abs=0.03)  # ± 4 standard errors

    tree = diffusers.schedulers.scheduling_dpmsolver_sde.BrownianTreeNoiseSampler(
        torch.zeros(shape), sigma_next, float(state.sigmas[0]), seed=0)
    n1, n2 = tree(torch.tensor(sigma), torch.tensor(sigma_mid)), tree(torch.tensor(sigma), torch.tensor(sigma_next))
    assert float((n1.double() * n2.double()).mean()) == pytest.approx(expected, abs=0.03)
    assert 0.3 < expected < 0.9  # neither independent nor the same noise


# ---- scan, protocol, configs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_jit_scan_equals_eager(kind):
    sched = sigma_tests.PROTOCOL_CASES[kind]  # SD 1.4's config: the protocol test's compiled scan is reused
    assert sched.set_timesteps(5, shape=SHAPE).timesteps.shape == (evaluations(5),)
    sigma_tests.assert_scan_equals_eager(sched, 5, ULPS * atol_for(SD1))


@pytest.mark.parametrize("kind", list(KINDS))
def test_follows_the_protocol(kind):
    assert isinstance(sigma_tests.PROTOCOL_CASES[kind], KINDS[kind])
    sigma_tests.test_every_scheduler_follows_the_protocol(kind)


@pytest.mark.parametrize("cls", list(KINDS.values()), ids=lambda cls: cls.__name__)
def test_the_state_needs_the_shape(cls):
    with pytest.raises(ValueError, match="shape"):
        cls.from_config(SD1).set_timesteps(10)


@pytest.mark.parametrize("cls", list(TORCH), ids=lambda cls: cls.__name__)
def test_defaults_follow_diffusers_and_saved_configs_load(cls):
    ours, theirs = cls.from_config({}).config, TORCH[cls]().config
    for field in dataclasses.fields(ours):
        if field.name in theirs:
            assert getattr(ours, field.name) == theirs[field.name], field.name
    saved = json.loads(TORCH[cls].from_config(SD1).to_json_string())  # as in scheduler_config.json
    assert type(scheduler_from_config(saved)) is cls
    assert type(scheduler_from_config({**SD1, "_class_name": "Flax" + TORCH[cls].__name__})) is cls


@pytest.mark.parametrize("cls, field, value", [
    *[(cls, "prediction_type", "sample") for cls in (DPM2Scheduler, DPM2AncestralScheduler, DPMSolverSDEScheduler)],
    (HeunScheduler, "beta_schedule", "squaredcos_cap_v2"),
    (DPMSolverSDEScheduler, "timestep_spacing", "karras"),
])
def test_unsupported_config_values_raise(cls, field, value):
    with pytest.raises(ValueError, match=f"{field}=.*allowed"):
        cls.from_config({**SD1, field: value})


@pytest.mark.parametrize("cls", list(KINDS.values()), ids=lambda cls: cls.__name__)
def test_one_sigma_schedule_at_a_time(cls):
    with pytest.raises(ValueError, match="use_exponential_sigmas and use_beta_sigmas are both set"):
        cls.from_config({**SD1, **EXPONENTIAL, **BETA})


# ---- end to end ------------------------------------------------------------------------------------------------


def test_images_match_diffusers(tmp_path):
    """Heun and DPM2 on one checkpoint (run_both's, built once): diffusers' `from_config(pipe.scheduler.config)`
    and our `from_pretrained(..., scheduler=)`. Two steps: three UNet evaluations on each side."""
    theirs = torch_pipeline("sd1", "HeunDiscreteScheduler")
    theirs.save_pretrained(tmp_path)
    latents = np.random.default_rng(0).standard_normal((2, 4, 16, 16), dtype=np.float32)
    images = {}
    for kind, torch_cls in (("heun", diffusers.HeunDiscreteScheduler), ("dpm2", diffusers.KDPM2DiscreteScheduler)):
        theirs.scheduler = torch_cls.from_config(theirs.scheduler.config)
        pipe, params = StableDiffusion.from_pretrained(tmp_path, scheduler=kind)
        assert type(pipe.scheduler) is KINDS[kind]
        with torch.no_grad():
            expected = theirs(PROMPTS, negative_prompt=NEGATIVE, guidance_scale=7.5, num_inference_steps=2,
                              latents=torch.from_numpy(latents), output_type="np").images
        ours = pipe(pipe.prepare_inputs(PROMPTS), params, jax.random.key(0), 2, guidance_scale=7.5, latents=latents,
                    neg_prompt_ids=pipe.prepare_inputs(NEGATIVE)).images
        assert ours.shape == expected.shape and ours.dtype == np.float32
        np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL, err_msg=kind)
        assert np.abs(expected - 0.5).mean() > 0.01  # not a constant image: the comparison means something
        images[kind] = expected
    assert np.abs(images["heun"] - images["dpm2"]).mean() > 1e-3  # the two samplers differ
