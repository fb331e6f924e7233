"""Parity of sdflax's CLIP vision tower with transformers' CLIPVisionModelWithProjection (loaded from disk, both
weight formats, with and without the `vision_model.` prefix), and of `clip_image_inputs` with transformers'
CLIPImageProcessor (its PIL backend)."""

from __future__ import annotations

import json
from functools import partial

import jax
import numpy as np
import pytest
import torch
from builders import randomize_norms
from PIL import Image
from safetensors.torch import save_file

from sdflax import CLIPVisionModelWithProjection, clip_image_inputs
from sdflax.pipeline.clip_image import clip_image_options
from sdflax.models import CLIPVisionConfig
from sdflax.models.config import ConfigError
from sdflax.loading.weights import CheckpointMismatchError

# float32 parity: the same sums in another order (XLA's matmuls and attention against PyTorch's) differ by a few
# float32 ulps per layer.
RTOL, ATOL = 1e-4, 1e-5

# Scaled-down shapes of IP-Adapter's two image encoders: ViT-H/14 (1280 wide, 16 heads, MLP 5120, projection 1024)
# and ViT-bigG/14 (1664 wide, 16 heads of 104, MLP 8192, projection 1280): gelu, projection narrower than the tower.
CONFIGS = {
    "vit_h": dict(hidden_size=32, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, image_size=28,
                  patch_size=14, projection_dim=24, hidden_act="gelu", layer_norm_eps=1e-5),
    "vit_bigg": dict(hidden_size=48, intermediate_size=236, num_hidden_layers=2, num_attention_heads=3,
                     image_size=42, patch_size=14, projection_dim=40, hidden_act="gelu", layer_norm_eps=1e-5),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def shape(request):
    return request.param


@pytest.fixture(scope="module")
def theirs(shape):
    from transformers import CLIPVisionConfig as TorchConfig
    from transformers import CLIPVisionModelWithProjection as TorchModel

    torch.manual_seed(0)
    return randomize_norms(TorchModel(TorchConfig(**CONFIGS[shape])), seed=1).eval()


@pytest.fixture(scope="module")
def expected(theirs, shape):
    size = CONFIGS[shape]["image_size"]
    pixels = np.random.default_rng(0).standard_normal((2, 3, size, size), dtype=np.float32)
    with torch.no_grad():
        return pixels, theirs(torch.from_numpy(pixels), output_hidden_states=True)


@pytest.fixture(scope="module")
def saved_folder(theirs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("image_encoder")
    theirs.save_pretrained(folder)
    return folder


def state_dict_of(folder):
    from safetensors.numpy import load_file

    return {key: torch.from_numpy(value) for key, value in load_file(folder / "model.safetensors").items()}


def rewritten(folder, target, state_dict, fmt):
    """`folder`'s config with `state_dict` written in `fmt` ("safetensors" or transformers 4's pytorch_model.bin)."""
    target.mkdir()
    (target / "config.json").write_text((folder / "config.json").read_text())
    if fmt == "safetensors":
        save_file(state_dict, target / "model.safetensors")
    else:
        torch.save(state_dict, target / "pytorch_model.bin")
    return target


def assert_close(ours, theirs):
    np.testing.assert_allclose(np.asarray(ours), theirs.detach().numpy(), rtol=RTOL, atol=ATOL)


def assert_matches(model, params, expected, num_hidden_layers):
    pixels, out = expected
    ours = jax.jit(partial(model.apply, output_hidden_states=True))(params, pixels)
    assert ours.image_embeds.shape == tuple(out.image_embeds.shape)
    assert_close(ours.image_embeds, out.image_embeds)
    assert_close(ours.last_hidden_state, out.last_hidden_state)
    # transformers' hidden_states[0] is the embeddings after pre_layrnorm; then each layer's output
    assert len(ours.hidden_states) == len(out.hidden_states) == num_hidden_layers + 1
    for mine, theirs_h in zip(ours.hidden_states, out.hidden_states):
        assert_close(mine, theirs_h)


def test_saved_by_transformers_matches(saved_folder, expected, shape):
    keys = state_dict_of(saved_folder)
    assert all(k.startswith(("vision_model.", "visual_projection.")) for k in keys)  # what transformers 5 writes
    model, params = CLIPVisionModelWithProjection.from_pretrained(saved_folder)
    assert model.config == CLIPVisionConfig.from_dict(CONFIGS[shape])
    assert_matches(model, params, expected, CONFIGS[shape]["num_hidden_layers"])
    ours = jax.jit(model.apply)(params, expected[0])
    assert ours.hidden_states is None


@pytest.mark.parametrize("fmt, prefixed", [("bin", True), ("bin", False), ("safetensors", False)])
def test_other_writers_load(saved_folder, expected, shape, fmt, prefixed, tmp_path):
    """transformers 4's pytorch_model.bin (with `vision_model.embeddings.position_ids`, a buffer), and tensors
    named without the `vision_model.` prefix (as transformers 5's CLIPVisionModel writes its tower)."""
    state_dict = state_dict_of(saved_folder)
    if fmt == "bin":
        grid = CONFIGS[shape]["image_size"] // CONFIGS[shape]["patch_size"]
        state_dict["vision_model.embeddings.position_ids"] = torch.arange(grid ** 2 + 1)[None]
    if not prefixed:
        state_dict = {k.removeprefix("vision_model."): v for k, v in state_dict.items()}
    folder = rewritten(saved_folder, tmp_path / "image_encoder", state_dict, fmt)
    model, params = CLIPVisionModelWithProjection.from_pretrained(folder)
    pixels, out = expected
    ours = jax.jit(model.apply)(params, pixels)
    assert_close(ours.image_embeds, out.image_embeds)


def test_full_clip_config_reads_the_vision_tower(saved_folder, tmp_path):
    from transformers import CLIPConfig

    vision = json.loads((saved_folder / "config.json").read_text())
    full = CLIPConfig(vision_config=vision).to_dict()
    assert CLIPVisionConfig.from_dict(full) == CLIPVisionConfig.from_dict(vision)
    defaults = CLIPVisionConfig()
    assert (defaults.hidden_size, defaults.patch_size, defaults.projection_dim, defaults.hidden_act) == \
        (768, 32, 512, "quick_gelu")  # transformers' CLIPVisionConfig defaults


def test_bad_input_is_one_line(saved_folder, tmp_path):
    bad = {"hidden_act": "swish", "hidden_size": 31, "patch_size": 64, "num_hidden_layers": 0, "image_size": [28, 28]}
    for key, value in bad.items():
        folder = tmp_path / key
        folder.mkdir()
        config = {**json.loads((saved_folder / "config.json").read_text()), key: value}
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError) as error:
            CLIPVisionModelWithProjection.from_pretrained(folder)
        assert "\n" not in str(error.value) and key in str(error.value) and "config.json" in str(error.value)
    state_dict = state_dict_of(saved_folder)
    del state_dict["visual_projection.weight"]
    folder = rewritten(saved_folder, tmp_path / "no_projection", state_dict, "safetensors")
    with pytest.raises(CheckpointMismatchError, match="missing from the checkpoint: visual_projection/kernel"):
        CLIPVisionModelWithProjection.from_pretrained(folder)
    model, params = CLIPVisionModelWithProjection.from_pretrained(saved_folder)
    with pytest.raises(ValueError, match=r"takes \(B, 3, \d+, \d+\) \(clip_image_inputs"):
        model.apply(params, np.zeros((1, 3, 32, 32), np.float32))


def test_a_strip_of_extreme_aspect_is_refused_before_it_is_resized():
    """A 1-pixel-wide strip within the file-size bound grew to 224 x (224 x its length) pixels: a MemoryError."""
    with pytest.raises(ValueError, match=r"an image of 1x400000 pixels, resized to 224 on its short side for the "
                                         r"image encoder, would be 224x89600000: crop it nearer to a square "
                                         r"\(at most 1337:1\)"):
        clip_image_inputs(Image.new("RGB", (1, 400000)))
    assert clip_image_inputs(Image.new("RGB", (1, 1337))).shape == (1, 3, 224, 224)  # the bound itself passes


# Odd sizes, both orientations, a sliver, transparency and greyscale: PIL images and uint8 arrays.
def pictures():
    rng = np.random.default_rng(3)
    pixels = lambda h, w, c: rng.integers(0, 256, (h, w, c), dtype=np.uint8)  # noqa: E731
    rgba = pixels(200, 150, 4)
    rgba[..., 3] = rng.choice([0, 90, 255], (200, 150))
    return {"333x517": Image.fromarray(pixels(333, 517, 3)), "517x333": Image.fromarray(pixels(517, 333, 3)),
            "64x1000": Image.fromarray(pixels(64, 1000, 3)), "rgba": Image.fromarray(rgba, "RGBA"),
            "grey": Image.fromarray(pixels(301, 257, 1)[..., 0], "L"), "palette": Image.fromarray(
                pixels(90, 120, 3)).convert("P"), "array": pixels(260, 230, 3), "array_rgba": rgba,
            "array_grey": pixels(100, 230, 1), "square_224": Image.fromarray(pixels(224, 224, 3))}


@pytest.mark.parametrize("options", [{}, {"size": 32, "crop_size": (24, 30)}, {"size": 20, "crop_size": 27}])
def test_preprocessing_equals_transformers(options):
    """Exactly equal: the same PIL bicubic resize, the same integer crop and the same float64 -> float32 rescale
    and float32 normalisation as transformers' CLIPImageProcessorPil (transformers' CLIPImageProcessor without
    torchvision). A crop larger than the resized picture is padded as transformers pads it."""
    from transformers import CLIPImageProcessorPil

    crop = options.get("crop_size", 224)
    crop = {"height": crop, "width": crop} if isinstance(crop, int) else dict(zip(("height", "width"), crop))
    processor = CLIPImageProcessorPil(**({"size": {"shortest_edge": options["size"]}, "crop_size": crop}
                                         if options else {}))
    images = pictures()
    expected = processor(images=list(images.values()), return_tensors="np")["pixel_values"]
    ours = clip_image_inputs(list(images.values()), **options)
    assert ours.dtype == np.float32 and ours.shape == expected.shape == (len(images), 3, crop["height"],
                                                                         crop["width"])
    for i, name in enumerate(images):
        np.testing.assert_array_equal(ours[i], expected[i], err_msg=name)
    assert clip_image_inputs(images["rgba"], **options).shape == (1, *ours.shape[1:])  # one picture


def test_preprocessor_config(tmp_path):
    from transformers import CLIPImageProcessorPil

    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 24, "width": 30}).save_pretrained(tmp_path)
    options = clip_image_options(tmp_path / "preprocessor_config.json")
    assert options["size"] == 32 and options["crop_size"] == (24, 30)
    assert clip_image_inputs(pictures()["grey"], **options).shape == (1, 3, 24, 30)
    for key, value in {"resample": 2, "do_center_crop": False, "size": {"height": 5, "width": 5},
                       "image_mean": [0.5]}.items():
        with pytest.raises(ConfigError) as error:
            clip_image_options({**json.loads((tmp_path / "preprocessor_config.json").read_text()), key: value})
        assert "\n" not in str(error.value) and key in str(error.value)
