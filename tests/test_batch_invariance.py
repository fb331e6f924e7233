"""An image does not depend on the batch or the devices it is made on: with one key per image, image b made alone,
in a batch of four, under pmap on 2 and 4 simulated devices and under generate_sharded is the same bit for bit,
with a stochastic sampler (Euler ancestral: fresh noise at every step, image b's from key b).

On XLA's CPU backend this needs its reductions kept out of YNNPACK (docs/batch.md, "One image, any batch"): the flag is
set for the subprocesses that make the images (tests/batch_invariance_worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from builders import REPO

BATCH_INVARIANT_FLAG = "--xla_cpu_experimental_ynn_fusion_type=individual_dot,individual_convolution"


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("invariance")
    out = {}
    for devices in (2, 4):
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {BATCH_INVARIANT_FLAG}"}
        done = subprocess.run([sys.executable, str(REPO / "tests" / "batch_invariance_worker.py"),
                               str(tmp / f"{devices}.npz")], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        out.update({f"{name}/{devices}": x for name, x in np.load(tmp / f"{devices}.npz").items()})
    return out


@pytest.mark.parametrize("run", ["batch/2", "pmap/2", "sharded/2", "batch/4", "pmap/4", "sharded/4"])
def test_image_b_is_the_same_alone_in_a_batch_and_on_any_devices(images, run):
    alone = images["alone/2"]
    assert alone.std() > 0.05 and np.abs(alone[0] - alone[1]).max() > 0.05  # real images, each its own
    np.testing.assert_array_equal(images[run], alone)
