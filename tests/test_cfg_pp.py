"""CFG++ (Chung et al. 2024) for Euler and Euler a, against a float64 reference written here from the paper's
algorithm (ComfyUI's `sample_euler_cfg_pp` / `sample_euler_ancestral_cfg_pp`), one step checked by hand; and in the
pipelines: the unconditional half reaches the sampler at any guidance scale."""

from __future__ import annotations

import math

import numpy as np
import pytest
from builders import REPO

import jax
import jax.numpy as jnp

from sdflax import StableDiffusion, sampling
from sdflax.schedulers import SCHEDULERS, a1111_name, scheduler_from_config

SD1 = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1,
       "timestep_spacing": "leading"}
SHAPE = (2, 4, 8, 8)
SCALE = 1.5  # CFG++'s λ: guidance near 1


def eps(x, sigma, row):
    """A fake UNet, float64: an ε for the unconditional (row 0) or conditional (row 1) prompt, depending on x."""
    rng = np.random.default_rng(row)
    return 0.8 * x / math.sqrt(sigma**2 + 1) + rng.standard_normal(SHAPE)


def reference(kind, sigmas, x, noises, cfg_pp=True):
    """The paper's Algorithm (ε-prediction, σ parametrisation x = x₀ + σ ε), float64: x̂₀ from the guided ε, the
    re-noising along the unconditional ε (`cfg_pp=False`: the guided one, the base sampler); Euler a splits
    σ_{i+1} into σ_down and fresh noise σ_up."""
    previous = None  # DPM++ 2M: the last step's x̂₀ it re-noises from (U_{i-1}; D_{i-1} without CFG++)
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        e_u, e_c = eps(x, s, 0), eps(x, s, 1)
        guided = e_u + SCALE * (e_c - e_u)
        x0, renoise = x - s * guided, e_u if cfg_pp else guided
        if kind == "euler_cfg_pp":
            x = x0 + s_next * renoise
        elif kind == "euler_ancestral_cfg_pp":
            up = math.sqrt(s_next**2 * (s**2 - s_next**2) / s**2)
            x = x0 + math.sqrt(s_next**2 - up**2) * renoise + up * noises[i]
        else:  # ComfyUI's sample_dpmpp_2m_cfg_pp, t = -log σ
            x0_renoise = x - s * renoise
            step = x0 + s_next / s * (x - x0_renoise)
            if previous is not None and s_next > 0:
                h, h_last = math.log(s / s_next), math.log(sigmas[i - 1] / s)
                step -= math.expm1(-h) / (2 * h_last / h) * (x0 - previous)
            x, previous = step, x0_renoise
    return x


def ours(kind, n, x, noises):
    """The scheduler through `sampling.denoise` with a model that returns (guided, unconditional), as the
    pipelines' guided model does for it."""
    scheduler = SCHEDULERS[kind].from_config(SD1)
    state = scheduler.set_timesteps(n, shape=SHAPE)
    vp = kind == "dpmpp_2m_cfg_pp"  # x = α x_σ, α = 1/√(σ² + 1): the model's input unscaled, x_T ~ N(0, I)

    noise_u, noise_c = (jnp.asarray(np.random.default_rng(row).standard_normal(SHAPE), jnp.float32) for row in (0, 1))

    def model(model_input, t, i):  # `eps` on x / √(σ² + 1), which scale_model_input gives
        e_u, e_c = 0.8 * model_input + noise_u, 0.8 * model_input + noise_c
        return sampling.classifier_free_guidance(e_u, e_c, SCALE), e_u

    if kind == "euler_ancestral_cfg_pp":  # the noise of step i given, as the reference's
        step = scheduler.step
        scheduler = type("Given", (type(scheduler),), {
            "step": lambda self, st, out, i, x, key=None, unconditional=None: step(
                st, out, i, x, variance_noise=jnp.asarray(noises)[i], unconditional=unconditional)})(scheduler.config)
    out = sampling.denoise(model, scheduler, jnp.asarray(x, jnp.float32) * state.init_noise_sigma, n,
                           jax.random.key(0), model_takes_step=True)
    sigmas = np.asarray(state.sigmas, np.float64)
    # where the reference starts, in σ's parametrisation: x_σ = x / α_0 for the VP sampler
    start = x * math.sqrt(sigmas[0] ** 2 + 1) if vp else x * state.init_noise_sigma
    return np.asarray(out, np.float64), sigmas, start


@pytest.mark.parametrize("kind", ["euler_cfg_pp", "euler_ancestral_cfg_pp", "dpmpp_2m_cfg_pp"])
def test_cfg_pp_equals_the_papers_algorithm_in_float64(kind):
    n = 8
    x_t = np.random.default_rng(2).standard_normal(SHAPE)
    noises = np.random.default_rng(3).standard_normal((n, *SHAPE))
    got, sigmas, start = ours(kind, n, x_t, noises)
    expected = reference(kind, sigmas, start, noises)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    # the unconditional re-noising is what makes it CFG++: the base sampler with the same guidance lands elsewhere
    assert np.abs(reference(kind, sigmas, start, noises, cfg_pp=False) - expected).max() > 1e-2
    assert type(scheduler_from_config(SD1, kind.removesuffix("_cfg_pp"))) is not SCHEDULERS[kind]
    names = {"euler_cfg_pp": "Euler CFG++", "euler_ancestral_cfg_pp": "Euler a CFG++",
             "dpmpp_2m_cfg_pp": "DPM++ 2M CFG++"}
    assert a1111_name(SCHEDULERS[kind].from_config(SD1)) == names[kind]


def test_one_euler_cfg_pp_step_by_hand():
    """σ_0 = 2, σ_1 = 1, x = 3, ε(guided) = 1, ε(uncond) = 0.5: x̂₀ = 3 - 2 · 1 = 1, x_1 = 1 + 1 · 0.5 = 1.5
    (plain Euler: x̂₀ + σ_1 ε(guided) = 2)."""
    scheduler = SCHEDULERS["euler_cfg_pp"].from_config(SD1)
    state = scheduler.set_timesteps(2).replace(sigmas=jnp.asarray([2.0, 1.0, 0.0]))
    x = jnp.full((1,), 3.0)
    x1, _ = scheduler.step(state, jnp.ones(1), 0, x, unconditional=jnp.full((1,), 0.5))
    assert float(x1[0]) == 1.5
    x1, _ = scheduler.step(state, jnp.ones(1), 0, x)  # no unconditional prediction: Euler's step
    assert float(x1[0]) == 2.0


@pytest.fixture(scope="module")
def tiny():
    pipe, params = StableDiffusion.from_pretrained(REPO / "weights" / "tiny-sd")
    return pipe, params, pipe.prepare_inputs(["a red fox"])


def test_the_pipeline_hands_the_unconditional_half_at_any_scale(tiny):
    """With the negative prompt equal to the prompt both halves agree and CFG++ is Euler; with another one the
    unconditional half moves the image, even at scale 1 (where Euler runs the conditional half alone)."""
    pipe, params, ids = tiny
    key = jax.random.key(0)
    same, other = pipe.prepare_inputs(["a red fox"]), pipe.prepare_inputs(["a blue bird"])
    images = {}
    for name in ("euler", "euler_cfg_pp"):
        pipe.scheduler = name
        for scale in (1.0, SCALE):
            for label, neg in (("same", same), ("other", other)):
                images[name, scale, label] = pipe(ids, params, key, 4, 32, 32, guidance_scale=scale,
                                                  neg_prompt_ids=neg).images
    for scale in (1.0, SCALE):
        np.testing.assert_allclose(images["euler_cfg_pp", scale, "same"], images["euler", scale, "same"], atol=1e-5)
        # tiny-sd's random text encoder tells prompts apart weakly: still hundreds of times the tolerance above
        assert np.abs(images["euler_cfg_pp", scale, "other"] - images["euler", scale, "other"]).max() > 2e-3


def test_pag_with_cfg_pp_is_refused(tiny):
    from sdflax.hooks import perturbed_attention_guidance

    pipe, params, ids = tiny
    pipe.scheduler = "Euler a CFG++"
    with pytest.raises(ValueError, match=r"EulerAncestralCFGPPScheduler \(CFG\+\+\) re-noises with classifier-free "
                                         "guidance's unconditional prediction, which PerturbedAttentionGuidance "
                                         "replaces"):
        pipe.with_hooks(perturbed_attention_guidance(3.0))(ids, params, jax.random.key(0), 2)
