"""sdflax's cache folder: parameter shapes read back equal the traced ones, a damaged or stale file is traced over,
`SDFLAX_CACHE_DIR=off` keeps nothing, pipelines leave JAX's compilation cache as the process set it, and
`sdflax.enable_compile_cache()` turns it on where the process did not choose."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from builders import REPO

from sdflax import cache
from sdflax.models import AutoencoderKL, UNet2DConditionModel
from sdflax.models.config import read_config_file

TINY = REPO / "weights" / "tiny-sd"


def models():
    return [UNet2DConditionModel.from_config(read_config_file(TINY / "unet" / "config.json"), jnp.float32),
            AutoencoderKL.from_config(read_config_file(TINY / "vae" / "config.json"), jnp.bfloat16)]


def traced(module):
    return jax.eval_shape(lambda: module.init(jax.random.key(0), *module.dummy_inputs())["params"])


def never():
    raise AssertionError("traced although the shapes are in the cache")


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("module", models(), ids=["unet", "vae-bfloat16"])
def test_shapes_from_the_cache_equal_the_traced_ones(folder, module):
    expected = traced(module)
    assert jax.tree.leaves(expected)
    assert cache.param_shapes(module) == expected  # traced and written
    assert len(list((folder / "param-shapes").iterdir())) == 1
    assert cache.param_shapes(module, never) == expected  # read back: same tree, shapes and dtypes


def test_another_config_is_another_entry(folder):
    unet = models()[0]
    wider = unet.clone(config=unet.config.__class__(**{**vars(unet.config), "cross_attention_dim": 16}))
    first, second = cache.param_shapes(unet), cache.param_shapes(wider)
    assert len(list((folder / "param-shapes").iterdir())) == 2
    assert first != second and second == traced(wider)


def test_a_damaged_file_is_traced_over(folder):
    unet = models()[0]
    cache.param_shapes(unet)
    (entry,) = (folder / "param-shapes").iterdir()
    for damage in ("{not json", json.dumps({"conv_in/kernel": "nonsense"}), json.dumps([1, 2])):
        entry.write_text(damage)
        assert cache.param_shapes(unet) == traced(unet)
        assert cache.param_shapes(unet, never) == traced(unet)  # rewritten whole


def test_an_edited_file_is_traced_over(folder):
    """An edited shapes file made a valid checkpoint "not match the model config": its checksum fails."""
    unet = models()[0]
    cache.param_shapes(unet)
    (entry,) = (folder / "param-shapes").iterdir()
    edited = json.loads(entry.read_text())
    kernel = edited["shapes"]["conv_in/kernel"][0]
    kernel[0] += 1
    entry.write_text(json.dumps(edited))
    assert cache.param_shapes(unet) == traced(unet)
    assert json.loads(entry.read_text())["shapes"]["conv_in/kernel"][0][0] == kernel[0] - 1  # rewritten


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, "off")
    assert cache.cache_dir() is None
    calls = []
    module = models()[1]
    assert cache.param_shapes(module, lambda: calls.append(1) or traced(module)) == traced(module)
    assert cache.param_shapes(module, lambda: calls.append(1) or traced(module)) == traced(module)
    assert calls == [1, 1] and not list(tmp_path.iterdir())


def test_an_unwritable_folder_costs_a_trace_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(cache.CACHE_ENV, str(blocker / "below"))  # a folder that cannot be made
    module = models()[1]
    assert cache.param_shapes(module) == traced(module)


CHOICE = r"""
import json, os, sys
import jax
setting = sys.argv[1]
if setting == "own-folder":
    jax.config.update("jax_compilation_cache_dir", sys.argv[2])
elif setting == "disabled":
    jax.config.update("jax_enable_compilation_cache", False)
import sdflax
pipeline, params = sdflax.StableDiffusion.from_pretrained(sys.argv[3])
if setting == "untouched":  # a run compiles and changes nothing either
    pipeline(pipeline.prepare_inputs(["a"]), params, jax.random.key(0), 1, height=16, width=16)
chosen = [jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache]
if setting != "untouched":
    sdflax.enable_compile_cache()
print(json.dumps([chosen, [jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache]]))
"""


@pytest.mark.parametrize("setting", ["untouched", "default", "own-folder", "disabled", "off"])
def test_the_compile_cache_is_the_processs_choice(tmp_path, setting):
    """Making and running a pipeline changes no JAX setting; `sdflax.enable_compile_cache()` points the cache at
    sdflax's folder unless the process chose a folder or turned the cache off (or SDFLAX_CACHE_DIR=off)."""
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           cache.CACHE_ENV: "off" if setting == "off" else str(tmp_path / "sdflax")}
    out = subprocess.run([sys.executable, "-c", CHOICE, setting, str(tmp_path / "mine"), str(TINY)], env=env,
                         capture_output=True, text=True, check=True)
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert tuple(before) == {"own-folder": (str(tmp_path / "mine"), True), "disabled": (None, False)}.get(
        setting, (None, True))  # as the process left it
    assert tuple(after) == {"untouched": (None, True), "default": (str(tmp_path / "sdflax"), True),
                            "own-folder": (str(tmp_path / "mine"), True), "disabled": (None, False),
                            "off": (None, True)}[setting]
