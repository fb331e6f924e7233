"""Every pipeline in every mode: jit=False, jit=True (pmap) on 2 simulated devices, and generate_sharded give the
same images and trajectories, with every feature (rescaled or custom guidance, trajectories, callbacks, text
embeddings, given noise, one key per image), and changing traced values never recompiles.

The runs happen in one subprocess (tests/run_modes_worker.py) with 2 CPU devices; this file compares."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from builders import REPO, torch_pipeline, torch_xl_pipeline
from compile_flags import xla_flags

KINDS = ("sd", "img2img", "inpaint", "xl")
MODES = ("call", "pmap", "sharded")
DEVICES, BATCH = 2, 2
ATOL = 1e-5  # images in [0, 1]: the same float32 computation, batched differently
# Trajectories hold σ-scaled latents (|x| up to ~15) and x̂₀ = (x - σ ε̂) / α: batch 1 and batch 2 matmuls round
# differently, and the samplers carry that at the scale of the largest values, so the tolerance is relative to it.
TRAJECTORY_TOL = 1e-5  # times the trajectory's largest |value|


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("modes")
    torch_pipeline("sd1", "ddim").save_pretrained(folder / "sd")
    torch_xl_pipeline("euler").save_pretrained(folder / "xl")
    env = {**os.environ, "XLA_FLAGS": xla_flags(DEVICES), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "run_modes_worker.py"), str(folder)], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(folder / "results.npz")), json.loads((folder / "results.json").read_text())


def as_call(x, mode):
    """pmap's (devices, ..., B / devices, ...) -> jit=False's layout: images (B, ...), trajectories (evals, B, ...)."""
    if mode != "pmap":
        return x
    if x.ndim == 5:  # images (devices, B / devices, H, W, 3)
        return x.reshape(-1, *x.shape[2:])
    return np.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])  # (devices, evals, B / devices, C, h, w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("setting", ["rescale", "custom"])
def test_modes_give_the_same_images(results, kind, setting):
    arrays, _ = results
    call = arrays[f"{kind}/{setting}/call/images"]
    assert call.shape[0] == BATCH and call.std() > 0.05  # not blank: equality means something
    assert arrays[f"{kind}/{setting}/pmap/images"].shape[:2] == (DEVICES, BATCH // DEVICES)
    for mode in ("pmap", "sharded"):
        np.testing.assert_allclose(as_call(arrays[f"{kind}/{setting}/{mode}/images"], mode), call, rtol=0, atol=ATOL)


@pytest.mark.parametrize("kind", KINDS)
def test_the_setting_under_test_changes_the_images(results, kind):
    arrays, _ = results
    assert np.abs(arrays[f"{kind}/rescale/call/images"] - arrays[f"{kind}/custom/call/images"]).max() > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_trajectories_have_the_documented_shapes_and_agree(results, kind):
    arrays, report = results
    evals = len(report[f"{kind}/custom/call"]["callback_steps"])
    for field in ("latents", "pred_x0"):
        call = arrays[f"{kind}/rescale/call/{field}"]
        assert call.shape[:2] == (evals, BATCH)  # (evals, B, C, h, w)
        pmapped = arrays[f"{kind}/rescale/pmap/{field}"]
        assert pmapped.shape[:3] == (DEVICES, evals, BATCH // DEVICES)  # (devices, evals, B / devices, C, h, w)
        assert arrays[f"{kind}/rescale/sharded/{field}"].shape == call.shape
        for mode in ("pmap", "sharded"):
            np.testing.assert_allclose(as_call(arrays[f"{kind}/rescale/{mode}/{field}"], mode), call, rtol=0,
                                       atol=TRAJECTORY_TOL * np.abs(call).max())
    latents = arrays[f"{kind}/rescale/call/latents"]
    assert np.abs(latents[0] - latents[-1]).max() > 1e-2  # the sampler moved: the comparison means something


@pytest.mark.parametrize("kind", KINDS)
def test_callbacks_run_every_step_in_every_mode(results, kind):
    _, report = results
    call = report[f"{kind}/custom/call"]
    evals = len(call["callback_steps"])
    assert evals >= 2 and call["callback_steps"] == list(range(evals))
    assert call["callback_calls"] == evals and [s[0] for s in call["callback_shapes"]] == [BATCH]
    for mode in ("pmap", "sharded"):  # once per device and step, each with the device's rows
        seen = report[f"{kind}/custom/{mode}"]
        assert seen["callback_steps"] == call["callback_steps"] and seen["callback_calls"] == DEVICES * evals
        assert [s[0] for s in seen["callback_shapes"]] == [BATCH // DEVICES]


@pytest.mark.parametrize("kind", KINDS)
def test_one_compile_per_static_setting_in_every_mode(results, kind):
    _, report = results
    for setting in ("rescale", "custom"):
        for mode in MODES:
            assert report[f"{kind}/{setting}/{mode}"]["recompiles"] == 0, (setting, mode)
    assert report[f"{kind}/jit_programs"] == 2  # one per setting
