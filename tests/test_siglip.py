"""Parity of sdflax's SigLIP vision tower with transformers' SiglipVisionModel (saved and loaded from disk), with and
without its attention-pooling head, and of `siglip_image_inputs` with transformers' SiglipImageProcessorPil."""

from __future__ import annotations

import json
from functools import partial

import jax
import numpy as np
import pytest
import torch
from builders import randomize_norms
from PIL import Image

from sdflax.models.config import ConfigError
from sdflax.models.siglip import SiglipVisionConfig, SiglipVisionModel
from sdflax.pipeline.clip_image import siglip_image_inputs

RTOL, ATOL = 1e-4, 1e-5  # float32: the same sums in another order

# Scaled-down shapes of SigLIP so400m-patch14 (Flux Redux's and SD 3.5's IP-Adapter image encoder: 1152 wide, 16
# heads, tanh GELU, a pooling head) and of a headless tower of another width and patch.
CONFIGS = {
    "head": dict(hidden_size=48, intermediate_size=100, num_hidden_layers=3, num_attention_heads=4, image_size=28,
                 patch_size=7, vision_use_head=True),
    "no_head": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=30,
                    patch_size=10, vision_use_head=False, hidden_act="gelu", layer_norm_eps=1e-5),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    """(config name, transformers' outputs for random pixels, the pixels, the saved folder)."""
    from transformers import SiglipVisionConfig as TorchConfig
    from transformers import SiglipVisionModel as TorchModel

    torch.manual_seed(0)
    theirs = randomize_norms(TorchModel(TorchConfig(**CONFIGS[request.param])), seed=1).eval()
    if CONFIGS[request.param]["vision_use_head"]:
        with torch.no_grad():  # transformers initialises the head's attention biases to zero: make them count
            for p in theirs.head.attention.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("siglip")
    theirs.save_pretrained(folder)
    size = CONFIGS[request.param]["image_size"]
    pixels = np.random.default_rng(0).standard_normal((2, 3, size, size), dtype=np.float32)
    with torch.no_grad():
        out = theirs(torch.from_numpy(pixels), output_hidden_states=True)
    return request.param, out, pixels, folder


def close(ours, theirs):
    np.testing.assert_allclose(np.asarray(ours), theirs.detach().numpy(), rtol=RTOL, atol=ATOL)


def test_matches_transformers(case):
    """Last hidden state (after post_layernorm), every layer's states (the penultimate one SD 3.5's IP-Adapter
    reads) and the pooled output of the head, or none without it."""
    name, out, pixels, folder = case
    model, params = SiglipVisionModel.from_pretrained(folder)
    assert model.config == SiglipVisionConfig.from_dict(CONFIGS[name])
    ours = jax.jit(partial(model.apply, output_hidden_states=True))(params, pixels)
    close(ours.last_hidden_state, out.last_hidden_state)
    assert len(ours.hidden_states) == len(out.hidden_states) == CONFIGS[name]["num_hidden_layers"] + 1
    for mine, theirs in zip(ours.hidden_states, out.hidden_states):
        close(mine, theirs)
    if CONFIGS[name]["vision_use_head"]:
        assert ours.pooler_output.shape == (2, CONFIGS[name]["hidden_size"])
        close(ours.pooler_output, out.pooler_output)
    else:
        assert ours.pooler_output is None and out.pooler_output is None


def test_bad_config_and_pixels_are_one_line(case, tmp_path):
    name, _, pixels, folder = case
    for key, value in {"hidden_act": "swish", "hidden_size": 31, "patch_size": 64}.items():
        bad = tmp_path / key
        bad.mkdir()
        config = {**json.loads((folder / "config.json").read_text()), key: value}
        (bad / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError) as error:
            SiglipVisionModel.from_pretrained(bad)
        assert "\n" not in str(error.value) and key in str(error.value)
    model, params = SiglipVisionModel.from_pretrained(folder)
    with pytest.raises(ValueError, match=r"takes \(B, 3, \d+, \d+\) \(siglip_image_inputs"):
        model.apply(params, pixels[:, :, :-1])


def test_preprocessing_equals_transformers():
    """Exactly SiglipImageProcessorPil's pixels (what SiglipImageProcessor runs without torchvision): a square
    bicubic resize of odd shapes, transparency and greyscale."""
    from transformers import SiglipImageProcessorPil

    rng = np.random.default_rng(3)
    rgba = rng.integers(0, 256, (50, 70, 4), dtype=np.uint8)
    pictures = [Image.fromarray(rng.integers(0, 256, (333, 517, 3), dtype=np.uint8)), Image.fromarray(rgba, "RGBA"),
                Image.fromarray(rng.integers(0, 256, (40, 31), dtype=np.uint8), "L")]
    for size in (224, 28):
        expected = SiglipImageProcessorPil(size={"height": size, "width": size})(
            images=pictures, return_tensors="np")["pixel_values"]
        ours = siglip_image_inputs(pictures, size=size)
        assert ours.dtype == np.float32 and ours.shape == expected.shape == (3, 3, size, size)
        np.testing.assert_array_equal(ours, expected)
