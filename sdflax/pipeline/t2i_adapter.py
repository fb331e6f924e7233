"""T2I-Adapter (Mou et al. 2023): light control from a sketch, depth or pose picture, as diffusers' adapter pipelines.

`T2IAdapters` is a UNet wrapper (a `Spec`'s `wrappers`): the adapters run once per call on their pictures, their
features (times `adapter_conditioning_scale`, summed over several adapters as diffusers' MultiAdapter does) enter
every UNet evaluation as `down_intrablock_additional_residuals` while the evaluation index is below
int(num_inference_steps × `adapter_conditioning_factor`) (SDXL's; 1 elsewhere). Their params are `params["adapter"]`,
a list for several adapters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp

from ..models import combine_adapter_states
from .controlnet import as_nets
from .types import batched, float32_array


@flax.struct.dataclass
class AdapterInputs:
    """A call's T2I-Adapter inputs (`Inputs.conditions["adapter"]`)."""

    image: Any = batched()  # (B, C, H, W) in [0, 1], or a tuple of them, one per adapter
    scale: Any = None  # adapter_conditioning_scale: a value, or one per adapter
    # how many evaluations the features enter (SDXL's adapter_conditioning_factor, counted as diffusers counts:
    # `evaluations`)
    evaluations: Any = None


@dataclasses.dataclass(frozen=True)
class T2IAdapters:
    nets: tuple

    params_name = "adapter"
    picture = "adapter_image"

    @classmethod
    def build(cls, parts, vae, denoiser) -> "T2IAdapters":
        """The piece for a pipeline's components (`parts`), as ControlNet's."""
        return cls(tuple(parts.adapter or ()))

    def call_inputs(self, args: dict, settings, batch, leading_dims) -> AdapterInputs:
        factor = args.get("adapter_conditioning_factor")
        return AdapterInputs(jax.tree.map(float32_array, args["adapter_image"]),
                             jnp.asarray(args.get("adapter_conditioning_scale", 1.0), jnp.float32),
                             None if factor is None else evaluations(settings.num_inference_steps, factor))

    def wrap(self, params, inputs, settings, cond, start):
        given = inputs.condition(self.params_name)
        nets_params, images = as_nets(params["adapter"]), as_nets(given.image)
        scales = jnp.broadcast_to(given.scale, (len(self.nets),))
        states = [net.apply(p, image.astype(net.dtype)) for net, p, image in zip(self.nets, nets_params, images)]
        if len(states) == 1:
            features = [f * scales[0].astype(f.dtype) for f in states[0]]
        else:
            features = combine_adapter_states(states, scales)
        last = settings.num_inference_steps if given.evaluations is None else given.evaluations

        def wrapper(unet_fn):
            def adapted(x, t, context, step, **residuals):
                on = (step < last).astype(features[0].dtype)
                rows = x.shape[0] // features[0].shape[0]  # [uncond; cond] chunks
                given = [jnp.tile(f, (rows, 1, 1, 1)) * on for f in features]
                return unet_fn(x, t, context, step, down_intrablock_additional_residuals=given, **residuals)

            return adapted

        return wrapper


def evaluations(num_inference_steps: int, factor):
    """diffusers' count of the evaluations that get the features, int(num_inference_steps × factor): in Python's
    float64 for a number (float32 would make int(10 × 0.7) 6), traced otherwise (inside a caller's jit)."""
    if isinstance(factor, (int, float)):
        return jnp.asarray(int(num_inference_steps * factor), jnp.int32)
    return jnp.floor(num_inference_steps * jnp.asarray(factor, jnp.float32)).astype(jnp.int32)
