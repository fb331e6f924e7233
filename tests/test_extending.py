"""docs/extending.md's toy conditioning, defined by the page's own first block, in the image-to-image and ControlNet
pipelines (test_docs runs the page itself: text-to-image and the toy family)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from builders import REPO, parts
from test_tiny_checkpoint import PROMPT, TINY

ATOL = 1e-4  # float32 images in [0, 1]: the tint and the reference's guidance add the same shift in another order
SIZE, STEPS = 64, 2


@pytest.fixture(scope="module")
def tint():
    first = re.search(r"```python\n(.*?)```", (REPO / "docs" / "extending.md").read_text(), re.S).group(1)
    namespace = {}
    exec(compile(first, "docs/extending.md", "exec"), namespace)
    return namespace["Tint"]()


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
