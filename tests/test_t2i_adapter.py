"""T2IAdapter (Mou et al. 2023) against diffusers' PyTorch T2IAdapter and MultiAdapter, on small random adapters of
the three architectures saved by diffusers and loaded by sdflax."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from diffusers import MultiAdapter
from diffusers import T2IAdapter as TorchT2IAdapter

from sdflax import T2IAdapter
from sdflax.models import T2IAdapterConfig, combine_adapter_states
from sdflax.models.config import ConfigError
from sdflax.models.t2i_adapter import pixel_unshuffle

# float32 parity: every element within 1e-5 of the feature's largest magnitude (1e-5 relative to its scale)
RTOL = 1e-5

# name -> (config, image height, width): both image channel counts, odd sizes for the ceil-mode pooling (48x40 at
# 1/8 is 6x5 -> 3x3 -> 2x2), the SDXL layout (two levels at 1/16, two at 1/32), the light adapter's extra level.
CASES = {
    "full": (dict(in_channels=3, channels=[8, 16, 16], num_res_blocks=2, downscale_factor=8,
                  adapter_type="full_adapter"), 48, 40),
    "xl": (dict(in_channels=1, channels=[8, 16, 16, 16], num_res_blocks=1, downscale_factor=16,
                adapter_type="full_adapter_xl"), 64, 48),
    "light": (dict(in_channels=1, channels=[8, 16], num_res_blocks=2, downscale_factor=8,
                   adapter_type="light_adapter"), 48, 40),
}
# What diffusers returns, per case: (channels, height, width) per level, for batch 2.
SHAPES = {"full": [(8, 6, 5), (16, 3, 3), (16, 2, 2)],
          "xl": [(8, 4, 3), (16, 4, 3), (16, 2, 2), (16, 2, 2)],
          "light": [(8, 6, 5), (16, 3, 3), (16, 2, 2)]}


def torch_adapter(config, seed):
    torch.manual_seed(seed)
    return TorchT2IAdapter(**config).eval()


def torch_features(adapter, image):
    with torch.no_grad():
        return [f.numpy() for f in adapter(torch.from_numpy(image))]


def images(config, height, width, seed):
    return np.random.default_rng(seed).uniform(0, 1, (2, config["in_channels"], height, width)).astype(np.float32)


def assert_features_match(ours, theirs, shapes):
    assert [tuple(f.shape) for f in theirs] == [(2, *s) for s in shapes]
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert b.std() > 0.01, f"feature {i} is ~constant: the test would mean nothing"
        np.testing.assert_allclose(np.asarray(a), b, rtol=RTOL, atol=RTOL * np.abs(b).max(), err_msg=f"feature {i}")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """name -> (diffusers' adapter, sdflax's loaded from its save_pretrained folder, params, jitted apply)."""
    found = {}
    for seed, (name, (config, _, _)) in enumerate(CASES.items()):
        theirs = torch_adapter(config, seed)
        folder = tmp_path_factory.mktemp(name)
        theirs.save_pretrained(folder)
        module, params = T2IAdapter.from_pretrained(folder)
        found[name] = (theirs, module, params, jax.jit(module.apply))
    return found


@pytest.mark.parametrize("name", sorted(CASES))
def test_features_match_diffusers(adapters, name):
    config, height, width = CASES[name]
    theirs, module, params, run = adapters[name]
    assert module.config == T2IAdapterConfig(**dict(config, channels=tuple(config["channels"])))
    assert (module.downscale_factor, module.total_downscale_factor) == (theirs.downscale_factor,
                                                                         theirs.total_downscale_factor)
    image = images(config, height, width, seed=1)
    assert_features_match(run(params, image), torch_features(theirs, image), SHAPES[name])


def test_pixel_unshuffle_is_torchs():
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 12)).astype(np.float32)
    expected = torch.nn.functional.pixel_unshuffle(torch.from_numpy(x), 4).numpy()
    np.testing.assert_array_equal(pixel_unshuffle(x, 4), expected)


def test_multi_adapter_matches_diffusers(adapters):
    """A full and a light adapter (the same levels, widths and downscale factors), weighted 0.7 and 0.3, as
    diffusers' MultiAdapter sums them; and with its default weights, 1/2 each."""
    names = ("full", "light")
    xs = [images(CASES[name][0], 48, 40, seed=2 + i) for i, name in enumerate(names)]
    states = [adapters[name][3](adapters[name][2], x) for name, x in zip(names, xs)]
    multi = MultiAdapter([adapters[name][0] for name in names])
    for weights in ([0.7, 0.3], None):
        with torch.no_grad():
            expected = [f.numpy() for f in multi([torch.from_numpy(x) for x in xs], adapter_weights=weights)]
        assert_features_match(combine_adapter_states(states, weights), expected, SHAPES["full"])


def test_combining_needs_matching_adapters(adapters):
    full = adapters["full"][3](adapters["full"][2], images(CASES["full"][0], 48, 40, seed=3))
    xl = adapters["xl"][3](adapters["xl"][2], images(CASES["xl"][0], 48, 48, seed=3))
    for states, weights, words in [([full, xl], None, "adapter 1's features are"),
                                   ([full, full], [0.5, 0.3, 0.2], "one weight per adapter"),
                                   ([full], None, "two or more")]:
        with pytest.raises(ValueError, match=words) as error:
            combine_adapter_states(states, weights)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("change, words", [
    (dict(adapter_type="medium_adapter"), "adapter_type='medium_adapter'; it is one of full_adapter"),
    (dict(adapter_type="light_adapter", channels=[2, 8]), "quarter width"),
    (dict(adapter_type="full_adapter_xl", channels=[8, 16, 16, 32]), r"channels\[3\] = channels\[2\]"),
    (dict(downscale_factor=0), "downscale_factor=0"),
])
def test_bad_config_is_one_line(tmp_path, change, words):
    (tmp_path / "config.json").write_text(json.dumps(dict(CASES["full"][0], **change)))
    with pytest.raises(ConfigError, match=words) as error:
        T2IAdapter.from_pretrained(tmp_path)
    assert "config.json" in str(error.value) and "\n" not in str(error.value)


def test_bad_image_is_one_line(adapters):
    _, _, params, run = adapters["full"]
    for shape, words in [((1, 1, 48, 40), r"takes \(B, 3, H, W\)"), ((1, 3, 44, 40), "multiples of .* 8")]:
        with pytest.raises(ValueError, match=words) as error:
            run(params, np.zeros(shape, np.float32))
        assert "\n" not in str(error.value)
