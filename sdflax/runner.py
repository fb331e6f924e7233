"""One runner for every pipeline: the jit, pmap and jit + NamedSharding programs of a pure
`fn(params, inputs: Inputs, settings: Settings) -> Output`, each built once and cached per static `Settings`.

pmap's and vmap's `in_axes` come from the structure of `Inputs` (its batched fields), never from a table of
argument positions, so a new input needs no change here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from .cache import enable_compile_cache
from .generate import Inputs, Output
from .parallel import device_mesh, replicate_on, shard_batch


class Runner:
    def __init__(self, fn):
        self.fn = fn
        self._sharded = {}  # mesh -> program
        enable_compile_cache()  # a second process loads the programs this one compiles

    @functools.cached_property
    def jit(self):
        """One device: (B, ...) inputs, one key or one per image."""
        return jax.jit(self.fn, static_argnums=2)

    @functools.cached_property
    def pmap(self):
        """`jax.pmap` over the local devices: params `replicate`d, batched inputs `shard`ed (devices, B / devices,
        ...), one key per device or per image; shared inputs (scales, sizes) are broadcast."""
        return jax.pmap(self.fn, in_axes=(0, Inputs.axes(), None), static_broadcasted_argnums=2)

    def sharded(self, mesh):
        """jit over (B, ...) inputs split over a one-axis device mesh, each device running `fn` on its own rows
        with its own key (a `shard_map`: a device's program is the one-device program on B / devices rows, so an
        image does not depend on the mesh). Keys arrive as (devices,) or (devices, B / devices); a trajectory
        comes back as (evals, B, ...). One program per mesh and Settings."""
        if mesh not in self._sharded:
            axis = mesh.axis_names[0]
            in_specs = (P(), Inputs(**{f.name: P(axis) if f.metadata.get("batched") else P()
                                       for f in dataclasses.fields(Inputs)}))
            out_specs = Output(P(axis), P(None, axis))  # images (B, ...), trajectory (evals, B, ...)

            def run(params, inputs, settings):
                def local(params, inputs):  # this device's rows, and its key or its images' keys
                    return self.fn(params, inputs.replace(prng_seed=inputs.prng_seed[0]), settings)

                return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                     check_vma=False)(params, inputs)

            self._sharded[mesh] = jax.jit(run, static_argnums=2)
        return self._sharded[mesh]

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
        return self.sharded(mesh)(replicate_on(params, mesh), inputs, settings)


def _batch(inputs) -> int:
    ids = inputs.prompt_ids if inputs.prompt_ids is not None else inputs.prompt_embeds
    return ids.shape[0]
