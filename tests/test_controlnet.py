"""The ControlNet pipelines against diffusers': StableDiffusionControlNetPipeline (one net and a MultiControlNet),
StableDiffusionXLControlNetPipeline and StableDiffusionControlNetImg2ImgPipeline; the pmap walkthrough with one
control image per device; the bad inputs."""

from __future__ import annotations

import diffusers.guiders
import numpy as np
import pytest
import torch
from builders import CONFIGS, parts, torch_controlnet, torch_pipeline, torch_unet
from test_guiders import guided_by

import jax

from sdflax import (ControlNetModel, StableDiffusionControlNet, UNet2DConditionModel, guiders, random_draws, replicate,
                    shard)

ATOL = 1e-3  # images in [0, 1], float32
PROMPTS = ["a house by a lake", "a robot in a field"]
NEGATIVE = ["blurry", "dark"]
STEPS = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(diffusers pipeline, two diffusers ControlNets, our pipeline, our params with both nets' params)."""
    folder = tmp_path_factory.mktemp("controlnet")
    theirs = torch_pipeline("sd1", "ddim")
    nets = [torch_controlnet(theirs.unet, seed=seed) for seed in (1, 2)]
    theirs.save_pretrained(folder / "sd")
    loaded = []
    for k, net in enumerate(nets):
        net.save_pretrained(folder / f"net{k}")
        loaded.append(ControlNetModel.from_pretrained(folder / f"net{k}"))
    pipe, params = StableDiffusionControlNet.from_pretrained(folder / "sd", controlnet=[m for m, _ in loaded])
    params["controlnet"] = [p for _, p in loaded]
    return theirs, nets, pipe, params


def control_images(batch=2, seed=0):
    """PIL images (diffusers reads numpy images as floats in [0, 1])."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(batch)]


def keys_and_latents():
    """One key per image, and the start latents our pipeline draws from them (diffusers is given those): calls
    with keys and negative ids share one program with the walkthrough's one-device call."""
    keys = jax.random.split(jax.random.key(1), len(PROMPTS))
    (latents,), _ = random_draws(keys, (len(PROMPTS), 4, 16, 16), 1)
    return keys, np.asarray(latents)


def diffusers_images(theirs, nets, images, **kwargs):
    from diffusers import StableDiffusionControlNetPipeline
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    components = {k: v for k, v in theirs.components.items() if k not in ("image_encoder",)}
    controlnet = nets[0] if len(nets) == 1 else MultiControlNetModel(nets)
    if len(nets) > 1:  # diffusers nests several nets' images per prompt: [[prompt 0's per net], ...]
        images = [list(per_prompt) for per_prompt in zip(*images)]
    pipeline = StableDiffusionControlNetPipeline(**components, controlnet=controlnet)
    with torch.no_grad():
        return pipeline(PROMPTS, images, num_inference_steps=STEPS, negative_prompt=NEGATIVE,
                        latents=torch.from_numpy(keys_and_latents()[1]), output_type="np", **kwargs).images


def single(pipe, params, net=0):
    """The pipeline with one of the nets."""
    one = StableDiffusionControlNet(**parts(pipe), controlnet=pipe.controlnets[net])
    return one, {**params, "controlnet": params["controlnet"][net]}


@pytest.fixture(scope="module")
def one_net(models):
    _, _, pipe, params = models
    return single(pipe, params)


@pytest.mark.parametrize("kwargs", [
    {},
    {"controlnet_conditioning_scale": 0.5},
    {"control_guidance_end": 0.6},
    {"guess_mode": True},
])
def test_one_net_matches_diffusers(models, one_net, kwargs):
    theirs, nets, _, _ = models
    pipe, params = one_net
    images = control_images()
    expected = diffusers_images(theirs, nets[:1], images, **kwargs)
    ours = pipe(pipe.prepare_text_inputs(PROMPTS), pipe.prepare_image_inputs(images), params, keys_and_latents()[0],
                STEPS, neg_prompt_ids=pipe.prepare_inputs(NEGATIVE), **kwargs).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    # the setting under test changes the oracle's image: against the defaults, and the defaults against no net
    baseline = diffusers_images(theirs, nets[:1], images, **({} if kwargs else {"controlnet_conditioning_scale": 0.0}))
    assert np.abs(expected - baseline).max() > 1e-2


def test_a_guider_matches_diffusers(models, one_net):
    theirs, nets, _, _ = models
    pipe, params = one_net
    images = control_images()
    kwargs = {"guidance_scale": 10.0, "eta": 0.0, "adaptive_projected_guidance_momentum": -0.5}
    with guided_by(theirs, diffusers.guiders.AdaptiveProjectedGuidance(**kwargs), STEPS):
        expected = diffusers_images(theirs, nets[:1], images, guidance_scale=2.0)
    ours = pipe.with_guider(guiders.AdaptiveProjectedGuidance(**kwargs))(
        pipe.prepare_text_inputs(PROMPTS), pipe.prepare_image_inputs(images), params, keys_and_latents()[0], STEPS,
        neg_prompt_ids=pipe.prepare_inputs(NEGATIVE)).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert np.abs(diffusers_images(theirs, nets[:1], images, guidance_scale=10.0) - expected).max() > 1e-2


def test_two_nets_match_diffusers_multicontrolnet(models):
    theirs, nets, pipe, params = models
    images = [control_images(seed=0), control_images(seed=1)]
    kwargs = {"controlnet_conditioning_scale": [1.0, 0.5], "control_guidance_start": [0.0, 0.3]}
    expected = diffusers_images(theirs, nets, images, **kwargs)
    ours = pipe(pipe.prepare_text_inputs(PROMPTS), [pipe.prepare_image_inputs(i) for i in images], params,
                keys_and_latents()[0], STEPS, neg_prompt_ids=pipe.prepare_inputs(NEGATIVE),
                **kwargs).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    only_first = diffusers_images(theirs, nets[:1], images[0])
    assert np.abs(expected - only_first).max() > 1e-2  # the second net changes the image


def test_walkthrough_on_eight_devices_and_traced_scale(one_net):
    pipe, params = one_net
    devices = jax.local_device_count()
    prompts = [f"a drawing number {i}" for i in range(devices)]
    ids = pipe.prepare_text_inputs(prompts)
    image = pipe.prepare_image_inputs(control_images(devices, seed=3))
    rng = jax.random.split(jax.random.key(0), devices)
    p_params = replicate(params)
    out = pipe(shard(ids), shard(image), p_params, rng, STEPS, jit=True).images
    assert out.shape == (devices, 1, 32, 32, 3)
    # images 0 and 5 on one device, from their keys, with the empty negative prompt (the default) given as ids: the
    # one-device program of the parity tests above
    picked = np.array([0, 5])
    apart = pipe(ids[picked], image[picked], params, rng[picked], STEPS,
                 neg_prompt_ids=pipe.prepare_inputs([""] * len(picked))).images
    for i, one in zip(picked, apart):
        np.testing.assert_allclose(out[i], one[None], rtol=0, atol=1e-5)
    sharded = pipe.generate_sharded(ids, image, params, rng, STEPS)  # jit + NamedSharding: the same images
    np.testing.assert_allclose(sharded, out.reshape(-1, *out.shape[2:]), rtol=0, atol=1e-5)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
    weaker = pipe(shard(ids), shard(image), p_params, rng, STEPS, jit=True, controlnet_conditioning_scale=0.3,
                  control_guidance_end=0.5).images
    assert not compiles, "a traced ControlNet value caused a compile"
    assert np.abs(weaker - out).max() > 1e-3


def test_bad_inputs_say_what_to_change(models, one_net, tmp_path):
    _, _, two, two_params = models
    pipe, params = one_net
    ids, key = pipe.prepare_text_inputs(PROMPTS), jax.random.key(0)
    image = pipe.prepare_image_inputs(control_images())
    with pytest.raises(ValueError, match="height=64 but the image is 32"):
        pipe(ids, image, params, key, STEPS, height=64)
    with pytest.raises(ValueError, match="1 control images for 2 ControlNets"):
        two(ids, image, two_params, key, STEPS)
    with pytest.raises(ValueError, match=r"control image 1 is 16x16, the first 32x32"):
        two(ids, [image, image[:, :, :16, :16]], two_params, key, STEPS)
    with pytest.raises(ValueError, match=r"has shape \(1, 3, 32, 32\) for a batch of \(2,\)"):
        pipe(ids, image[:1], params, key, STEPS)
    net = torch_controlnet(torch_unet(CONFIGS["sd2"]["unet"]))  # SD 2.x-shaped: another cross-attention width
    net.save_pretrained(tmp_path / "sd2-net")
    other, other_params = ControlNetModel.from_pretrained(tmp_path / "sd2-net")
    mixed = StableDiffusionControlNet(**parts(pipe), controlnet=other)
    with pytest.raises(ValueError, match="a ControlNet of another model family"):
        mixed(ids, image, {**params, "controlnet": other_params}, key, STEPS)
    # a condition encoder of one more level than the VAE's: a ValueError at compile, once loaded
    levels = int(np.log2(pipe.vae_scale_factor)) + 2
    coarse = ControlNetModel.from_unet(pipe.unet, conditioning_embedding_out_channels=(8,) * levels)
    with pytest.raises(ValueError, match=rf"a ControlNet whose condition encoder makes 1/{2 ** (levels - 1)} of the "
                       rf"picture's size \({levels} conditioning_embedding_out_channels\), but the VAE's latents are "
                       rf"1/{pipe.vae_scale_factor} of it: use a ControlNet trained for this base model"):
        StableDiffusionControlNet(**parts(pipe), controlnet=coarse)(ids, image, params, key, STEPS)
    with pytest.raises(ValueError, match="needs controlnet="):
        StableDiffusionControlNet(**parts(pipe))


def components_for(cls, pipeline, **extra):
    """A diffusers pipeline of class `cls` from another pipeline's components."""
    import inspect

    names = inspect.signature(cls.__init__).parameters
    return cls(**{**{k: v for k, v in pipeline.components.items() if k in names}, **extra})


def test_sdxl_controlnet_matches_diffusers(tmp_path):
    from builders import torch_xl_pipeline
    from diffusers import StableDiffusionXLControlNetPipeline

    from sdflax import StableDiffusionXLControlNet

    base = torch_xl_pipeline("euler")
    net = torch_controlnet(base.unet, seed=3)
    base.save_pretrained(tmp_path / "xl")
    net.save_pretrained(tmp_path / "net")
    controlnet, net_params = ControlNetModel.from_pretrained(tmp_path / "net")
    pipe, params = StableDiffusionXLControlNet.from_pretrained(tmp_path / "xl", controlnet=controlnet)
    params["controlnet"] = net_params
    theirs = components_for(StableDiffusionXLControlNetPipeline, base, controlnet=net)
    side = pipe.unet.config.sample_size * pipe.vae_scale_factor
    images = [image.resize((side, side)) for image in control_images()]
    noise = np.random.default_rng(1).standard_normal((2, 4, pipe.unet.config.sample_size,
                                                      pipe.unet.config.sample_size), dtype=np.float32)
    for kwargs in ({}, {"controlnet_conditioning_scale": 0.5, "guess_mode": True}):
        with torch.no_grad():
            expected = theirs(PROMPTS, image=images, num_inference_steps=STEPS, negative_prompt=NEGATIVE,
                              latents=torch.from_numpy(noise), output_type="np", **kwargs).images
        ours = pipe(pipe.prepare_text_inputs(PROMPTS), pipe.prepare_image_inputs(images), params, jax.random.key(0),
                    STEPS, latents=noise, neg_prompt_ids=pipe.prepare_inputs(NEGATIVE), **kwargs).images
        np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    with torch.no_grad():
        without = theirs(PROMPTS, image=images, num_inference_steps=STEPS, negative_prompt=NEGATIVE, output_type="np",
                         latents=torch.from_numpy(noise), controlnet_conditioning_scale=0.0).images
    assert np.abs(expected - without).max() > 1e-2  # the net changes the image
    with pytest.raises(ValueError, match="a ControlNet of another model family"):
        sd_net = ControlNetModel.from_unet(UNet2DConditionModel.from_config(CONFIGS["sd1"]["unet"]))
        StableDiffusionXLControlNet(**parts(pipe), text_encoder_2=pipe.text_encoder_2, tokenizer_2=pipe.tokenizer_2,
                                    controlnet=sd_net)(pipe.prepare_text_inputs(PROMPTS),
                                                       pipe.prepare_image_inputs(images), params, jax.random.key(0),
                                                       STEPS)


def test_img2img_controlnet_matches_diffusers(models, monkeypatch):
    import diffusers.models.autoencoders.vae as torch_vae_module
    import diffusers.pipelines.controlnet.pipeline_controlnet_img2img as torch_module
    from diffusers import StableDiffusionControlNetImg2ImgPipeline

    from sdflax import StableDiffusionControlNetImg2Img

    theirs, nets, pipe, params = models
    ours = StableDiffusionControlNetImg2Img(**parts(pipe), controlnet=pipe.controlnets[0])
    params = {**params, "controlnet": params["controlnet"][0]}
    rng = np.random.default_rng(5)
    pixels = list(rng.uniform(0, 1, (2, 32, 32, 3)).astype(np.float32))
    ids, image, control = ours.prepare_inputs(PROMPTS, pixels, control_images())
    noise = rng.standard_normal((2, 4, 16, 16), dtype=np.float32)
    key = jax.random.key(3)
    posterior = np.asarray(jax.random.normal(jax.random.split(key, 3)[0], (2, 4, 16, 16)))  # our posterior draw
    monkeypatch.setattr(torch_vae_module, "randn_tensor", lambda *a, **k: torch.from_numpy(posterior))
    monkeypatch.setattr(torch_module, "randn_tensor", lambda *a, **k: torch.from_numpy(noise))
    img2img = components_for(StableDiffusionControlNetImg2ImgPipeline, theirs, controlnet=nets[0])
    with torch.no_grad():
        expected = img2img(PROMPTS, image=torch.from_numpy(image), control_image=control_images(), strength=0.75,
                           num_inference_steps=4, negative_prompt=NEGATIVE, output_type="np").images
    got = ours(ids, image, control, params, key, strength=0.75, num_inference_steps=4, noise=noise,
               neg_prompt_ids=ours.prepare_inputs(NEGATIVE)).images
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    with torch.no_grad():
        without = img2img(PROMPTS, image=torch.from_numpy(image), control_image=control_images(), strength=0.75,
                          num_inference_steps=4, negative_prompt=NEGATIVE, output_type="np",
                          controlnet_conditioning_scale=0.0).images
    assert np.abs(expected - without).max() > 1e-2


@pytest.mark.parametrize("unet_channels, strength", [(9, 1.0), (4, 0.75)])
def test_inpaint_controlnet_matches_diffusers(models, monkeypatch, tmp_path, unet_channels, strength):
    """An inpainting UNet (the nets see the 4-channel latents) and an ordinary one (the known region pasted back)."""
    import diffusers.models.autoencoders.vae as torch_vae_module
    import diffusers.pipelines.controlnet.pipeline_controlnet_inpaint as torch_module
    from diffusers import StableDiffusionControlNetInpaintPipeline
    from test_inpaint import inputs

    from sdflax import StableDiffusionControlNetInpaint

    theirs, nets, _, _ = models
    extra = {"controlnet": nets[0]}
    if unet_channels == 9:
        extra["unet"] = torch_unet({**CONFIGS["sd1"]["unet"], "in_channels": 9}, seed=1)
    inpaint = components_for(StableDiffusionControlNetInpaintPipeline, theirs, **extra)
    inpaint.save_pretrained(tmp_path)
    controlnet, net_params = ControlNetModel.from_pretrained(tmp_path / "controlnet")
    pipe, params = StableDiffusionControlNetInpaint.from_pretrained(tmp_path, controlnet=controlnet)
    params["controlnet"] = net_params
    assert pipe.start.images == (("image", 3), ("mask", 1)) and pipe.unet.config.in_channels == unet_channels

    pixels, masks = inputs()
    ids, image, mask, control = pipe.prepare_inputs(PROMPTS, list(pixels), list(masks), control_images())
    key = jax.random.key(3)
    (image_eps, masked_eps, noise), _ = random_draws(key, (2, 4, 16, 16), 3)  # what our pipeline draws
    posterior = [image_eps, masked_eps] if strength < 1 or unet_channels == 4 else [masked_eps]
    posterior = [torch.from_numpy(np.array(eps)) for eps in posterior]
    monkeypatch.setattr(torch_vae_module, "randn_tensor", lambda *a, **k: posterior.pop(0))
    monkeypatch.setattr(torch_module, "randn_tensor", lambda *a, **k: torch.from_numpy(np.array(noise)))

    def diffusers_run(**kwargs):
        with torch.no_grad():
            return inpaint(PROMPTS, image=torch.from_numpy(image), mask_image=torch.from_numpy(masks[:, None]),
                           control_image=control_images(), strength=strength, num_inference_steps=4,
                           negative_prompt=NEGATIVE, output_type="np", **kwargs).images

    expected = diffusers_run()
    assert not posterior, "diffusers drew fewer posterior samples than expected"
    got = pipe(ids, image, mask, control, params, key, strength=strength, num_inference_steps=4,
               neg_prompt_ids=pipe.prepare_inputs(NEGATIVE)).images
    np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
    posterior = [image_eps, masked_eps] if strength < 1 or unet_channels == 4 else [masked_eps]
    posterior = [torch.from_numpy(np.array(eps)) for eps in posterior]
    without = diffusers_run(controlnet_conditioning_scale=0.0)
    assert np.abs(expected - without).max() > 1e-2  # the net (at diffusers' default scale 0.5) changes the image
