"""StableDiffusionAdapter / StableDiffusionXLAdapter against diffusers' StableDiffusionAdapterPipeline and
StableDiffusionXLAdapterPipeline (scale, SDXL's conditioning factor, two adapters), and an adapter beside a
ControlNet in one call against diffusers' ControlNet pipeline whose UNet takes the adapter's features. The same
pictures and start noise on both sides; images at atol 1e-3."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from builders import torch_controlnet, torch_pipeline, torch_xl_pipeline

from sdflax import (ControlNetModel, StableDiffusionAdapter, StableDiffusionControlNet, StableDiffusionXLAdapter,
                    T2IAdapter)

PROMPTS = ["a cabin by a lake"]
STEPS, SIZE = 3, 32  # the test VAEs halve: latents 16x16
ATOL = 1e-3  # images in [0, 1], float32 on both sides
# The adapters' features at the test UNets' down blocks: SD 1.x's (32 wide at 16x16, 64 at 8x8) and SDXL's (32 and
# 64, both at 8x8 after SDXL's first block downsamples).
SD_ADAPTER = dict(in_channels=3, channels=[32, 64], num_res_blocks=1, downscale_factor=2, adapter_type="full_adapter")
XL_ADAPTER = dict(in_channels=1, channels=[32, 64], num_res_blocks=1, downscale_factor=4,
                  adapter_type="full_adapter_xl")


def torch_adapter(config, seed):
    from diffusers import T2IAdapter as TorchT2IAdapter

    torch.manual_seed(seed)
    adapter = TorchT2IAdapter(**config).eval()
    with torch.no_grad():  # larger than the init so that the features move the tiny UNet
        for p in adapter.parameters():
            p.mul_(3.0)
    return adapter


def components(pipe, cls, **extra):
    """`pipe`'s models for another diffusers pipeline class (those it takes)."""
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    return {**{k: v for k, v in pipe.components.items() if k in accepted}, **extra}


def saved(module, folder):
    module.save_pretrained(folder)
    return folder


def picture(seed, channels=3):
    return np.random.default_rng(seed).uniform(0, 1, (len(PROMPTS), channels, SIZE, SIZE)).astype(np.float32)


def latents():
    return np.random.default_rng(7).standard_normal((len(PROMPTS), 4, SIZE // 2, SIZE // 2), dtype=np.float32)


def run_theirs(pipe, **kwargs):
    with torch.no_grad():
        return pipe(PROMPTS, num_inference_steps=STEPS, height=SIZE, width=SIZE, latents=torch.from_numpy(latents()),
                    output_type="np", **kwargs).images


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    from diffusers import StableDiffusionAdapterPipeline

    tmp = tmp_path_factory.mktemp("t2i")
    base = torch_pipeline("sd1", "ddim")
    base.save_pretrained(tmp / "sd")
    adapters = [torch_adapter(SD_ADAPTER, seed) for seed in (1, 2)]
    ours = [T2IAdapter.from_pretrained(saved(a, tmp / f"adapter{i}")) for i, a in enumerate(adapters)]
    return base, tmp, adapters, ours, StableDiffusionAdapterPipeline


def test_sd_adapter_matches_diffusers_at_two_scales(sd):
    base, tmp, adapters, ours, cls = sd
    theirs = cls(**components(base, cls, adapter=adapters[0]), requires_safety_checker=False)
    pipe, params = StableDiffusionAdapter.from_pretrained(tmp / "sd", adapter=ours[0][0])
    params["adapter"] = ours[0][1]
    image = picture(0)
    ids = pipe.prepare_inputs(PROMPTS)
    results = {}
    for scale in (0.0, 0.5, 1.0):
        expected = run_theirs(theirs, image=torch.from_numpy(image), adapter_conditioning_scale=scale)
        got = pipe(ids, image, params, jax.random.key(0), STEPS, SIZE, SIZE, latents=latents(),
                   adapter_conditioning_scale=scale).images
        np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
        results[scale] = expected
    assert np.abs(results[1.0] - results[0.0]).max() > 1e-2 and np.abs(results[0.5] - results[1.0]).max() > 1e-2
    assert pipe._jitted._cache_size() == 1  # the scale is traced
    # pixels of 0-255, as uint8 or as floats, gave an image the adapter barely or never steered
    make = r"pictures are floats in \[0, 1\]: make it with pipeline.prepare_adapter_image_inputs\(pictures\)"
    for wrong in (np.round(image * 255).astype(np.uint8), image * 255):  # the call casts uint8 to float32
        with pytest.raises(ValueError, match=rf"the adapter image spans \[\d+(\.\d+)?, 25\d(\.\d+)?\]; {make}"):
            pipe(ids, wrong, params, jax.random.key(0), STEPS, SIZE, SIZE, latents=latents())


def test_two_adapters_match_diffusers_multiadapter(sd):
    base, tmp, adapters, ours, cls = sd
    theirs = cls(**components(base, cls, adapter=adapters), requires_safety_checker=False)
    pipe, params = StableDiffusionAdapter.from_pretrained(tmp / "sd", adapter=[m for m, _ in ours])
    params["adapter"] = [p for _, p in ours]
    images = [picture(1), picture(2)]
    expected = run_theirs(theirs, image=[torch.from_numpy(x) for x in images], adapter_conditioning_scale=[0.7, 0.3])
    got = pipe(pipe.prepare_inputs(PROMPTS), images, params, jax.random.key(0), STEPS, SIZE, SIZE, latents=latents(),
               adapter_conditioning_scale=[0.7, 0.3]).images
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    other = run_theirs(theirs, image=[torch.from_numpy(x) for x in images], adapter_conditioning_scale=[0.3, 0.7])
    assert np.abs(other - expected).max() > 1e-2  # each adapter's weight matters


def test_adapter_beside_a_controlnet_in_one_call(sd):
    """diffusers has no pipeline for both: its ControlNet pipeline, its UNet given the adapter's features (computed
    by diffusers' T2IAdapter, doubled for the guidance batch) at every step, is the oracle."""
    from diffusers import StableDiffusionControlNetPipeline

    base, tmp, adapters, ours, _ = sd
    net = torch_controlnet(base.unet)
    net.save_pretrained(tmp / "net")
    theirs = StableDiffusionControlNetPipeline(**components(base, StableDiffusionControlNetPipeline, controlnet=net),
                                               requires_safety_checker=False)
    image, control = picture(3), picture(4)
    with torch.no_grad():
        features = [f * 0.8 for f in adapters[0](torch.from_numpy(image))]
    forward = theirs.unet.forward

    def with_adapter(*args, **kwargs):
        rows = args[0].shape[0] // features[0].shape[0]
        return forward(*args, **kwargs, down_intrablock_additional_residuals=[f.repeat(rows, 1, 1, 1)
                                                                             for f in features])

    theirs.unet.forward = with_adapter
    try:
        expected = run_theirs(theirs, image=torch.from_numpy(control), controlnet_conditioning_scale=0.9)
    finally:
        theirs.unet.forward = forward
    without = run_theirs(theirs, image=torch.from_numpy(control), controlnet_conditioning_scale=0.9)
    controlnet, net_params = ControlNetModel.from_pretrained(tmp / "net")
    pipe, params = StableDiffusionControlNet.from_pretrained(tmp / "sd", controlnet=controlnet, adapter=ours[0][0])
    params.update(controlnet=net_params, adapter=ours[0][1])
    got = pipe(pipe.prepare_inputs(PROMPTS), control, params, jax.random.key(0), STEPS, latents=latents(),
               controlnet_conditioning_scale=0.9, height=SIZE, width=SIZE, adapter_image=image,
               adapter_conditioning_scale=0.8).images
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - without).max() > 1e-2


def test_sdxl_adapter_matches_diffusers_with_its_conditioning_factor(tmp_path):
    from diffusers import StableDiffusionXLAdapterPipeline

    base = torch_xl_pipeline("euler")
    base.save_pretrained(tmp_path / "xl")
    adapter = torch_adapter(XL_ADAPTER, 5)
    module, adapter_params = T2IAdapter.from_pretrained(saved(adapter, tmp_path / "adapter"))
    theirs = StableDiffusionXLAdapterPipeline(**components(base, StableDiffusionXLAdapterPipeline, adapter=adapter))
    pipe, params = StableDiffusionXLAdapter.from_pretrained(tmp_path / "xl", adapter=module)
    params["adapter"] = adapter_params
    sketch = picture(6, channels=1)
    ids = pipe.prepare_inputs(PROMPTS)
    results = {}
    for factor in (1.0, 0.5):
        expected = run_theirs(theirs, image=torch.from_numpy(sketch), adapter_conditioning_factor=factor)
        got = pipe(ids, sketch, params, jax.random.key(0), STEPS, height=SIZE, width=SIZE, latents=latents(),
                   adapter_conditioning_factor=factor).images
        np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
        results[factor] = expected
    assert np.abs(results[1.0] - results[0.5]).max() > 1e-2  # the factor moves diffusers' image
    assert pipe._jitted._cache_size() == 1  # and is traced


def test_every_mode_gives_the_same_images(sd):
    """jit=False, pmap (pictures sharded like the prompts) and the sharded path agree."""
    from sdflax import replicate, shard

    _, tmp, _, ours, _ = sd
    pipe, params = StableDiffusionAdapter.from_pretrained(tmp / "sd", adapter=ours[0][0])
    params["adapter"] = ours[0][1]
    devices = jax.local_device_count()
    ids = pipe.prepare_inputs([f"a cabin number {i}" for i in range(devices)])
    image = np.random.default_rng(9).uniform(0, 1, (devices, 3, SIZE, SIZE)).astype(np.float32)
    noise = np.random.default_rng(10).standard_normal((devices, 4, SIZE // 2, SIZE // 2), dtype=np.float32)
    keys = jax.random.split(jax.random.key(0), devices)
    call = pipe(ids, image, params, keys, STEPS, SIZE, SIZE, latents=noise).images
    pmapped = pipe(shard(ids), shard(image), replicate(params), keys, STEPS, SIZE, SIZE, latents=shard(noise),
                   jit=True).images
    np.testing.assert_allclose(pmapped.reshape(call.shape), call, rtol=0, atol=1e-5)
    sharded = pipe.generate_sharded(ids, image, params, keys, STEPS, SIZE, SIZE, latents=noise)
    np.testing.assert_allclose(sharded, call, rtol=0, atol=1e-5)
    assert np.abs(call[0] - call[1]).max() > 1e-3


def test_prepared_pictures_equal_diffusers_preprocessing(sd):
    """prepare_image_inputs: [0, 1], RGB or grey by the adapter's channels, as diffusers' _preprocess_adapter_image
    reads PIL pictures of the output's size."""
    from diffusers.pipelines.t2i_adapter.pipeline_stable_diffusion_adapter import _preprocess_adapter_image
    from PIL import Image

    _, tmp, _, ours, _ = sd
    pipe, _ = StableDiffusionAdapter.from_pretrained(tmp / "sd", adapter=ours[0][0])
    rgb = Image.fromarray(np.random.default_rng(15).integers(0, 256, (SIZE, SIZE, 3), np.uint8))
    np.testing.assert_array_equal(pipe.prepare_image_inputs([rgb]), _preprocess_adapter_image([rgb], SIZE, SIZE))
    grey = StableDiffusionAdapter.from_pretrained(tmp / "sd", adapter=T2IAdapter.from_pretrained(
        saved(torch_adapter({**SD_ADAPTER, "in_channels": 1}, 3), tmp / "grey"))[0])[0]
    expected = _preprocess_adapter_image([rgb.convert("L")], SIZE, SIZE)
    np.testing.assert_allclose(grey.prepare_image_inputs([rgb]), expected, rtol=0, atol=1e-7)


def test_the_factor_counts_evaluations_as_diffusers():
    """int(num_inference_steps × factor) in float64 as diffusers computes it: float32 would give int(10 × 0.7) = 6."""
    from sdflax.pipeline.t2i_adapter import evaluations

    assert [int(evaluations(10, f)) for f in (0.7, 0.5, 0.0, 1.0)] == [int(10 * 0.7), 5, 0, 10] == [7, 5, 0, 10]
    assert int(jax.jit(lambda f: evaluations(10, f))(0.55)) == 5  # traced inside a caller's jit
