"""End-to-end parity of the StableDiffusion pipeline with diffusers' PyTorch StableDiffusionPipeline."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from builders import saved, torch_pipeline

import jax
import jax.numpy as jnp

import sdflax
from sdflax import Inputs, Settings, StableDiffusion, replicate
from sdflax.pipeline.runner import compiler_options

ATOL = 1e-3  # images in [0, 1], float32
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
NEGATIVE = ["blurry", "low quality, dark"]
# the step count of the calls on `sd1` below: a call that differs from one of them only in traced values shares its
# program
STEPS = 2


def run_both(tmp_path, arch, scheduler, steps, guidance, negative=None, **scheduler_config):
    theirs = torch_pipeline(arch, scheduler, **scheduler_config)
    theirs.save_pretrained(tmp_path / "pipe")
    pipe, params = StableDiffusion.from_pretrained(tmp_path / "pipe")
    size = pipe.unet.config.sample_size
    latents = np.random.default_rng(0).standard_normal((2, 4, size, size), dtype=np.float32)
    with torch.no_grad():
        expected = theirs(PROMPTS, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=steps,
                          latents=torch.from_numpy(latents), output_type="np").images
    ids = pipe.prepare_inputs(PROMPTS)
    neg = pipe.prepare_inputs(negative) if negative else None
    ours = pipe(ids, params, jax.random.key(0), steps, guidance_scale=guidance, latents=latents,
                neg_prompt_ids=neg).images
    return pipe, params, ours, expected


@pytest.mark.parametrize("arch, scheduler, config", [
    ("sd1", "pndm", {}),
    ("sd1", "ddim", {}),
    ("sd1", "ddim", {"timestep_spacing": "trailing"}),
    ("sd2", "ddim", {"prediction_type": "v_prediction"}),
    ("sd2", "pndm", {"prediction_type": "v_prediction"}),
    ("sd1", "euler", {"timestep_spacing": "leading"}),  # the first σ depends on the step count
])
def test_images_match_diffusers(tmp_path, arch, scheduler, config):
    pipe, _, ours, expected = run_both(tmp_path, arch, scheduler, 4, 7.5, NEGATIVE, **config)
    assert type(pipe.scheduler).__name__.lower().startswith(scheduler)
    side = pipe.unet.config.sample_size * pipe.vae_scale_factor  # 16 * 2 (SD 1.x-style VAE) or 16 * 4 (SD 2.x)
    assert ours.shape == expected.shape == (2, side, side, 3)
    assert ours.dtype == np.float32 and 0 <= ours.min() and ours.max() <= 1
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - 0.5).mean() > 0.01  # not a constant image: the comparison means something


@pytest.fixture(scope="module")
def sd1_with_theirs(tmp_path_factory):
    """diffusers' SD 1.x pipeline (PNDM), and sdflax's pipeline and params loaded from its folder."""
    theirs = torch_pipeline("sd1")
    return saved(theirs, tmp_path_factory.mktemp("pipe"), StableDiffusion)


@pytest.fixture(scope="module")
def sd1(sd1_with_theirs):
    return sd1_with_theirs[1:]


def test_empty_negative_prompt_and_other_guidance(sd1_with_theirs):
    theirs, pipe, params = sd1_with_theirs
    latents = np.random.default_rng(0).standard_normal((2, 4, 16, 16), dtype=np.float32)
    with torch.no_grad():
        expected = theirs(PROMPTS, guidance_scale=2.0, num_inference_steps=STEPS, latents=torch.from_numpy(latents),
                          output_type="np").images
    ours = pipe(pipe.prepare_inputs(PROMPTS), params, jax.random.key(0), STEPS, guidance_scale=2.0,
                latents=latents).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)


def test_python_loop_mode_equals_scan(sd1):
    from sdflax import sampling

    pipe, params = sd1
    ids = pipe.prepare_inputs(PROMPTS)
    jit = functools.partial(jax.jit, compiler_options=compiler_options())
    context = jit(pipe.encode_prompt)(params, jnp.concatenate([jnp.broadcast_to(pipe.empty_prompt_ids, ids.shape),
                                                               ids]))
    # one program for the loop's UNet calls (an eager UNet compiles each operation); in the scan, part of its program
    unet = jax.jit(pipe.unet.apply)
    latents = jax.random.normal(jax.random.key(1), (2, 4, 16, 16))
    key = jax.random.key(2)

    def denoise(unet_params, use_scan):
        model = sampling.guided_model(lambda x, t, c: unet(unet_params, x, t, c), context, 7.5)
        return sampling.denoise(model, pipe.scheduler, latents, 3, key, use_scan=use_scan)

    scanned = jit(denoise, static_argnums=1)(params["unet"], True)
    looped = denoise(params["unet"], False)
    # Eager ops and one compiled scan round differently (fusion), and guidance 7.5 amplifies the UNet's rounding
    # 7.5x. Rounding scales with the latents' magnitude (|x| up to 12), not with each element's own value: near a
    # zero crossing an element-wise rtol asks for more than float32 carries. Measured: 1.4e-6 of the largest |x|.
    np.testing.assert_allclose(looped, scanned, rtol=0, atol=1e-5 * np.abs(scanned).max())


def compile_events() -> list:
    """The XLA compiles of this process from now on, as they happen."""
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: events.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
    return events


def test_traced_values_never_recompile(sd1):
    pipe, params = sd1
    compiles = compile_events()
    ids = pipe.prepare_inputs(PROMPTS)
    latents = np.random.default_rng(0).standard_normal((2, 4, 16, 16), dtype=np.float32)
    pipe(ids, params, jax.random.key(0), 2)  # first call: compiles
    pipe(ids, params, jax.random.key(0), 2, latents=latents)  # given latents: one more program
    assert pipe._jitted._cache_size() == 2
    before = len(compiles)
    pipe(ids, params, jax.random.key(1), 2, guidance_scale=3.0)
    pipe(pipe.prepare_inputs(["other", "prompts"]), params, jax.random.key(2), 2, guidance_scale=1.5,
         neg_prompt_ids=None)
    pipe(ids, params, jax.random.key(3), 2, latents=latents + 1, guidance_scale=9.0)
    assert len(compiles) == before, "a traced value caused a compile"
    assert pipe._jitted._cache_size() == 2
    pipe(ids, params, jax.random.key(0), 3)  # new step count: exactly one new program
    pipe(ids, params, jax.random.key(0), 2, height=16, width=48)  # new size: one more
    pipe(ids[:1], params, jax.random.key(0), 2)  # new batch: one more
    assert pipe._jitted._cache_size() == 5


def test_sdflax_generate_is_one_compiled_program(sd1):
    pipe, params = sd1
    ids, neg = pipe.prepare_inputs(PROMPTS), pipe.prepare_inputs(NEGATIVE)
    inputs = Inputs(prompt_ids=ids, neg_prompt_ids=neg, prng_seed=jax.random.key(0), guidance_scale=jnp.float32(7.5),
                    guidance_rescale=jnp.float32(0))  # as the pipeline's call makes them
    settings = Settings(num_inference_steps=2, height=32, width=32)
    # one program, not hundreds of eager operations; inside a caller's trace too
    jaxpr = jax.make_jaxpr(sdflax.generate, static_argnums=(0, 3))(pipe.spec, params, inputs, settings).jaxpr
    assert [eqn.primitive.name for eqn in jaxpr.eqns] == ["jit"]
    compiler_options()  # its probe of this jaxlib's options compiles, once a process
    compiles = compile_events()
    images = sdflax.generate(pipe.spec, params, inputs, settings).images
    assert len(compiles) <= 1  # the program (unless this process has it already)
    sdflax.generate(pipe.spec, params, inputs.replace(prng_seed=jax.random.key(1), guidance_scale=jnp.float32(3)),
                    settings)
    assert len(compiles) <= 1  # traced values: the same program
    # the program of the pipeline's call, with its compiler options
    np.testing.assert_array_equal(images, pipe(ids, params, jax.random.key(0), 2, neg_prompt_ids=neg).images)


def test_negative_prompts_change_the_image_and_do_not_recompile(sd1):
    pipe, params = sd1
    ids = pipe.prepare_inputs(PROMPTS)
    a = pipe(ids, params, jax.random.key(0), 2, neg_prompt_ids=pipe.prepare_inputs(NEGATIVE)).images
    size = pipe._jitted._cache_size()
    b = pipe(ids, params, jax.random.key(0), 2, neg_prompt_ids=pipe.prepare_inputs(["x", "y"])).images
    assert pipe._jitted._cache_size() == size
    assert np.abs(a - b).max() > 1e-4


def test_bad_input_says_what_to_change(sd1):
    pipe, params = sd1
    ids = pipe.prepare_inputs(PROMPTS)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="height=31 is not a multiple of the VAE scale factor 2: use 30 or 32"):
        pipe(ids, params, key, 2, height=31, width=32)
    with pytest.raises(ValueError, match="width=33 is not a multiple"):
        pipe(ids, params, key, 2, height=32, width=33)
    with pytest.raises(ValueError, match=r"prompt_ids has shape \(2, 70\); expected \(batch, 77\)"):
        pipe(ids[:, :70], params, key, 2)
    with pytest.raises(ValueError, match=r"num_inference_steps must be in \[1, 1000\]"):
        pipe(ids, params, key, 0)
    with pytest.raises(ValueError, match=r"latents have shape \(2, 4, 8, 8\); expected \(2, 4, 16, 16\)"):
        pipe(ids, params, key, 2, latents=np.zeros((2, 4, 8, 8), np.float32))
    with pytest.raises(ValueError, match="prompt_ids lead with 2, but there are 8 devices"):
        pipe(ids[:, None], replicate(params), jax.random.split(key, 2), 2, jit=True)


def test_scheduler_choice_and_overrides(tmp_path):
    torch_pipeline("sd1").save_pretrained(tmp_path)
    pipe, _ = StableDiffusion.from_pretrained(tmp_path, scheduler="ddim", scheduler_config={"timestep_spacing": "trailing"})
    assert type(pipe.scheduler).__name__ == "DDIMScheduler"
    assert pipe.scheduler.config.timestep_spacing == "trailing"
    assert pipe.scheduler.config.beta_end == 0.012  # kept from the checkpoint
    with pytest.raises(ValueError, match="unknown scheduler 'warp'"):
        StableDiffusion.from_pretrained(tmp_path, scheduler="warp")

    # pipeline.scheduler takes the names from_pretrained takes and builds them as it does (the checkpoint's config
    # with the overrides it was loaded with), whatever scheduler it holds now; anything else is refused at once
    for names in (["DPM++ 2M Karras", "pndm"], ["euler", "ddim"], ["EulerAncestralDiscreteScheduler"]):
        for name in names:
            pipe.scheduler = name
        expected, _ = StableDiffusion.from_pretrained(tmp_path, scheduler=names[-1],
                                                      scheduler_config={"timestep_spacing": "trailing"})
        assert pipe.scheduler == expected.scheduler, names
    with pytest.raises(ValueError, match="^pipeline.scheduler = 'warp': unknown scheduler 'warp'; known: ddim, "):
        pipe.scheduler = "warp"
    with pytest.raises(TypeError, match="scheduler must be an sdflax scheduler object or, for pipeline.scheduler, a "
                                        "name such as 'dpmpp_2m'"):
        pipe.scheduler = expected.scheduler.config
    assert pipe.scheduler == expected.scheduler  # unchanged by a refused value


def test_output_helpers(sd1):
    from sdflax import make_image_grid

    pipe, params = sd1
    out = pipe(pipe.prepare_inputs(PROMPTS), params, jax.random.key(0), 2)
    assert out[0] is out.images
    pil = pipe.numpy_to_pil(out.images)
    assert len(pil) == 2 and pil[0].size == (32, 32)
    np.testing.assert_array_equal(np.asarray(pil[1]), (out.images[1] * 255).round().astype(np.uint8))
    grid = make_image_grid(pil, rows=1, cols=2)
    assert grid.size == (64, 32)
    np.testing.assert_array_equal(np.asarray(grid)[:, 32:], np.asarray(pil[1]))


def test_step_callback_runs_on_the_host_and_changes_nothing(sd1):
    pipe, params = sd1
    ids = pipe.prepare_inputs(PROMPTS)
    seen = []
    record = lambda step, num_steps, latents: seen.append((step, num_steps, np.asarray(latents).shape))  # noqa: E731
    with_callback = pipe(ids, params, jax.random.key(0), 3, callback=record).images
    evals = pipe.scheduler.set_timesteps(3, shape=(2, 4, 16, 16)).timesteps.shape[0]  # PLMS: steps + 1
    assert evals == 4 and seen == [(i, evals, (2, 4, 16, 16)) for i in range(evals)]
    np.testing.assert_array_equal(with_callback, pipe(ids, params, jax.random.key(0), 3).images)
