"""Spreading work over the local devices: `replicate` / `shard` / `unshard` for `jax.pmap`, and a `jit` +
`NamedSharding` path that splits the batch over a one-axis device mesh.

Both are built on current JAX calls: arrays are placed with `NamedSharding` over a `("devices",)` mesh, which is
what `jax.pmap` (now `jit` + `shard_map` inside) consumes without copying.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "devices"


def device_mesh(devices=None) -> Mesh:
    """A one-axis mesh over `devices` (default: all local devices)."""
    return Mesh(np.asarray(devices or jax.local_devices()), (AXIS,))


def _split_leading(x, mesh: Mesh):
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec(AXIS)))


def replicate(tree, devices=None):
    """Give every leaf a leading device axis holding one copy per device (what `jax.pmap` expects of params)."""
    mesh = device_mesh(devices)
    sharding = NamedSharding(mesh, PartitionSpec(AXIS))

    def copy(x):
        x = jax.numpy.asarray(x)
        return jax.make_array_from_single_device_arrays(
            (mesh.size, *x.shape), sharding, [_with_leading_axis(x, d) for d in mesh.devices.flat]
        )

    return jax.tree.map(copy, tree)


def _with_leading_axis(x: jax.Array, device):
    """x[None] on `device`. A CPU array already there becomes a view of its own buffer (CPU buffers are host memory,
    and numpy views and `device_put` of aligned host arrays share it), so that replicating gigabytes of params on
    one CPU device copies nothing; elsewhere a copy."""
    if device.platform == "cpu" and x.devices() == {device}:
        return jax.device_put(np.asarray(x)[None], device)
    return jax.device_put(x[None], device)


def shard(tree, devices=None):
    """Split the leading (batch) axis of every leaf over the devices: (B, ...) -> (devices, B / devices, ...).

    PRNG keys are split, not sharded: use `jax.random.split(key, jax.local_device_count())`.
    """
    mesh = device_mesh(devices)

    def split(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.shape[0] % mesh.size:
            raise ValueError(f"a batch of {x.shape[0]} does not split over {mesh.size} devices: "
                             f"use a multiple of {mesh.size}")
        return _split_leading(x.reshape(mesh.size, x.shape[0] // mesh.size, *x.shape[1:]), mesh)

    return jax.tree.map(split, tree)


def unshard(tree):
    """(devices, B, ...) -> (devices * B, ...)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), tree)


def shard_batch(tree, mesh: Mesh):
    """Place (B, ...) leaves so that the batch axis is split over `mesh` (the `jit` + sharding path)."""
    def place(x):
        if x.shape[0] % mesh.size:
            raise ValueError(f"a batch of {x.shape[0]} does not split over {mesh.size} devices: "
                             f"use a multiple of {mesh.size}")
        return _split_leading(x, mesh)

    return jax.tree.map(place, tree)


def replicate_on(tree, mesh: Mesh):
    """Every device holds the whole of each leaf (params for the `jit` + sharding path)."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))
