"""sdflax.guiders against diffusers.guiders: each guider's images equal diffusers' own UNet, scheduler and VAE
stepping with that guider's `forward(pred_cond, pred_uncond)` (after `set_state`) at every model evaluation, for SD
and SDXL; each setting moves diffusers' image; new numbers never recompile."""

from __future__ import annotations

import contextlib

import diffusers.guiders as theirs_guiders
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from builders import torch_pipeline, torch_xl_pipeline
from compile_flags import RUN_OPTIONS
from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput
from run_modes_worker import compiles_during

from sdflax import StableDiffusion, StableDiffusionXL, guiders, replicate, shard

ATOL = 1e-3  # images in [0, 1], float32
MOVES = 1e-2  # what each setting must change diffusers' image by, so that the comparison proves something
STEPS = 8  # APG's momentum over eight steps
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]


@contextlib.contextmanager
def guided_by(pipe, guider, num_steps):
    """diffusers' pipeline with its UNet's [uncond; cond] output replaced, at every evaluation, by the guider's
    prediction (twice, so that the pipeline's own CFG at scale 2 gives it back unchanged): the loop of diffusers'
    modular pipelines (`set_state(step, num_inference_steps, timestep)`, `prepare_inputs`, `forward`) inside
    diffusers' own denoising loop."""
    unet, step = pipe.unet, [0]
    forward = unet.forward

    def guided(sample, timestep, *args, return_dict=True, **kwargs):
        uncond, cond = forward(sample, timestep, *args, return_dict=False, **kwargs)[0].chunk(2)
        guider.set_state(step=step[0], num_inference_steps=num_steps, timestep=timestep)
        guider.prepare_inputs({})  # where diffusers' APG makes a new momentum buffer at step 0
        step[0] += 1
        pred = guider.forward(cond, uncond).pred
        out = torch.cat([pred, pred])
        return UNet2DConditionOutput(sample=out) if return_dict else (out,)

    unet.forward = guided
    try:
        yield
    finally:
        del unet.forward


def both_guided(theirs, ours, guider, steps, strength=1.0):
    """(diffusers' pipeline guided by `guider` (a class name and its arguments) for the steps `strength` leaves, as
    diffusers' get_timesteps counts them, or no context without one; the guidance scale to call it with; sdflax's
    pipeline with the guider), for the img2img and inpainting parity tests."""
    if guider is None:
        return contextlib.nullcontext(), 7.5, ours
    name, kwargs = guider
    steps_left = min(int(steps * strength), steps)
    return (guided_by(theirs, getattr(theirs_guiders, name)(**kwargs), steps_left), 2.0,
            ours.with_guider(getattr(guiders, name)(**kwargs)))


@pytest.fixture(scope="module", params=["sd1", "sdxl"])
def pipes(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    theirs = torch_pipeline("sd1", "euler") if request.param == "sd1" else torch_xl_pipeline()
    theirs.save_pretrained(folder)
    ours, params = (StableDiffusion if request.param == "sd1" else StableDiffusionXL).from_pretrained(folder)
    size = ours.unet.config.sample_size
    latents = np.random.default_rng(0).standard_normal((2, 4, size, size), dtype=np.float32)
    return request.param, theirs, ours, params, latents


def diffusers_images(theirs, latents, guider=None, guidance_scale=7.5):
    call = dict(num_inference_steps=STEPS, latents=torch.from_numpy(latents), output_type="np")
    with torch.no_grad():
        if guider is None:
            return theirs(PROMPTS, guidance_scale=guidance_scale, **call).images
        with guided_by(theirs, guider, STEPS):
            return theirs(PROMPTS, guidance_scale=2.0, **call).images


_GUIDED = {}  # (architecture, guider, its settings) -> diffusers' images: a baseline that several cases share runs once


def diffusers_guided(pipes, name, kwargs):
    """diffusers' images guided by its guider `name` with `kwargs`, computed once a module."""
    arch, theirs, _, _, latents = pipes
    key = (arch, name, repr(sorted(kwargs.items())))
    if key not in _GUIDED:
        _GUIDED[key] = diffusers_images(theirs, latents, getattr(theirs_guiders, name)(**kwargs))
    return _GUIDED[key]


def sdflax_images(pipes, guider):
    _, _, ours, params, latents = pipes
    return ours.with_guider(guider)(ours.prepare_inputs(PROMPTS), params, jax.random.key(0), STEPS,
                                    latents=latents).images


def test_the_oracle_is_diffusers_pipeline_with_classifier_free_guidance(pipes):
    _, theirs, _, _, latents = pipes
    plain = diffusers_images(theirs, latents, guidance_scale=7.5)
    np.testing.assert_allclose(diffusers_guided(pipes, "ClassifierFreeGuidance", {"guidance_scale": 7.5}), plain,
                               rtol=0, atol=1e-5)
    np.testing.assert_allclose(sdflax_images(pipes, guiders.ClassifierFreeGuidance(guidance_scale=7.5)), plain,
                               rtol=0, atol=ATOL)


# (guider, the settings of the case, the settings it is compared with): the case must move diffusers' image
CASES = {
    "ClassifierFreeGuidance": [({"guidance_scale": 7.5, "guidance_rescale": 0.7}, {"guidance_scale": 7.5}),
                               ({"guidance_scale": 7.5, "start": 0.25, "stop": 0.75}, {"guidance_scale": 7.5}),
                               ({"guidance_scale": 3.0, "use_original_formulation": True}, {"guidance_scale": 3.0})],
    "ClassifierFreeZeroStarGuidance": [({"guidance_scale": 7.5, "zero_init_steps": 2}, {"guidance_scale": 7.5,
                                                                                        "zero_init_steps": 0})],
    "TangentialClassifierFreeGuidance": [({"guidance_scale": 7.5}, "cfg")],
    "MagnitudeAwareGuidance": [({"guidance_scale": 10.0, "alpha": 300.0}, {"guidance_scale": 10.0, "alpha": 0.0})],
    "AdaptiveProjectedGuidance": [({"guidance_scale": 10.0, "adaptive_projected_guidance_momentum": -0.5},
                                   {"guidance_scale": 10.0}),
                                  ({"guidance_scale": 10.0, "eta": 0.0}, {"guidance_scale": 10.0}),
                                  ({"guidance_scale": 10.0, "adaptive_projected_guidance_rescale": 1.0},
                                   {"guidance_scale": 10.0, "adaptive_projected_guidance_rescale": 0.0}),
                                  ({"guidance_scale": 10.0, "eta": 0.0,
                                    "adaptive_projected_guidance_norm_dim": (-2, -1)},
                                   {"guidance_scale": 10.0, "eta": 0.0})],
    "AdaptiveProjectedMixGuidance": [({"adaptive_projected_guidance_scale": 40.0,
                                       "adaptive_projected_guidance_start_step": 2},
                                      {"adaptive_projected_guidance_scale": 40.0,
                                       "adaptive_projected_guidance_start_step": STEPS})],
}
# every case with SD 1.x, the first of each guider with SDXL (a guider sees only the predictions)
IDS = [(arch, name, i) for name, cases in CASES.items() for i in range(len(cases)) for arch in ("sd1", "sdxl")
       if arch == "sd1" or i == 0]


@pytest.mark.parametrize("pipes, name, case", IDS, ids=[f"{a}-{name}-{i}" for a, name, i in IDS], indirect=["pipes"])
def test_guider_images_match_diffusers(pipes, name, case, monkeypatch):
    _, theirs, _, _, latents = pipes
    if name == "MagnitudeAwareGuidance":  # diffusers' torch.norm(x, dim=[1, 2, 3]) raises on 4-D latents in torch 2.x
        vector_norm = torch.linalg.vector_norm
        monkeypatch.setattr(torch, "norm", lambda x, dim, keepdim: vector_norm(x, dim=dim, keepdim=keepdim))
    kwargs, baseline = CASES[name][case]
    expected = diffusers_guided(pipes, name, kwargs)
    if baseline == "cfg":
        moved_from = diffusers_images(theirs, latents, guidance_scale=kwargs["guidance_scale"])
    else:
        moved_from = diffusers_guided(pipes, name, baseline)
    assert np.abs(expected - moved_from).max() > MOVES
    np.testing.assert_allclose(sdflax_images(pipes, getattr(guiders, name)(**kwargs)), expected, rtol=0, atol=ATOL)


def test_the_interval_counts_evaluations_with_a_two_evaluation_sampler(tmp_path):
    """Heun evaluates the UNet twice a step (2n − 1 times): diffusers' modular loop calls `set_state(i, n)` at
    each evaluation i, so `start`/`stop` are fractions of n that the evaluations' index is compared with."""
    theirs = torch_pipeline("sd1", "HeunDiscreteScheduler")
    theirs.save_pretrained(tmp_path)
    ours, params = StableDiffusion.from_pretrained(tmp_path)
    size = ours.unet.config.sample_size
    latents = np.random.default_rng(0).standard_normal((2, 4, size, size), dtype=np.float32)
    steps = 4
    kwargs = {"guidance_scale": 7.5, "start": 0.25, "stop": 0.75}
    call = dict(num_inference_steps=steps, latents=torch.from_numpy(latents), output_type="np")
    with torch.no_grad(), guided_by(theirs, theirs_guiders.ClassifierFreeGuidance(**kwargs), steps):
        expected = theirs(PROMPTS, guidance_scale=2.0, **call).images
    with torch.no_grad():
        plain = theirs(PROMPTS, guidance_scale=7.5, **call).images
    assert np.abs(expected - plain).max() > MOVES
    images = ours.with_guider(guiders.ClassifierFreeGuidance(**kwargs))(
        ours.prepare_inputs(PROMPTS), params, jax.random.key(0), steps, latents=latents).images
    np.testing.assert_allclose(images, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("pipes", ["sd1"], indirect=True)
def test_modes_agree_and_new_numbers_never_recompile(pipes):
    """APG with momentum (state in the scan's carry) and an interval: jit=False, pmap over the devices and
    generate_sharded give the same images; new numbers (scale, momentum, eta) compile nothing in any mode."""
    _, _, ours, params, _ = pipes
    devices = jax.local_device_count()
    prompts = [f"a painting of a {thing}" for thing in ("cat", "dog", "ship", "tree", "house", "hill", "river",
                                                         "city")][:devices]
    ids = ours.prepare_inputs(prompts)
    size = ours.unet.config.sample_size
    latents = np.random.default_rng(1).standard_normal((devices, 4, size, size), dtype=np.float32)
    keys = jax.random.split(jax.random.key(0), devices)

    def apg(scale, momentum, eta):
        return guiders.AdaptiveProjectedGuidance(guidance_scale=scale, adaptive_projected_guidance_momentum=momentum,
                                                 eta=eta, start=0.1, stop=0.9)

    def run(mode, guider):
        pipe = ours.with_guider(guider)
        if mode == "call":
            return pipe(ids, params, keys, STEPS, latents=latents).images
        if mode == "pmap":
            out = pipe(shard(ids), replicate(params), shard(keys), STEPS, latents=shard(latents), jit=True).images
            return np.asarray(out).reshape(-1, *out.shape[2:])
        return np.asarray(pipe.generate_sharded(ids, params, keys, STEPS, latents=latents))

    for mode in ("call", "pmap", "sharded"):
        first = run(mode, apg(10.0, -0.5, 0.5))
        if mode == "call":
            reference = first
        np.testing.assert_allclose(first, reference, rtol=0, atol=1e-5)
        other, compiles = compiles_during(lambda: run(mode, apg(6.0, -0.25, 0.0)))
        assert compiles == 0, mode
        assert np.abs(other - first).max() > MOVES


@pytest.mark.parametrize("pipes", ["sd1"], indirect=True)
def test_the_gradient_through_a_guider_matches_central_differences(pipes):
    _, _, ours, params, latents = pipes
    ids = ours.prepare_inputs(PROMPTS)
    weights = jax.random.normal(jax.random.key(5), latents.shape)

    def loss(scale):  # a weighted sum of the final latents (smooth: images are clipped), of APG's traced scale
        guider = guiders.AdaptiveProjectedGuidance(guidance_scale=scale, adaptive_projected_guidance_momentum=-0.5)
        _, trajectory = ours.with_guider(guider)._generate(ids, params, jax.random.key(0), 3, latents=latents,
                                                           return_trajectory=True)
        final = trajectory.latents[-1]
        return jnp.sum(weights * final) / final.size

    value_and_grad = jax.jit(jax.value_and_grad(loss), compiler_options=RUN_OPTIONS)
    scale, h = 5.0, 0.1  # central differences: error O(h²) plus float32 rounding / h
    _, grad = value_and_grad(scale)
    numeric = (value_and_grad(scale + h)[0] - value_and_grad(scale - h)[0]) / (2 * h)
    assert abs(float(numeric)) > 1e-5
    np.testing.assert_allclose(float(grad), float(numeric), rtol=1e-3)


@pytest.mark.parametrize("pipes", ["sd1"], indirect=True)
def test_guiders_compose_with_hooks_and_refuse_a_second_combiner(pipes):
    from sdflax.hooks import freeu
    from sdflax.hooks.pag import perturbed_attention_guidance

    _, theirs, ours, params, latents = pipes
    kwargs = {"guidance_scale": 10.0, "adaptive_projected_guidance_momentum": -0.5, "eta": 0.0}
    guider = guiders.AdaptiveProjectedGuidance(**kwargs)
    hooked = ours.with_guider(guider).with_hooks(freeu(0.9, 0.2, 1.2, 1.4))
    assert [type(h).__name__ for h in hooked.hooks] == ["AdaptiveProjectedGuidance", "FreeU"]
    assert hooked.with_guider(None).hooks == hooked.hooks[1:]
    theirs.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    try:
        expected = diffusers_images(theirs, latents, theirs_guiders.AdaptiveProjectedGuidance(**kwargs))
    finally:
        theirs.disable_freeu()
    assert np.abs(expected - diffusers_images(theirs, latents, theirs_guiders.AdaptiveProjectedGuidance(
        **kwargs))).max() > MOVES
    images = hooked(ours.prepare_inputs(PROMPTS), params, jax.random.key(0), STEPS, latents=latents).images
    np.testing.assert_allclose(images, expected, rtol=0, atol=ATOL)
    guider = guiders.ClassifierFreeGuidance(guidance_scale=7.5)
    with pytest.raises(ValueError, match="the guider ClassifierFreeGuidance and the hook PerturbedAttentionGuidance "
                                         "both combine the UNet's predictions: give one"):
        ours.with_guider(guider).with_hooks(perturbed_attention_guidance(3.0))(
            ours.prepare_inputs(PROMPTS), params, jax.random.key(0), STEPS, latents=latents)
    with pytest.raises(TypeError, match="with_guider takes a guider from sdflax.guiders"):
        ours.with_guider(guiders.ClassifierFreeGuidance)


@pytest.mark.parametrize("make, expected", [
    (lambda g: g.ClassifierFreeGuidance(guidance_scale=float("nan")), "ClassifierFreeGuidance: guidance_scale=nan"),
    (lambda g: g.AdaptiveProjectedGuidance(eta=1e38), "AdaptiveProjectedGuidance: eta=1e+38"),
    (lambda g: g.MagnitudeAwareGuidance(alpha=-1e30), "MagnitudeAwareGuidance: alpha=-1e+30"),
    (lambda g: g.FrequencyDecoupledGuidance(guidance_scales=(1e38, 2.0)), "guidance_scales=(1e+38, 2.0)"),
    (lambda g: g.ClassifierFreeGuidance(7.5, guidance_rescale=float("inf")), "guidance_rescale=inf"),
    (lambda g: g.SmoothedEnergyGuidance(seg_blur_sigma=0, seg_guidance_config=SEG_LAYER), "seg_blur_sigma=0 must "
     "be above 0"),
    (lambda g: g.SmoothedEnergyGuidance(seg_blur_sigma=-5.0, seg_guidance_config=SEG_LAYER), "seg_blur_sigma=-5.0"),
    (lambda g: g.ClassifierFreeGuidance(7.5, guidance_rescale="x"), "guidance_rescale='x' must be a number"),
    (lambda g: g.AdaptiveProjectedGuidance(adaptive_projected_guidance_norm_dim="x"),  # was a NameError at the call
     "adaptive_projected_guidance_norm_dim='x' must be None"),
])
def test_guider_numbers_are_checked_at_construction(make, expected):
    """NaN, inf and numbers whose arithmetic overflows float32 drew black or NaN images (only start and stop were
    checked); SEG's blur of width 0 or below divides by zero."""
    import sdflax.guiders as guiders

    with pytest.raises(ValueError) as error:
        make(guiders)
    assert expected in str(error.value) and "\n" not in str(error.value)
    guiders.SmoothedEnergyGuidance(seg_blur_sigma=9999999.0, seg_guidance_config=SEG_LAYER)  # diffusers' default


SEG_LAYER = {"indices": [0], "fqn": "mid_block.attentions.0.transformer_blocks"}
