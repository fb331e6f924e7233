"""IP-Adapter against diffusers' `load_ip_adapter` + `set_ip_adapter_scale`: random adapters written in h94's layout
beside a small CLIP vision tower, the same pixels and start noise on both sides; images at atol 1e-3."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from builders import VISION, torch_pipeline, write_ip_adapters

from sdflax import StableDiffusion

PROMPTS = ["a red fox in the snow"]
STEPS, SIZE = 2, 32  # the test VAE halves: latents 16x16
ATOL = 1e-3  # images in [0, 1], float32 on both sides


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    """diffusers' pipeline and sdflax's, both from one folder (which `adapters` gives IP-Adapters)."""
    folder = tmp_path_factory.mktemp("ip") / "sd1"
    theirs = torch_pipeline("sd1", "ddim")
    theirs.save_pretrained(folder)
    pipe, params = StableDiffusion.from_pretrained(folder)
    return theirs, pipe, params, folder


@pytest.fixture(scope="module")
def adapters(sd1):
    theirs, _, _, folder = sd1
    write_ip_adapters(folder / "models", theirs.unet, {"base": 1, "full": 2, "plus": 3})
    return folder


def pixels(seed=0, n=1):
    return np.random.default_rng(seed).uniform(-1.5, 1.5, (n, 3, VISION["image_size"], VISION["image_size"])
                                               ).astype(np.float32)


def latents():
    return np.random.default_rng(7).standard_normal((len(PROMPTS), 4, SIZE // 2, SIZE // 2), dtype=np.float32)


def diffusers_images(theirs, folder, weight_names, scale, images, **kwargs):
    theirs.load_ip_adapter(str(folder), subfolder="models", weight_name=weight_names,
                           image_encoder_folder="image_encoder")
    theirs.set_ip_adapter_scale(scale)
    with torch.no_grad():
        out = theirs(PROMPTS, num_inference_steps=STEPS, height=SIZE, width=SIZE, latents=torch.from_numpy(latents()),
                     ip_adapter_image=[torch.from_numpy(x) for x in images], output_type="np", **kwargs).images
    theirs.unload_ip_adapter()
    return out


def test_base_adapter_matches_diffusers_at_two_scales(sd1, adapters):
    theirs, pipe, params, folder = sd1
    ip_pipe, ip_params = pipe.load_ip_adapter(params, folder, subfolder="models",
                                              weight_name="ip-adapter_base.safetensors")
    ids = pipe.prepare_inputs(PROMPTS)
    image = pixels()
    results = {}
    for scale in (0.0, 0.6, 1.0):
        expected = diffusers_images(theirs, folder, "ip-adapter_base.safetensors", scale, [image])
        ours = ip_pipe(ids, ip_params, jax.random.key(0), STEPS, SIZE, SIZE, latents=latents(), ip_adapter_image=image,
                       ip_adapter_scale=scale).images
        np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
        results[scale] = expected
    assert np.abs(results[1.0] - results[0.0]).max() > 1e-2  # the adapter moves diffusers' image
    assert np.abs(results[0.6] - results[1.0]).max() > 1e-2
    assert ip_pipe._jitted._cache_size() == 1  # a new scale is a traced value


@pytest.mark.parametrize("kind", ["plus", "full"])
def test_plus_and_full_face_adapters_match_diffusers(sd1, adapters, kind):
    """Plus (the perceiver resampler) and Full Face project the encoder's penultimate hidden states; their
    unconditional rows are a black image's."""
    theirs, pipe, params, folder = sd1
    name = f"ip-adapter_{kind}.safetensors"
    ip_pipe, ip_params = pipe.load_ip_adapter(params, folder, subfolder="models", weight_name=name)
    image = pixels(1)
    results = {}
    for scale in (0.3, 0.8):
        expected = diffusers_images(theirs, folder, name, scale, [image])
        ours = ip_pipe(pipe.prepare_inputs(PROMPTS), ip_params, jax.random.key(0), STEPS, SIZE, SIZE,
                       latents=latents(), ip_adapter_image=image, ip_adapter_scale=scale).images
        np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
        results[scale] = expected
    assert np.abs(results[0.8] - results[0.3]).max() > 1e-2
    assert np.abs(results[0.3] - diffusers_images(theirs, folder, name, 0.0, [image])).max() > 1e-2


def test_per_block_scales_and_two_adapters_match_diffusers(sd1, adapters):
    """InstantStyle's per-block scale (what it leaves out is 0), and two adapters with a scale and an image each."""
    theirs, pipe, params, folder = sd1
    ids = pipe.prepare_inputs(PROMPTS)
    names = ["ip-adapter_base.safetensors", "ip-adapter_plus.safetensors"]
    two, two_params = pipe.load_ip_adapter(params, folder, subfolder="models", weight_name=names)
    images = [pixels(2), pixels(3)]
    style = {"up": {"block_1": [0.0, 1.0]}}
    for scale in ([0.7, 0.5], [style, 0.5]):
        expected = diffusers_images(theirs, folder, names, scale, images)
        ours = two(ids, two_params, jax.random.key(0), STEPS, SIZE, SIZE, latents=latents(), ip_adapter_image=images,
                   ip_adapter_scale=scale).images
        np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - diffusers_images(theirs, folder, names, [0.7, 0.5], images)).max() > 1e-2
    assert two._jitted._cache_size() == 1  # per-block scales are traced numbers too


def test_given_image_embeds_equal_the_image_and_every_mode_agrees(sd1, adapters):
    """`ip_adapter_image_embeds` in diffusers' form ([negative; positive] encoder outputs) give the image's result;
    pmap and the sharded path give the single-device images."""
    from sdflax import replicate, shard

    _, pipe, params, folder = sd1
    ip_pipe, ip_params = pipe.load_ip_adapter(params, folder, subfolder="models",
                                              weight_name="ip-adapter_base.safetensors")
    devices = jax.local_device_count()
    prompts = [f"a fox number {i}" for i in range(devices)]
    ids = pipe.prepare_inputs(prompts)
    image = pixels(4, n=devices)
    noise = np.random.default_rng(8).standard_normal((devices, 4, SIZE // 2, SIZE // 2), dtype=np.float32)
    keys = jax.random.split(jax.random.key(0), devices)
    call = ip_pipe(ids, ip_params, keys, STEPS, SIZE, SIZE, latents=noise, ip_adapter_image=image).images
    encoder = ip_pipe.ip_adapter.image_encoder
    embeds = np.asarray(encoder.apply(ip_params["image_encoder"], image).image_embeds)[:, None]  # (N, 1, E)
    given = ip_pipe(ids, ip_params, keys, STEPS, SIZE, SIZE, latents=noise,
                    ip_adapter_image_embeds=[np.concatenate([np.zeros_like(embeds), embeds])]).images
    np.testing.assert_allclose(given, call, rtol=0, atol=1e-5)
    pmapped = ip_pipe(shard(ids), replicate(ip_params), keys, STEPS, SIZE, SIZE, latents=shard(noise),
                      ip_adapter_image=shard(image), jit=True).images
    np.testing.assert_allclose(pmapped.reshape(call.shape), call, rtol=0, atol=1e-5)
    sharded = ip_pipe.generate_sharded(ids, ip_params, keys, STEPS, SIZE, SIZE, latents=noise, ip_adapter_image=image)
    np.testing.assert_allclose(sharded, call, rtol=0, atol=1e-5)
    assert np.abs(call[0] - call[1]).max() > 1e-3  # each row its own image prompt


def test_bad_ip_adapter_input_is_one_line(sd1, adapters):
    _, pipe, params, folder = sd1
    ids = pipe.prepare_inputs(PROMPTS)
    with pytest.raises(ValueError, match="ip_adapter_image needs an IP-Adapter: pipeline, params = "):
        pipe(ids, params, jax.random.key(0), STEPS, SIZE, SIZE, ip_adapter_image=pixels())
    ip_pipe, ip_params = pipe.load_ip_adapter(params, folder, subfolder="models",
                                              weight_name="ip-adapter_base.safetensors")
    with pytest.raises(ValueError, match="give ip_adapter_image .* or ip_adapter_image_embeds, one of them"):
        ip_pipe(ids, ip_params, jax.random.key(0), STEPS, SIZE, SIZE)
    for wrong in ((pixels() * 255).astype(np.uint8), "face.png"):  # uint8 pixels passed; a path was numpy's error
        with pytest.raises(TypeError, match="ip_adapter_image holds .*; expected CLIP pixels, floats normalised by "
                                            r"CLIP's mean and std: make them with pipeline.prepare_ip_adapter_image"):
            ip_pipe(ids, ip_params, jax.random.key(0), STEPS, SIZE, SIZE, ip_adapter_image=wrong)
    with pytest.raises(TypeError, match=r"ip_adapter_scale must be a number or a per-block dict .*, got None"):
        ip_pipe(ids, ip_params, jax.random.key(0), STEPS, SIZE, SIZE, ip_adapter_image=pixels(), ip_adapter_scale=None)
    with pytest.raises(ValueError, match=r"ip_adapter_image holds 2 entries for 1 IP-Adapters"):
        ip_pipe(ids, ip_params, jax.random.key(0), STEPS, SIZE, SIZE, ip_adapter_image=[pixels(), pixels()])
    with pytest.raises(ValueError, match=r"ip_adapter_scale: up.block_1 has 3 scales; its blocks have 2 attention"):
        ip_pipe(ids, ip_params, jax.random.key(0), STEPS, SIZE, SIZE, ip_adapter_image=pixels(),
                ip_adapter_scale={"up": {"block_1": [0.0, 1.0, 1.0]}})
    with pytest.raises(ValueError, match=r"ip_adapter_scale: up block_7 is not one of this UNet's up blocks with "
                                         r"cross-attention \(block_"):  # it scaled nothing, so the adapter was off
        ip_pipe(ids, ip_params, jax.random.key(0), STEPS, SIZE, SIZE, ip_adapter_image=pixels(),
                ip_adapter_scale={"up": {"block_7": [1.0]}})
    # image embeds of another width: Flax's ScopeParamShapeError from inside the projection
    width = VISION["projection_dim"]
    with pytest.raises(ValueError, match=r"^ip_adapter_image_embeds has an array of shape \(2, 1, 7\); its adapter "
                                         rf"takes {width} wide ones \(E\), its image encoder's output$"):
        ip_pipe(ids, ip_params, jax.random.key(0), STEPS, SIZE, SIZE, ip_adapter_image_embeds=[np.zeros((2, 1, 7))])
    # a mask of another aspect than the image's: a ZeroDivisionError while tracing, where the layer's grid had no row
    with pytest.raises(ValueError, match=r"^ip_adapter_masks\[0\] is 4096x1, not of the image's aspect \(32x32\): "
                                         r"make the masks with pipeline.prepare_ip_adapter_masks\(masks, height, "):
        ip_pipe(ids, ip_params, jax.random.key(0), STEPS, SIZE, SIZE, ip_adapter_image=pixels(),
                ip_adapter_masks=[np.ones((1, 1, 1, 4096), np.float32)])
    # pixels for an adapter loaded without its image encoder: KeyError: 'image_encoder'
    bare_pipe, bare_params = pipe.load_ip_adapter(params, folder, subfolder="models", image_encoder_folder=None,
                                                  weight_name="ip-adapter_base.safetensors")
    with pytest.raises(ValueError, match=r"^ip_adapter_image needs the IP-Adapter's image encoder, which load_ip_"
                                         r"adapter\(..., image_encoder_folder=None\) left out: give ip_adapter_image_"
                                         "embeds, or load it with image_encoder_folder='image_encoder'$"):
        bare_pipe(ids, bare_params, jax.random.key(0), STEPS, SIZE, SIZE, ip_adapter_image=pixels())
    with pytest.raises(ValueError, match="load_ip_adapter needs weight_name="):
        pipe.load_ip_adapter(params, folder, subfolder="models")
    # a later layer of another width (only layer 0 was checked): a reshape traceback in every call
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / "models" / "ip-adapter_base.safetensors")
    rows, columns = tensors["ip_adapter.3.to_k_ip.weight"].shape
    tensors["ip_adapter.3.to_k_ip.weight"] = np.zeros((rows + 8, columns), np.float32)
    save_file(tensors, folder / "models" / "ip-adapter_wrong.safetensors")
    with pytest.raises(ValueError, match=rf"ip-adapter_wrong.safetensors: ip_adapter.3.to_k_ip is \({rows + 8}, "
                                         rf"{columns}\) \(out, in\); this UNet's .*attn2 takes \({rows}, {columns}\)"):
        pipe.load_ip_adapter(params, folder, subfolder="models", weight_name="ip-adapter_wrong.safetensors")


def test_img2img_with_an_adapter_matches_diffusers(sd1, adapters, monkeypatch):
    """The adapter is a UNet wrapper, so every start takes it: image-to-image here (the posterior draw and the added
    noise the same on both sides)."""
    import diffusers.models.autoencoders.vae as torch_vae_module
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img as torch_img2img_module
    from diffusers import StableDiffusionImg2ImgPipeline

    from sdflax import StableDiffusionImg2Img

    theirs, _, _, folder = sd1
    img2img = StableDiffusionImg2ImgPipeline(**theirs.components)
    pipe, params = StableDiffusionImg2Img.from_pretrained(folder)
    pipe, params = pipe.load_ip_adapter(params, folder, subfolder="models", weight_name="ip-adapter_plus.safetensors")
    rng = np.random.default_rng(5)
    ids, image = pipe.prepare_inputs(PROMPTS, list(rng.uniform(0, 1, (1, SIZE, SIZE, 3)).astype(np.float32)))
    noise = rng.standard_normal((1, 4, SIZE // 2, SIZE // 2), dtype=np.float32)
    key = jax.random.key(3)
    posterior = np.asarray(jax.random.normal(jax.random.split(key, 3)[0], noise.shape))  # what ours draws from key
    monkeypatch.setattr(torch_vae_module, "randn_tensor", lambda *a, **k: torch.from_numpy(posterior))
    monkeypatch.setattr(torch_img2img_module, "randn_tensor", lambda *a, **k: torch.from_numpy(noise))
    clip = pixels(6)
    img2img.load_ip_adapter(str(folder), subfolder="models", weight_name="ip-adapter_plus.safetensors")
    img2img.set_ip_adapter_scale(0.9)
    with torch.no_grad():
        expected = img2img(PROMPTS, image=torch.from_numpy(image), strength=0.75, num_inference_steps=4,
                           ip_adapter_image=torch.from_numpy(clip), output_type="np").images
    img2img.unload_ip_adapter()
    ours = pipe(ids, image, params, key, 0.75, 4, noise=noise, ip_adapter_image=clip, ip_adapter_scale=0.9).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    plain = pipe(ids, image, params, key, 0.75, 4, noise=noise, ip_adapter_image=clip, ip_adapter_scale=0.0).images
    assert np.abs(ours - plain).max() > 1e-2


def test_sdxl_adapters_match_diffusers(tmp_path):
    """SDXL adapters (sdxl_models/, their own image encoder), base, Plus and Full Face at once, on the SDXL
    pipeline."""
    from builders import torch_xl_pipeline

    from sdflax import StableDiffusionXL

    theirs = torch_xl_pipeline("euler")
    theirs.save_pretrained(tmp_path / "xl")
    write_ip_adapters(tmp_path / "xl" / "sdxl_models", theirs.unet, {"base": 4, "plus": 5, "full": 6})
    names = ["ip-adapter_base.safetensors", "ip-adapter_plus.safetensors", "ip-adapter_full.safetensors"]
    pipe, params = StableDiffusionXL.from_pretrained(tmp_path / "xl")
    pipe, params = pipe.load_ip_adapter(params, tmp_path / "xl", subfolder="sdxl_models", weight_name=names)
    theirs.load_ip_adapter(str(tmp_path / "xl"), subfolder="sdxl_models", weight_name=names,
                           image_encoder_folder="image_encoder")
    clips = [pixels(7), pixels(12), pixels(16)]
    results = {}
    for scale in ([0.0, 0.0, 0.0], [0.7, 0.5, 0.4]):
        theirs.set_ip_adapter_scale(scale)
        with torch.no_grad():
            expected = theirs(PROMPTS, num_inference_steps=STEPS, height=SIZE, width=SIZE,
                              latents=torch.from_numpy(latents()),
                              ip_adapter_image=[torch.from_numpy(x) for x in clips],
                              output_type="np").images
        ours = pipe(pipe.prepare_inputs(PROMPTS), params, jax.random.key(0), STEPS, height=SIZE, width=SIZE,
                    latents=latents(), ip_adapter_image=clips, ip_adapter_scale=scale).images
        np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
        results[scale[0]] = expected
    assert np.abs(results[0.7] - results[0.0]).max() > 1e-2


def test_masked_pictures_match_diffusers(sd1, adapters):
    """Two pictures for one adapter, each acting where its mask is white (diffusers' IPAdapterMaskProcessor, a
    scale per picture); the masks move diffusers' image."""
    from diffusers.image_processor import IPAdapterMaskProcessor

    theirs, pipe, params, folder = sd1
    ip_pipe, ip_params = pipe.load_ip_adapter(params, folder, subfolder="models",
                                              weight_name="ip-adapter_plus.safetensors")
    left = np.zeros((SIZE, SIZE), np.uint8)
    left[:, : SIZE // 2] = 255
    masks = [left, 255 - left]
    ours_masks = ip_pipe.prepare_ip_adapter_masks(masks, SIZE, SIZE)
    from PIL import Image

    theirs_masks = IPAdapterMaskProcessor().preprocess([Image.fromarray(m) for m in masks], height=SIZE, width=SIZE)
    theirs_masks = theirs_masks.reshape(1, 2, SIZE, SIZE)
    np.testing.assert_array_equal(ours_masks, theirs_masks.numpy())
    two = np.stack([pixels(8)[0], pixels(9)[0]])[None]  # (1, 2, 3, h, w): two pictures for the one adapter
    theirs.load_ip_adapter(str(folder), subfolder="models", weight_name="ip-adapter_plus.safetensors",
                           image_encoder_folder="image_encoder")
    theirs.set_ip_adapter_scale([[0.9, 0.6]])
    with torch.no_grad():
        expected = theirs(PROMPTS, num_inference_steps=STEPS, height=SIZE, width=SIZE,
                          latents=torch.from_numpy(latents()), ip_adapter_image=[torch.from_numpy(two[0])],
                          cross_attention_kwargs={"ip_adapter_masks": [theirs_masks]}, output_type="np").images
        unmasked = theirs(PROMPTS, num_inference_steps=STEPS, height=SIZE, width=SIZE,
                          latents=torch.from_numpy(latents()), ip_adapter_image=[torch.from_numpy(two[0])],
                          cross_attention_kwargs={"ip_adapter_masks": [torch.ones_like(theirs_masks)]},
                          output_type="np").images
    theirs.unload_ip_adapter()
    ours = ip_pipe(pipe.prepare_inputs(PROMPTS), ip_params, jax.random.key(0), STEPS, SIZE, SIZE, latents=latents(),
                   ip_adapter_image=two, ip_adapter_scale=[[0.9, 0.6]], ip_adapter_masks=[ours_masks]).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    assert np.abs(expected - unmasked).max() > 1e-2


def test_beside_a_controlnet_matches_diffusers(sd1, adapters):
    """The adapter acts on the UNet's layers, not the ControlNet's (diffusers' processors are the UNet's)."""
    from builders import torch_controlnet
    from diffusers import StableDiffusionControlNetPipeline

    from sdflax import ControlNetModel, StableDiffusionControlNet

    theirs, _, _, folder = sd1
    net = torch_controlnet(theirs.unet)
    net.save_pretrained(folder / "net")
    both = StableDiffusionControlNetPipeline(**{**theirs.components, "controlnet": net})
    control = np.random.default_rng(11).uniform(0, 1, (1, 3, SIZE, SIZE)).astype(np.float32)
    clip = pixels(10)
    both.load_ip_adapter(str(folder), subfolder="models", weight_name="ip-adapter_base.safetensors")
    both.set_ip_adapter_scale(0.8)
    with torch.no_grad():
        expected = both(PROMPTS, image=torch.from_numpy(control), num_inference_steps=STEPS,
                        latents=torch.from_numpy(latents()), ip_adapter_image=torch.from_numpy(clip),
                        output_type="np").images
    controlnet, net_params = ControlNetModel.from_pretrained(folder / "net")
    pipe, params = StableDiffusionControlNet.from_pretrained(folder, controlnet=controlnet)
    params["controlnet"] = net_params
    pipe, params = pipe.load_ip_adapter(params, folder, subfolder="models", weight_name="ip-adapter_base.safetensors")
    ours = pipe(pipe.prepare_inputs(PROMPTS), control, params, jax.random.key(0), STEPS, latents=latents(),
                ip_adapter_image=clip, ip_adapter_scale=0.8).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)


def test_inpainting_unet_with_an_adapter_matches_diffusers(tmp_path, monkeypatch):
    """A 9-channel inpainting UNet (its extra channels are the start's UNet wrapper, inside the adapter's)."""
    import diffusers.models.autoencoders.vae as torch_vae_module
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint as torch_inpaint_module
    from builders import SD1, torch_unet
    from diffusers import StableDiffusionInpaintPipeline

    from sdflax import StableDiffusionInpaint, random_draws

    components = torch_pipeline("sd1", "ddim").components
    theirs = StableDiffusionInpaintPipeline(**{**components, "unet": torch_unet({**SD1["unet"], "in_channels": 9}, 1)})
    theirs.save_pretrained(tmp_path / "inpaint")
    write_ip_adapters(tmp_path / "inpaint" / "models", theirs.unet, {"base": 6})
    pipe, params = StableDiffusionInpaint.from_pretrained(tmp_path / "inpaint")
    pipe, params = pipe.load_ip_adapter(params, tmp_path / "inpaint", subfolder="models",
                                        weight_name="ip-adapter_base.safetensors")
    rng = np.random.default_rng(13)
    pixels_, masks = rng.uniform(0, 1, (1, SIZE, SIZE, 3)).astype(np.float32), np.zeros((1, SIZE, SIZE), np.float32)
    masks[:, 8:24, 6:26] = 1.0
    ids, image, mask = pipe.prepare_inputs(PROMPTS, list(pixels_), list(masks))
    key = jax.random.key(3)
    (_, masked_eps, noise), _ = random_draws(key, (1, 4, SIZE // 2, SIZE // 2), 3)  # what ours draws
    monkeypatch.setattr(torch_vae_module, "randn_tensor", lambda *a, **k: torch.from_numpy(np.array(masked_eps)))
    monkeypatch.setattr(torch_inpaint_module, "randn_tensor", lambda *a, **k: torch.from_numpy(np.array(noise)))
    clip = pixels(14)
    theirs.load_ip_adapter(str(tmp_path / "inpaint"), subfolder="models", weight_name="ip-adapter_base.safetensors")
    theirs.set_ip_adapter_scale(0.7)
    with torch.no_grad():
        expected = theirs(PROMPTS, image=torch.from_numpy(image), mask_image=torch.from_numpy(masks[:, None]),
                          num_inference_steps=STEPS, height=SIZE, width=SIZE, ip_adapter_image=torch.from_numpy(clip),
                          output_type="np").images
    ours = pipe(ids, image, mask, params, key, num_inference_steps=STEPS, ip_adapter_image=clip,
                ip_adapter_scale=0.7).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    plain = pipe(ids, image, mask, params, key, num_inference_steps=STEPS, ip_adapter_image=clip,
                 ip_adapter_scale=0.0).images
    assert np.abs(ours - plain).max() > 1e-2
