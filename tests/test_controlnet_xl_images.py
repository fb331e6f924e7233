"""The SDXL ControlNet image cells against diffusers: StableDiffusionXLControlNetImg2Img against
StableDiffusionXLControlNetImg2ImgPipeline and StableDiffusionXLControlNetInpaint against
StableDiffusionXLControlNetInpaintPipeline, on small SDXL-shaped checkpoints in float32, in each run mode: one
device (jit=False), pmap over eight devices (jit=True) and jit + NamedSharding (generate_sharded)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from builders import SDXL, torch_controlnet, torch_unet, torch_xl_pipeline

import jax

from sdflax import (ControlNetModel, StableDiffusionXLControlNetImg2Img, StableDiffusionXLControlNetInpaint,
                    random_draws, replicate, shard, unshard)

ATOL = 1e-3  # images in [0, 1], float32
STEPS = 3
SIZE = 32  # pixels; latents 16x16 (VAE scale factor 2)
BATCH = 8  # one image per device under pmap
SHAPE = (BATCH, 4, SIZE // 2, SIZE // 2)
PROMPTS = [f"a watercolor of a lighthouse, {i} boats" for i in range(BATCH)]
NEGATIVE = ["blurry"] * BATCH
# The img2img and ordinary-UNet inpaint runs use the strengths, steps, per-net scales and raw keys that
# tests/test_cli_controlnet.py's SDXL command lines use (the class defaults, on the session's devices): their
# sharded programs are the command line's, which the session's compile cache then compiles once.


def per_image_keys(seed):
    """One raw key per image (numpy uint32, as the command line makes them): every mode draws the same."""
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), BATCH)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, the diffusers SDXL pipeline's components, a diffusers SDXL ControlNet, ours, its params)."""
    folder = tmp_path_factory.mktemp("xl_controlnet")
    base = torch_xl_pipeline("euler")
    net = torch_controlnet(base.unet, seed=4)
    base.save_pretrained(folder / "xl")
    net.save_pretrained(folder / "net")
    return folder, base.components, net, *ControlNetModel.from_pretrained(folder / "net")


def pictures(seed=0):
    """Images (B, H, W, 3) in [0, 1], masks (B, H, W) with a repainted rectangle each, control images (PIL)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = rng.uniform(0, 1, (BATCH, SIZE, SIZE, 3)).astype(np.float32)
    masks = np.zeros((BATCH, SIZE, SIZE), np.float32)
    for b in range(BATCH):
        masks[b, 4 + b:24, 6:26 - b] = 1.0
    controls = [Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)) for _ in range(BATCH)]
    return images, masks, controls


def patch_draws(monkeypatch, module, posterior, noise):
    """diffusers' VAE posterior samples (in the order it encodes) and its added noise, as ours draw them."""
    import diffusers.models.autoencoders.vae as torch_vae_module

    posterior = [torch.from_numpy(np.array(eps)) for eps in posterior]
    monkeypatch.setattr(torch_vae_module, "randn_tensor", lambda *a, **k: posterior.pop(0))
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: torch.from_numpy(np.array(noise)))
    return posterior


def check_every_mode(pipe, params, arrays, keys, expected, without, **kwargs):
    """Ours equals diffusers' images on one device, under pmap and sharded; and the net moves diffusers' image."""
    assert expected.std() > 0.05  # not a blank image: the comparison means something
    assert np.abs(expected - without).max() > 1e-2  # the ControlNet (at this scale) changes diffusers' image
    single = pipe(*arrays, params, keys, **kwargs).images
    np.testing.assert_allclose(single, expected, rtol=0, atol=ATOL)
    per_image = {name: shard(value) for name, value in kwargs.items() if name == "neg_prompt_ids"}
    pmapped = pipe(*[shard(a) for a in arrays], replicate(params), shard(keys), jit=True,
                   **{**kwargs, **per_image}).images
    np.testing.assert_allclose(unshard(pmapped), expected, rtol=0, atol=ATOL)
    sharded = pipe.generate_sharded(*arrays, params, keys, **kwargs)
    np.testing.assert_allclose(sharded, expected, rtol=0, atol=ATOL)


def test_img2img_matches_diffusers_in_every_mode(checkpoint, monkeypatch):
    import diffusers.pipelines.controlnet.pipeline_controlnet_sd_xl_img2img as module
    from diffusers import StableDiffusionXLControlNetImg2ImgPipeline

    folder, components, net, controlnet, net_params = checkpoint
    pipe, params = StableDiffusionXLControlNetImg2Img.from_pretrained(folder / "xl", controlnet=controlnet)
    params["controlnet"] = net_params
    theirs = StableDiffusionXLControlNetImg2ImgPipeline(**components, controlnet=net)
    images, _, controls = pictures()
    ids, image, control = pipe.prepare_inputs(PROMPTS, list(images), controls)
    keys = per_image_keys(3)
    (posterior_eps, noise), _ = random_draws(keys, SHAPE, 2)
    scale, strength = 0.7, StableDiffusionXLControlNetImg2Img.defaults["strength"]

    def diffusers_run(controlnet_conditioning_scale):
        patch_draws(monkeypatch, module, [posterior_eps], noise)
        with torch.no_grad():
            return theirs(PROMPTS, image=torch.from_numpy(image), control_image=controls, strength=strength,
                          num_inference_steps=STEPS, negative_prompt=NEGATIVE, output_type="np",
                          controlnet_conditioning_scale=controlnet_conditioning_scale).images

    check_every_mode(pipe, params, (ids, image, control), keys, diffusers_run(scale), diffusers_run(0.0),
                     strength=strength, num_inference_steps=STEPS, neg_prompt_ids=pipe.prepare_inputs(NEGATIVE),
                     controlnet_conditioning_scale=[scale])


@pytest.mark.parametrize("unet_channels, strength", [
    (9, 1.0), (4, StableDiffusionXLControlNetInpaint.defaults["strength"])])
def test_inpaint_matches_diffusers_in_every_mode(checkpoint, monkeypatch, tmp_path, unet_channels, strength):
    """An SDXL inpainting UNet (the nets see the 4-channel latents) and an ordinary one (the kept region pasted
    back), at diffusers' default scale."""
    import diffusers.pipelines.controlnet.pipeline_controlnet_inpaint_sd_xl as module
    from diffusers import StableDiffusionXLControlNetInpaintPipeline

    folder, components, net, controlnet, net_params = checkpoint
    components = dict(components)
    if unet_channels == 9:
        components["unet"] = torch_unet({**SDXL["unet"], "in_channels": 9}, seed=1)
    theirs = StableDiffusionXLControlNetInpaintPipeline(**components, controlnet=net)
    theirs.save_pretrained(tmp_path)
    pipe, params = StableDiffusionXLControlNetInpaint.from_pretrained(tmp_path, controlnet=controlnet)
    params["controlnet"] = net_params
    assert pipe.inpainting_unet == (unet_channels == 9)
    images, masks, controls = pictures(1)
    ids, image, mask, control = pipe.prepare_inputs(PROMPTS, list(images), list(masks), controls)
    keys = per_image_keys(5)
    (image_eps, masked_eps, noise), _ = random_draws(keys, SHAPE, 3)

    def diffusers_run(**kwargs):
        # diffusers encodes the image (when it needs its latents), then the masked image
        posterior = patch_draws(monkeypatch, module, [image_eps, masked_eps] if strength < 1 or unet_channels == 4
                                else [masked_eps], noise)
        with torch.no_grad():
            out = theirs(PROMPTS, image=torch.from_numpy(image), mask_image=torch.from_numpy(masks[:, None]),
                         control_image=controls, strength=strength, num_inference_steps=STEPS, height=SIZE,
                         width=SIZE, negative_prompt=NEGATIVE, output_type="np", **kwargs).images
        assert not posterior, "diffusers drew fewer posterior samples than expected"
        return out

    check_every_mode(pipe, params, (ids, image, mask, control), keys, diffusers_run(),
                     diffusers_run(controlnet_conditioning_scale=0.0), strength=strength, num_inference_steps=STEPS,
                     neg_prompt_ids=pipe.prepare_inputs(NEGATIVE), controlnet_conditioning_scale=[1.0])
