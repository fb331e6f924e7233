"""Families are values: the registry finds sdflax's own by a checkpoint's model_index.json, and a family defined
here, outside the package, loads with `sdflax.from_pretrained` and runs as sdflax's own do."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

import sdflax
from sdflax.families import Family, Row, for_index, named, register
from sdflax.pipeline.starts import FromNoise
from sdflax.pipeline.text import SDText

from test_tiny_checkpoint import PROMPT, TINY

TOY = Family("toy", "Toy SD", SDText, ("ToyDiffusion",), {
    "ToyDiffusion": Row(FromNoise, (), "prompt_ids params prng_seed num_inference_steps height width guidance_scale jit",
                        {"guidance_scale": 3.0, "num_inference_steps": 2}, "A family of a user's module.")},
    module=__name__)


@pytest.mark.parametrize("class_name, family", [
    ("StableDiffusionPipeline", "sd"), ("StableDiffusionImg2ImgPipeline", "sd"),
    ("StableDiffusionXLPipeline", "sdxl"), ("StableDiffusionXLImg2ImgPipeline", "sdxl"),
    ("StableDiffusionXLControlNetPipeline", "sdxl"), ("StableDiffusion3Pipeline", "sd3"),
    ("StableDiffusion3Img2ImgPipeline", "sd3"), ("LatentConsistencyModelPipeline", "sd"), (None, "sd")])
def test_the_family_of_a_checkpoint_comes_from_its_pipeline_class(class_name, family):
    assert for_index({} if class_name is None else {"_class_name": class_name}).name == family


def test_a_family_knows_its_classes():
    assert named("sdxl").pipeline_class("image") is sdflax.StableDiffusionXLImg2Img
    assert named("sd").pipeline_class("image_mask", controlnet=True) is sdflax.StableDiffusionControlNetInpaint
    assert sdflax.StableDiffusion3Inpaint.family is named("sd3") and named("sd3").flow and not named("sd").flow
    with pytest.raises(ValueError, match="no model family named 'sd4'; known: sd, sdxl, sd3, flux"):
        named("sd4")
    with pytest.raises(TypeError, match="register takes an sdflax.families.Family, not dict"):
        register({"name": "sd"})
    with pytest.raises(ValueError, match="a family named 'sd' is registered already"):
        register(Family("sd", "SD", SDText, (), {}))


def test_a_family_from_outside_the_package_loads_and_runs(tmp_path):
    folder = tmp_path / "toy"
    folder.mkdir()
    for part in os.listdir(TINY):
        if part != "model_index.json":
            os.symlink(TINY / part, folder / part)
    index = json.loads((TINY / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "ToyDiffusionPipeline"}))

    assert register(TOY) is TOY and register(TOY) is TOY  # once, however often its module asks
    toy, params = sdflax.from_pretrained(folder)
    assert type(toy).__name__ == "ToyDiffusion" and type(toy).__module__ == __name__ and toy.family is TOY
    sd, _ = sdflax.StableDiffusion.from_pretrained(folder)
    ids, key = toy.prepare_inputs([PROMPT]), jax.random.key(0)
    images = toy(ids, params, key, height=64, width=64).images  # its own defaults: 2 steps, guidance 3
    same = sd(ids, params, key, num_inference_steps=2, height=64, width=64, guidance_scale=3.0).images
    default = sd(ids, params, key, num_inference_steps=2, height=64, width=64).images  # SD's guidance, 7.5
    np.testing.assert_array_equal(images, same)
    assert np.abs(images - default).max() > 1e-3  # the defaults are the family's own
    # every run mode: test_extending's family, which brings its own denoiser too
