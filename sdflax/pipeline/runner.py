"""One runner for every pipeline: the jit, pmap and jit + NamedSharding programs of a pure
`fn(spec, params, inputs: Inputs, settings: Settings) -> Output`, each built once and cached per static `Spec` and
`Settings` (a new scheduler is a new spec: one more program, and the old one stays for when it comes back).

What is split over devices comes from the structure of `Inputs` (its batched fields, and its conditionings'),
never from a table of argument positions, so a new input needs no change here.
"""

from __future__ import annotations

import functools
import os

import jax
from jax.sharding import PartitionSpec as P

from ..parallel import device_mesh, replicate_on, shard_batch
from ..sampling import batch_split
from .types import Inputs, Output, by_field, map_batched


class Runner:
    def __init__(self, fn):
        # a function of this runner's own: jax keys its compiled programs on the function, and each runner's
        # programs (`jit._cache_size()`) are its own
        self.fn = lambda *args: fn(*args)
        self._sharded = {}  # mesh -> program

    @functools.cached_property
    def jit(self):
        """One device: (B, ...) inputs, one key or one per image."""
        return jax.jit(self.fn, static_argnums=(0, 3), compiler_options=compiler_options())

    @functools.cached_property
    def pmap(self):
        """`jax.pmap`'s calling convention over the local devices: params `replicate`d, batched inputs `shard`ed
        (devices, B / devices, ...), one key per device or per image; shared inputs (scales, sizes) are broadcast;
        outputs lead with the device axis. Built as jax.pmap is now, jit + shard_map, each device running `fn` on
        its slice without the device axis."""
        mesh = device_mesh()
        axis = mesh.axis_names[0]

        def run(spec, params, inputs, settings):
            def local(params, inputs):
                with batch_split(axis):
                    out = self.fn(spec, jax.tree.map(lambda x: x[0], params), map_batched(inputs, lambda x: x[0]),
                                  settings)
                return jax.tree.map(lambda x: x[None], out)

            in_specs = (P(axis), by_field(inputs, P(axis), P()))
            return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(axis), check_vma=False)(
                params, inputs)

        return jax.jit(run, static_argnums=(0, 3), compiler_options=compiler_options())

    def sharded(self, mesh):
        """jit over (B, ...) inputs split over a one-axis device mesh, each device running `fn` on its own rows
        with its own key (a `shard_map`: a device's program is the one-device program on B / devices rows, so an
        image does not depend on the mesh). Keys arrive as (devices,) or (devices, B / devices); a trajectory
        comes back as (evals, B, ...). One program per mesh and Settings."""
        if mesh not in self._sharded:
            axis = mesh.axis_names[0]
            out_specs = Output(P(axis), P(None, axis))  # images (B, ...), trajectory (evals, B, ...)

            def run(spec, params, inputs, settings):
                def local(params, inputs):  # this device's rows, and its key or its images' keys
                    with batch_split(axis):
                        return self.fn(spec, params, inputs.replace(prng_seed=inputs.prng_seed[0]), settings)

                in_specs = (P(), by_field(inputs, P(axis), P()))
                return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                     check_vma=False)(params, inputs)

            self._sharded[mesh] = jax.jit(run, static_argnums=(0, 3), compiler_options=compiler_options())
        return self._sharded[mesh]

    def run_sharded(self, spec, params, inputs: Inputs, settings, mesh=None) -> Output:
        """Place the inputs on `mesh` (default: all local devices) and run the sharded program."""
        mesh = mesh or device_mesh()
        keys = inputs.prng_seed
        batch = inputs.prompts().shape[0]
        if keys.ndim == 0:  # one key: it cannot be split into the devices' own here without choosing how
            raise ValueError(f"prng_seed is one key, but generate_sharded takes one per device or per image: "
                             f"jax.random.split(key, {mesh.size}) (devices) or jax.random.split(key, {batch}) "
                             "(images)")
        if keys.shape[0] not in (mesh.size, batch):
            raise ValueError(f"prng_seed holds {keys.shape[0]} keys for {mesh.size} devices and {batch} images: use "
                             "jax.random.split(key, number_of_devices), or one key per image")
        if keys.shape[0] != mesh.size:  # one key per image: (devices, B / devices)
            keys = keys.reshape(mesh.size, -1, *keys.shape[1:])
        inputs = map_batched(inputs, lambda x: shard_batch(x, mesh), skip=("prng_seed",))
        inputs = inputs.replace(prng_seed=shard_batch(keys, mesh))
        return self.sharded(mesh)(spec, replicate_on(params, mesh), inputs, settings)


# XLA's CPU hands dots, reductions and convolutions to the YNNPACK library by default. Its convolutions fault in fresh
# memory for their buffers on every call and set themselves up on a program's first run; XLA's own are faster in
# the pipelines (docs/performance.md, "What pays on this CPU"). These are the default's other types.
CPU_YNN_FUSION_TYPES = "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"


@functools.cache
def compiler_options() -> dict | None:
    """XLA options for the pipeline programs. On the CPU: LLVM's optimisation level 1 instead of 3 (the programs'
    time goes to library convolutions and matmuls, which it does not touch, so compiling is shorter and sampling
    is not slower), and convolutions left to XLA (`CPU_YNN_FUSION_TYPES`) where this jaxlib has the option. An
    option the user's XLA_FLAGS set is left to them (e.g. docs/batch.md, "One image, any batch")."""
    if jax.default_backend() != "cpu":
        return None
    options = {"xla_backend_optimization_level": 1, "xla_cpu_experimental_ynn_fusion_type": CPU_YNN_FUSION_TYPES}
    options = {name: value for name, value in options.items() if f"--{name}=" not in os.environ.get("XLA_FLAGS", "")}
    if "xla_cpu_experimental_ynn_fusion_type" in options:
        try:  # an experimental option: another jaxlib may name it or its values otherwise
            jax.jit(lambda x: x, compiler_options=options).lower(0.0).compile()
        except jax.errors.JaxRuntimeError:
            del options["xla_cpu_experimental_ynn_fusion_type"]
    return options or None
