"""T2I-Adapter (Mou et al. 2023): light control from a sketch, depth or pose picture, as diffusers' adapter pipelines.

`T2IAdapters` is a UNet wrapper (a `Spec`'s `wrappers`): the adapters run once per call on their pictures, their
features (times `adapter_conditioning_scale`, summed over several adapters as diffusers' MultiAdapter does) enter
every UNet evaluation as `down_intrablock_additional_residuals` while the evaluation index is below
int(num_inference_steps × `adapter_conditioning_factor`) (SDXL's; 1 elsewhere). Their params are `params["adapter"]`,
a list for several adapters.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..models import combine_adapter_states
from .controlnet import as_nets


@dataclasses.dataclass(frozen=True)
class T2IAdapters:
    nets: tuple

    params_name = "adapter"
    picture = "adapter_image"
    component = "adapters"  # the Pipeline attribute it is built from

    def wrap(self, params, inputs, settings, cond, start):
        nets_params, images = as_nets(params["adapter"]), as_nets(inputs.adapter_image)
        scales = jnp.broadcast_to(jnp.asarray(inputs.adapter_conditioning_scale, jnp.float32), (len(self.nets),))
        states = [net.apply(p, image.astype(net.dtype)) for net, p, image in zip(self.nets, nets_params, images)]
        if len(states) == 1:
            features = [f * scales[0].astype(f.dtype) for f in states[0]]
        else:
            features = combine_adapter_states(states, scales)
        last = settings.num_inference_steps if inputs.adapter_evaluations is None else inputs.adapter_evaluations

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
