"""docs/extending.md's toys, defined by the page's own blocks: the toy conditioning in the image-to-image and ControlNet
pipelines, the toy family (its own tiny denoiser) from a checkpoint folder in every run mode (test_docs runs the page
itself: the conditioning in text-to-image, the family from_pretrained with jit=False)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from builders import REPO, parts
from test_tiny_checkpoint import PROMPT, TINY

ATOL = 1e-4  # float32 images in [0, 1]: the tint and the reference's guidance add the same shift in another order
SIZE, STEPS = 64, 2


def page_block(holding: str) -> dict:
    """The namespace of the page's first ```python block that holds `holding`, run on its own."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "extending.md").read_text(), re.S)
    namespace = {"__name__": "extending_page"}
    exec(compile(next(b for b in blocks if holding in b), "docs/extending.md", "exec", dont_inherit=True), namespace)
    return namespace


@pytest.fixture(scope="module")
def tint():
    return page_block("class Tint:")["Tint"]()


@pytest.fixture(scope="module")
def tiny():
    from sdflax import StableDiffusion

    pipe, params = StableDiffusion.from_pretrained(TINY)
    return pipe, {**params, "tint": jnp.asarray([0.2, -0.2, 0.0, 0.1])}


def img2img(pipe, params):
    from sdflax import StableDiffusionImg2Img

    picture = np.random.default_rng(0).uniform(0, 1, (SIZE, SIZE, 3)).astype(np.float32)
    ours = StableDiffusionImg2Img(**parts(pipe))
    ids, image = ours.prepare_inputs([PROMPT], [picture])
    return ours, params, (ids, image), {"strength": 0.75}


def controlnet(pipe, params):
    from sdflax import ControlNetModel, StableDiffusionControlNet

    net = ControlNetModel.from_unet(pipe.unet, conditioning_embedding_out_channels=(16, 32, 32))  # 1/4: the VAE's
    net_params = net.init_params(jax.random.key(1))  # random: its residuals change the image
    ours = StableDiffusionControlNet(**parts(pipe), controlnet=net)
    control = np.random.default_rng(1).uniform(0, 1, (SIZE, SIZE, 3)).astype(np.float32)
    return (ours, {**params, "controlnet": net_params},
            (ours.prepare_text_inputs([PROMPT]), ours.prepare_image_inputs([control])), {})


@pytest.mark.parametrize("make", [img2img, controlnet])
def test_the_toy_conditioning_runs_in_other_pipelines(make, tint, tiny):
    pipe, params, leading, kwargs = make(*tiny)
    tinted = pipe.with_conditioning(tint)
    key, call = jax.random.key(0), dict(num_inference_steps=STEPS, height=SIZE, width=SIZE, **kwargs)
    images = tinted(*leading, params, key, tint_scale=0.5, **call).images
    untinted = tinted(*leading, params, key, tint_scale=0.0, **call).images  # the same program
    shift = 0.5 * params["tint"][None, :, None, None]
    reference = pipe(*leading, params, key, guidance=lambda u, c, g: u + g * (c - u) + shift, **call).images
    np.testing.assert_allclose(images, reference, rtol=0, atol=ATOL)
    assert np.abs(images - untinted).max() > 1e-2
    assert tinted._runner.jit._cache_size() == 1


@pytest.fixture(scope="module")
def tiny_family(tmp_path_factory):
    """The page's family (registered once per process: test_docs may have run the page already) and a checkpoint of
    it: the tiny SD's text encoder and VAE, and a TinyNet of random weights in Flax msgpack."""
    from sdflax.families import named, registered

    family = named("tiny") if "tiny" in registered() else page_block("class TinyNet(")["TINY"]
    net_class = family.text.models["tinynet"]
    text_width = json.loads((TINY / "text_encoder" / "config.json").read_text())["hidden_size"]
    net = net_class(net_class.config_class(cross_attention_dim=text_width))
    net_params = net.init_params(jax.random.key(3))
    folder = tmp_path_factory.mktemp("tiny-family")
    for part in ("text_encoder", "tokenizer", "vae", "scheduler"):
        os.symlink(TINY / part, folder / part)
    (folder / "tinynet").mkdir()
    (folder / "tinynet" / "config.json").write_text(json.dumps(dataclasses.asdict(net.config)))
    (folder / "tinynet" / "diffusion_flax_model.msgpack").write_bytes(flax.serialization.to_bytes(net_params))
    index = {k: v for k, v in json.loads((TINY / "model_index.json").read_text()).items() if k != "unet"}
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "TinyDiffusionPipeline",
                                                         "tinynet": ["extending_page", "TinyNet"]}))
    return family, folder, net_params


def test_the_toy_family_loads_its_own_denoiser_and_runs_in_every_mode(tiny_family):
    import sdflax
    from sdflax import replicate, shard

    family, folder, saved = tiny_family
    tiny, params = sdflax.from_pretrained(folder)
    assert type(tiny) is family.classes["TinyDiffusion"] and "unet" not in params
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params["tinynet"], saved)

    devices = jax.local_device_count()  # one image a device, each from its own key
    ids, keys = tiny.prepare_inputs([PROMPT] * devices), jax.random.split(jax.random.key(0), devices)
    alone = tiny(ids[:1], params, keys[0]).images  # jit=False; its own defaults: 4 steps at 64 x 64
    pmapped = tiny(shard(ids), replicate(params), keys, jit=True).images
    sharded = tiny.generate_sharded(ids, params, keys)
    np.testing.assert_allclose(pmapped.reshape(sharded.shape), sharded, rtol=0, atol=1e-6)
    np.testing.assert_allclose(sharded[:1], alone, rtol=0, atol=1e-6)
    other = tiny(ids[:1], {**params, "tinynet": jax.tree.map(lambda x: 2 * x, params["tinynet"])}, keys[0]).images
    assert np.abs(alone - other).max() > 1e-2  # the images are TinyNet's

    img2img, _ = sdflax.from_pretrained(folder, start="image")
    assert type(img2img) is family.classes["TinyDiffusionImg2Img"]
    picture = np.random.default_rng(0).uniform(0, 1, (SIZE, SIZE, 3)).astype(np.float32)
    ids, image = img2img.prepare_inputs([PROMPT], [picture])
    kept = img2img(ids, image, params, keys[0], strength=0.25).images
    assert np.abs(kept - img2img(ids, image, params, keys[0], strength=1.0).images).max() > 1e-3
    assert np.abs(kept - img2img(ids, 1 - image, params, keys[0], strength=0.25).images).max() > 1e-3
