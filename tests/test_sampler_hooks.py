"""The researcher's sampler: guidance hooks, trajectories, an outside scheduler, and gradients through the loop."""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from builders import REPO, parts, saved, torch_pipeline
from compile_flags import RUN_OPTIONS

import jax
import jax.numpy as jnp

from sdflax import StableDiffusion, sampling
from sdflax.pipeline.runner import compiler_options

sys.path.insert(0, str(REPO / "scripts"))
from example_scheduler import DDPMAncestral  # noqa: E402

PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
# One step count for the pipeline calls and gradients here, so that calls differing only in traced values share a
# program.
STEPS = 4


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    """The diffusers pipeline (DDIM), the folder it is saved in, and sdflax's pipeline and params loaded from it."""
    folder = tmp_path_factory.mktemp("pipe")
    theirs, pipe, params = saved(torch_pipeline("sd1", "ddim"), folder, StableDiffusion)
    return SimpleNamespace(theirs=theirs, folder=folder, pipe=pipe, params=params)


@pytest.fixture(scope="module")
def inputs(sd1):
    latents = np.random.default_rng(0).standard_normal((2, 4, 16, 16), dtype=np.float32)
    return sd1.pipe.prepare_inputs(PROMPTS), latents


@pytest.fixture(scope="module")
def models(sd1):
    """The UNet, text encoder and VAE decoder compiled once, as functions of their params, for the loops written
    out by hand (an eager model compiles each of its operations)."""
    jit = functools.partial(jax.jit, compiler_options=compiler_options())
    pipe = sd1.pipe
    return SimpleNamespace(unet=jit(pipe.unet.apply), encode=jit(pipe.encode_prompt), decode=jit(pipe.decode_latents))


def guided_context(models, pipe, params, ids):
    """[unconditional; conditional] text states, as the guided sampler takes them."""
    return jnp.concatenate([models.encode(params, pipe.empty_prompt_ids.repeat(len(ids), 0)),
                            models.encode(params, ids)])


def test_conditional_only_guidance_equals_scale_one(sd1, inputs):
    pipe, params = sd1.pipe, sd1.params
    ids, latents = inputs
    cond_only = lambda uncond, cond, scale: cond  # noqa: E731
    ours = pipe(ids, params, jax.random.key(0), STEPS, latents=latents, guidance=cond_only).images
    scale_one = pipe(ids, params, jax.random.key(0), STEPS, latents=latents, guidance_scale=1.0).images
    np.testing.assert_allclose(ours, scale_one, rtol=0, atol=1e-6)


def test_guidance_rescale_matches_diffusers(sd1):
    theirs, pipe, params = sd1.theirs, sd1.pipe, sd1.params
    latents = np.random.default_rng(1).standard_normal((2, 4, 16, 16), dtype=np.float32)
    with torch.no_grad():
        expected = theirs(PROMPTS, guidance_scale=9.0, guidance_rescale=0.7, num_inference_steps=STEPS,
                          latents=torch.from_numpy(latents), output_type="np").images
    ours = pipe(pipe.prepare_inputs(PROMPTS), params, jax.random.key(0), STEPS, guidance_scale=9.0,
                guidance_rescale=0.7, latents=latents).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-3)
    plain = pipe(pipe.prepare_inputs(PROMPTS), params, jax.random.key(0), STEPS, guidance_scale=9.0, latents=latents)
    assert np.abs(plain.images - ours).max() > 1e-3  # the rescale did something


def test_guidance_rescale_is_diffusers_formula():
    rng = np.random.default_rng(2)
    uncond, cond = (rng.standard_normal((2, 4, 8, 8)).astype(np.float32) for _ in range(2))
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

    guided = uncond + 6.0 * (cond - uncond)
    expected = rescale_noise_cfg(torch.from_numpy(guided), torch.from_numpy(cond), guidance_rescale=0.6).numpy()
    np.testing.assert_allclose(sampling.rescaled_guidance(0.6)(uncond, cond, 6.0), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(sampling.rescaled_guidance(0.0)(uncond, cond, 6.0),
                                  sampling.classifier_free_guidance(uncond, cond, 6.0))


def test_thresholded_guidance_keeps_the_mimic_range():
    rng = np.random.default_rng(3)
    uncond, cond = (rng.standard_normal((2, 4, 8, 8)).astype(np.float32) for _ in range(2))
    # At its own mimic scale with the 100th percentile it is plain guidance.
    same = sampling.thresholded_guidance(mimic_scale=5.0, percentile=1.0)(uncond, cond, 5.0)
    np.testing.assert_allclose(same, sampling.classifier_free_guidance(uncond, cond, 5.0), rtol=1e-6, atol=1e-6)
    # At a high scale every (sample, channel) stays, around its mean, within the spread the mimic scale has.
    high = np.asarray(sampling.thresholded_guidance(mimic_scale=5.0)(uncond, cond, 20.0)).reshape(2, 4, -1)
    plain = np.asarray(sampling.classifier_free_guidance(uncond, cond, 20.0)).reshape(2, 4, -1)
    mimic = np.asarray(sampling.classifier_free_guidance(uncond, cond, 5.0)).reshape(2, 4, -1)
    spread = lambda a, centre: np.abs(a - centre.mean(-1, keepdims=True)).max(-1)  # noqa: E731
    assert np.all(spread(high, plain) <= spread(mimic, mimic) * (1 + 1e-5))
    assert np.all(spread(plain, plain) > spread(mimic, mimic))  # plain guidance at 20 would not


def test_trajectory_ends_at_the_returned_latents(sd1, inputs, models):
    pipe, params = sd1.pipe, sd1.params
    ids, latents = inputs
    out = pipe(ids, params, jax.random.key(0), STEPS, latents=latents, return_trajectory=True)
    trajectory = out.trajectory
    assert trajectory.latents.shape == trajectory.pred_x0.shape == (STEPS, 2, 4, 16, 16)
    np.testing.assert_array_equal(out.images, pipe(ids, params, jax.random.key(0), STEPS, latents=latents).images)
    final = np.asarray(models.decode(params, trajectory.latents[-1]))
    np.testing.assert_allclose(final, out.images, rtol=0, atol=1e-6)
    # DDIM's last step lands on ᾱ = ᾱ_0 (set_alpha_to_one=False): x₀ is the last x̂₀ moved there, close to it.
    assert np.abs(trajectory.latents[-1] - trajectory.pred_x0[-1]).max() < 0.1 * np.abs(trajectory.pred_x0[-1]).max()


def test_trajectory_under_pmap(sd1):
    from sdflax import replicate, shard

    pipe, params = sd1.pipe, sd1.params
    devices = jax.local_device_count()
    ids = shard(pipe.prepare_inputs(["a cat"] * devices))
    out = pipe(ids, replicate(params), jax.random.split(jax.random.key(0), devices), 2, jit=True,
               return_trajectory=True)
    assert out.trajectory.latents.shape == (devices, 2, 1, 4, 16, 16)


def test_outside_scheduler_runs_through_the_pipeline(sd1, inputs, models):
    """scripts/example_scheduler.py, plugged in, equals the same sampler written out by hand in numpy."""
    pipe, params = sd1.pipe, sd1.params
    pipe = StableDiffusion(**{**parts(pipe), "scheduler": DDPMAncestral()})
    ids, latents = inputs
    key, steps, scale = jax.random.key(7), STEPS, 5.0
    ours = pipe(ids, params, key, steps, latents=latents, guidance_scale=scale).images

    # By hand: the same UNet calls, the posterior formula in float64, the noise the loop draws for step i.
    context = guided_context(models, pipe, params, ids)
    betas = np.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=np.float64) ** 2
    alpha_prod = np.cumprod(1 - betas)
    timesteps = np.linspace(999, 0, steps).round().astype(int)
    _, sampler_key = jax.random.split(key)
    x = latents.astype(np.float64)
    for i, t in enumerate(timesteps):
        out = np.asarray(models.unet(params["unet"], np.concatenate([x, x]).astype(np.float32), jnp.int32(t),
                                     context), np.float64)
        eps = out[:2] + scale * (out[2:] - out[:2])
        a = alpha_prod[t]
        a_prev = alpha_prod[timesteps[i + 1]] if i + 1 < steps else 1.0
        alpha = a / a_prev
        x0 = (x - np.sqrt(1 - a) * eps) / np.sqrt(a)
        mean = (np.sqrt(a_prev) * (1 - alpha) * x0 + np.sqrt(alpha) * (1 - a_prev) * x) / (1 - a)
        noise = np.asarray(jax.random.normal(jax.random.fold_in(sampler_key, i), x.shape), np.float64)
        x = mean + np.sqrt((1 - alpha) * (1 - a_prev) / (1 - a)) * noise
    expected = np.asarray(models.decode(params, jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-4)


def test_scheduler_object_through_from_pretrained(sd1):
    pipe, _ = StableDiffusion.from_pretrained(sd1.folder, scheduler=DDPMAncestral())
    assert isinstance(pipe.scheduler, DDPMAncestral)
    with pytest.raises(ValueError, match="scheduler_config applies to a scheduler given by name"):
        StableDiffusion.from_pretrained(sd1.folder, scheduler=DDPMAncestral(), scheduler_config={"eta": 1})


def test_swapping_the_scheduler_recompiles(sd1, inputs):
    pipe, params = sd1.pipe, sd1.params
    pipe = StableDiffusion(**parts(pipe))
    ids, latents = inputs
    ddim = pipe(ids, params, jax.random.key(0), STEPS, latents=latents).images
    pipe.scheduler = DDPMAncestral()
    assert np.abs(pipe(ids, params, jax.random.key(0), STEPS, latents=latents).images - ddim).max() > 1e-3


# ---- gradients ----------------------------------------------------------------------------------------------

def final_latents_fn(pipe, steps):
    """(initial latents, prompt embeddings, UNet params, params) -> (a scalar of the final latents, the images),
    through the pipeline's whole guided sampler."""

    def f(latents, embeds, unet_params, params):
        images, trajectory = pipe._generate(None, {**params, "unet": unet_params}, jax.random.key(0), steps,
                                            latents=latents, prompt_embeds=embeds, return_trajectory=True)
        final = trajectory.latents[-1]
        weights = jax.random.normal(jax.random.key(5), final.shape)
        return jnp.sum(weights * final) / final.size, images

    return f


@pytest.fixture(scope="module")
def gradients(sd1, inputs, models):
    """`program(steps)`: `final_latents_fn` and its gradient w.r.t. the latents, the prompt embeddings and the UNet
    params, compiled once per step count for the gradient tests, with everything passed as arguments (`args`: the
    inputs' latents, their prompts' embeddings, the params), none baked into the program as constants."""
    ids, latents = inputs
    args = (latents, models.encode(sd1.params, ids), sd1.params["unet"], sd1.params)

    @functools.cache
    def program(steps, to_run=True):
        """to_run: compiled at compile_flags.RUN_OPTIONS, for fast runs; else as the suite compiles (the memory
        analysis needs no run)."""
        value_and_grad = jax.value_and_grad(final_latents_fn(sd1.pipe, steps), argnums=(0, 1, 2), has_aux=True)
        options = {**compiler_options(), **(RUN_OPTIONS if to_run else {})}
        return jax.jit(value_and_grad, compiler_options=options).lower(*args).compile()

    return SimpleNamespace(program=program, args=args)


def test_gradient_matches_finite_differences(sd1, gradients):
    latents, *others = gradients.args
    _, (grad, _, _) = gradients.program(STEPS)(*gradients.args)
    # the function alone for its values (the gradient program would compute every gradient at each)
    loss = jax.jit(lambda *args: final_latents_fn(sd1.pipe, STEPS)(*args)[0], compiler_options=compiler_options())
    f = lambda latents: float(loss(latents, *others))  # noqa: E731
    h = 1e-2  # central differences: error O(h²) plus the loss's float32 rounding / h
    # The sampler's float32 loss carries rounding of about 1e-5 of its value (measured: steps of 3e-3 and 1e-2
    # disagree by 6e-6 of it), which the difference quotient divides by 2h: a bound of its own beside 1e-3 of the
    # derivative, which alone fails a direction whose derivative is small against the loss.
    rounding = 1e-5 * abs(f(latents)) / (2 * h)
    for seed in range(3):
        direction = np.random.default_rng(seed).standard_normal(latents.shape).astype(np.float32)
        directional = float(jnp.vdot(grad, direction))
        numeric = (f(latents + h * direction) - f(latents - h * direction)) / (2 * h)
        assert abs(directional - numeric) <= 1e-3 * abs(numeric) + rounding, (directional, numeric, rounding)


def test_gradients_wrt_text_embeddings_and_unet_params(sd1, inputs, gradients):
    pipe, params = sd1.pipe, sd1.params
    ids, latents = inputs
    (_, from_embeds), (_, d_embeds, d_unet) = gradients.program(STEPS)(*gradients.args)
    embeds = gradients.args[1]
    assert d_embeds.shape == embeds.shape and np.isfinite(d_embeds).all() and np.abs(d_embeds).max() > 0
    leaves = jax.tree.leaves(d_unet)
    assert all(np.isfinite(g).all() for g in leaves) and max(float(np.abs(g).max()) for g in leaves) > 0
    # prompt_embeds is the text encoder's output: the same images as the ids, up to batching (the ids path encodes
    # [negative; prompt] as one batch of 2B rows, encode_prompt the B prompts alone, and XLA's CPU reductions round
    # by batch: test_run_modes' ATOL for the same computation batched differently)
    np.testing.assert_allclose(from_embeds, pipe(ids, params, jax.random.key(0), STEPS, latents=latents).images,
                               rtol=0, atol=1e-5)


def test_checkpointed_gradient_memory_grows_sublinearly(gradients):
    def temp_bytes(steps):
        return gradients.program(steps, to_run=False).memory_analysis().temp_size_in_bytes

    four, sixteen = temp_bytes(STEPS), temp_bytes(4 * STEPS)
    assert sixteen < 2 * four, (four, sixteen)  # 4x the steps, well under 2x the memory: only carries are kept


def test_ddim_eta_through_the_pipeline(sd1, models):
    """`scheduler_config={"eta": ...}` reaches DDIM's step; each step's noise comes from the loop's key for it."""
    pipe, params = StableDiffusion.from_pretrained(sd1.folder, scheduler="ddim", scheduler_config={"eta": 1.0})
    deterministic = sd1.pipe  # the same checkpoint's DDIM, eta 0
    ids = pipe.prepare_inputs(PROMPTS)
    latents = np.random.default_rng(4).standard_normal((2, 4, 16, 16), dtype=np.float32)
    run = lambda p, seed: p(ids, params, jax.random.key(seed), STEPS, latents=latents).images  # noqa: E731
    np.testing.assert_array_equal(run(pipe, 0), run(pipe, 0))
    assert np.abs(run(pipe, 0) - run(pipe, 1)).max() > 1e-3  # the key now matters
    assert np.abs(run(pipe, 0) - run(deterministic, 0)).max() > 1e-3

    # By hand: the same steps with eta=1 and the noise drawn from fold_in(sampler_key, i).
    context = guided_context(models, pipe, params, ids)
    model = sampling.guided_model(lambda x, t, c: models.unet(params["unet"], x, t, c), context, 7.5)
    _, sampler_key = jax.random.split(jax.random.key(0))
    scheduler = deterministic.scheduler
    step = jax.jit(functools.partial(scheduler.step, eta=1.0))  # one program for every i
    state = scheduler.set_timesteps(STEPS, shape=latents.shape)
    x = jnp.asarray(latents)
    for i in range(STEPS):
        noise = jax.random.normal(jax.random.fold_in(sampler_key, i), x.shape)
        x, state = step(state, model(x, state.timesteps[i]), i, x, variance_noise=noise)
    expected = np.asarray(models.decode(params, x))
    np.testing.assert_allclose(run(pipe, 0), expected, rtol=0, atol=1e-4)
