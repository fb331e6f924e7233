"""One runner for every pipeline: the jit, pmap and jit + NamedSharding programs of a pure
`fn(params, inputs: Inputs, settings: Settings) -> Output`, each built once and cached per static `Settings`.

pmap's and vmap's `in_axes` come from the structure of `Inputs` (its batched fields), never from a table of
argument positions, so a new input needs no change here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .generate import Inputs, Output
from .parallel import device_mesh, replicate_on, shard_batch


class Runner:
    def __init__(self, fn):
        self.fn = fn

    @functools.cached_property
    def jit(self):
        """One device: (B, ...) inputs, one key or one per image."""
        return jax.jit(self.fn, static_argnums=2)

    @functools.cached_property
    def pmap(self):
        """`jax.pmap` over the local devices: params `replicate`d, batched inputs `shard`ed (devices, B / devices,
        ...), one key per device or per image; shared inputs (scales, sizes) are broadcast."""
        return jax.pmap(self.fn, in_axes=(0, Inputs.axes(), None), static_broadcasted_argnums=2)

    @functools.cached_property
    def sharded(self):
        """jit over (B, ...) inputs split over a one-axis device mesh: each device runs `fn` on its rows with its
        own key (a vmap over a leading device axis), so the results equal the pmap path's. Keys arrive as
        (devices,) or (devices, B / devices); a trajectory comes back as (evals, B, ...)."""

        def run(params, inputs, settings):
            devices = inputs.prng_seed.shape[0]
            per_device = {name: jax.tree.map(lambda x: x.reshape(devices, -1, *x.shape[1:]), getattr(inputs, name))
                          for name in Inputs.batched_fields() if name != "prng_seed"}
            out = jax.vmap(lambda p, x: self.fn(p, x, settings), in_axes=(None, Inputs.axes()))(
                params, inputs.replace(**per_device))
            trajectory = jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:]),
                                      out.trajectory)
            return Output(out.images.reshape(-1, *out.images.shape[2:]), trajectory)

        return jax.jit(run, static_argnums=2)

    def run_sharded(self, params, inputs: Inputs, settings, mesh=None) -> Output:
        """Place the inputs on `mesh` (default: all local devices) and run the sharded program."""
        mesh = mesh or device_mesh()
        keys = inputs.prng_seed
        batch = _batch(inputs)
        if keys.shape[0] not in (mesh.size, batch):
            raise ValueError(f"prng_seed holds {keys.shape[0]} keys for {mesh.size} devices and {batch} images: use "
                             "jax.random.split(key, number_of_devices), or one key per image")
        if keys.shape[0] != mesh.size:  # one key per image: (devices, B / devices)
            keys = keys.reshape(mesh.size, -1, *keys.shape[1:])
        batched = {name: getattr(inputs, name) for name in Inputs.batched_fields() if name != "prng_seed"
                   and getattr(inputs, name) is not None}
        inputs = inputs.replace(**shard_batch(batched, mesh), prng_seed=shard_batch(keys, mesh))
        return self.sharded(replicate_on(params, mesh), inputs, settings)


def _batch(inputs) -> int:
    ids = inputs.prompt_ids if inputs.prompt_ids is not None else inputs.prompt_embeds
    return ids.shape[0]
