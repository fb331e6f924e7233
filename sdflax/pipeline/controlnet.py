"""ControlNet (Zhang et al. 2023): steer the UNet with residuals that ControlNets compute from a control image
(edges, pose, depth), as diffusers' ControlNet pipelines do.

`ControlNet` is a UNet wrapper (a `Spec`'s `wrappers`): at every evaluation each net sees the latents, the timestep,
the text states and its control image, and the sum of their residuals, each times its scale while the step is
inside its guidance window, is added to the UNet's skip connections and mid block.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp

from ..models import ControlNetModel
from .types import batched, float32_array


@flax.struct.dataclass
class ControlInputs:
    """A call's ControlNet inputs (`Inputs.conditions["controlnet"]`)."""

    image: Any = batched()  # (B, C, H, W) in [0, 1], or a tuple of them, one per net
    scale: Any = None  # controlnet_conditioning_scale: a value, or one per net
    start: Any = None  # control_guidance_start / _end: the fraction of the steps each net acts in
    end: Any = None


def as_nets(value) -> tuple:
    """One ControlNet (or its params, or its control image) or several -> a tuple."""
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


@dataclasses.dataclass(frozen=True)
class ControlNet:
    """The residuals of one or several ControlNets, added to the UNet's (diffusers' MultiControlNetModel sums);
    their params are `params["controlnet"]`, a list for several nets."""

    nets: tuple

    # what this wrapper adds to a pipeline: its params, its picture input, and the arguments of its calls
    params_name = "controlnet"
    picture = "control_image"
    net_class = ControlNetModel  # what the pipeline's controlnet= takes
    net_needs = "a ControlNetModel (or a list of them) from ControlNetModel.from_pretrained"

    @classmethod
    def build(cls, parts, vae, denoiser) -> "ControlNet":
        """The piece for a pipeline's components (`parts`), its VAE piece and its denoiser."""
        return cls(tuple(parts.controlnet or ()))

    def pixel_size(self, picture) -> tuple:
        """(H, W) in pixels of a control picture as the call gives it."""
        return tuple(picture.shape[-2:])

    def check_images(self, spec, given, leading_dims, batch):
        """The call's control images against the nets and the denoiser."""
        check_control_images(tuple(net.config.conditioning_channels for net in self.nets), given, leading_dims, batch)
        check_controlnets(self.nets, spec.denoiser.model, spec.vae.scale_factor)

    def call_inputs(self, args: dict, settings, batch, leading_dims) -> ControlInputs:
        number = lambda name: jnp.asarray(args[name], jnp.float32)  # noqa: E731
        return ControlInputs(jax.tree.map(float32_array, args["control_image"]),
                             number("controlnet_conditioning_scale"), number("control_guidance_start"),
                             number("control_guidance_end"))

    def wrap(self, params, inputs, settings, cond, start):
        net_params = as_nets(params["controlnet"])
        given = inputs.condition(self.params_name)
        images = as_nets(given.image)
        scale_at = window_scales(given, len(self.nets), start.state.timesteps.shape[0])

        def wrapper(unet_fn):
            def controlled(x, t, context, step, **residuals):
                # guess mode: only the conditional half sees the nets; the unconditional half gets zero residuals
                half = settings.guess_mode and settings.classifier_free_guidance
                x_c, context_c = (jnp.split(x, 2)[1], jnp.split(context, 2)[1]) if half else (x, context)
                extra = {name: jnp.split(v, 2)[1] if half else v for name, v in cond.unet_kwargs.items()}
                down, mid = None, None
                scales = scale_at(step)
                for k, (net, p, image) in enumerate(zip(self.nets, net_params, images)):
                    image = jnp.tile(image, (x_c.shape[0] // image.shape[0], 1, 1, 1))  # [uncond; cond] rows
                    d, m = net.apply(p, x_c, t, context_c, image.astype(net.dtype), scales[k], guess_mode=half,
                                     **extra)
                    down = d if down is None else tuple(a + b for a, b in zip(down, d))
                    mid = m if mid is None else mid + m
                if half:
                    down = tuple(jnp.concatenate([jnp.zeros_like(d), d]) for d in down)
                    mid = jnp.concatenate([jnp.zeros_like(mid), mid])
                return unet_fn(x, t, context, step, down_block_additional_residuals=down,
                               mid_block_additional_residual=mid, **residuals)

            return controlled

        return wrapper


def window_scales(given: ControlInputs, count: int, num_evals: int):
    """step -> each net's scale (count,) at evaluation `step`: its conditioning scale inside its guidance window, 0
    outside (diffusers' rule: net k acts at evaluation i unless i/n < start_k or (i+1)/n > end_k)."""
    scales, starts, ends = (jnp.broadcast_to(x, (count,)) for x in (given.scale, given.start, given.end))

    def at(step):
        outside = (step / num_evals < starts) | ((step + 1) / num_evals > ends)
        return scales * (1.0 - outside.astype(jnp.float32))

    return at


# ---- checks -----------------------------------------------------------------------------------------------------

def check_control_images(channels: tuple, given, leading_dims, batch):
    """The control images against the nets: one (batch) per net, of its picture `channels` and one size."""
    images = as_nets(given)
    if len(images) != len(channels):
        raise ValueError(f"{len(images)} control images for {len(channels)} ControlNets: give one image (batch) per "
                         "net, in the order of the nets")
    size = None
    for k, (channels, image) in enumerate(zip(channels, images)):
        name = f"control image {k}" if len(images) > 1 else "the control image"
        if image.ndim != leading_dims + 3 or image.shape[-3] != channels:
            expected = ("(devices, B, " if leading_dims == 2 else "(B, ") + f"{channels}, H, W)"
            sharded = " and shard()" if leading_dims == 2 else ""
            raise ValueError(f"{name} has shape {image.shape}; expected {expected}: make it with "
                             f"pipeline.prepare_image_inputs(images){sharded}")
        if image.shape[:leading_dims] != batch:
            raise ValueError(f"{name} has shape {image.shape} for a batch of {batch}: give one control image "
                             "per prompt")
        if size is not None and image.shape[-2:] != size:
            raise ValueError(f"{name} is {image.shape[-1]}x{image.shape[-2]}, the first {size[1]}x{size[0]}: "
                             "give control images of one size")
        size = image.shape[-2:]


def check_controlnets(nets, unet, vae_scale_factor):
    """ControlNets of the UNet's family, whose condition encoders bring a picture to the VAE's latent size."""
    for net in nets:
        if net.config.addition_embed_type != unet.config.addition_embed_type or (
                net.config.cross_attention_dim != unet.config.cross_attention_dim):
            raise ValueError("a ControlNet of another model family than the pipeline's UNet (cross-attention "
                             f"dim {net.config.cross_attention_dim} vs {unet.config.cross_attention_dim}, "
                             f"addition_embed_type {net.config.addition_embed_type!r} vs "
                             f"{unet.config.addition_embed_type!r}): use a ControlNet trained for this base model")
        if net.config.condition_scale != vae_scale_factor:
            raise ValueError(condition_scale_mismatch(net.config, vae_scale_factor))


def condition_scale_mismatch(config, vae_scale_factor) -> str:
    return (f"a ControlNet whose condition encoder makes 1/{config.condition_scale} of the picture's size ("
            f"{len(config.conditioning_embedding_out_channels)} conditioning_embedding_out_channels), but the VAE's "
            f"latents are 1/{vae_scale_factor} of it: use a ControlNet trained for this base model")
