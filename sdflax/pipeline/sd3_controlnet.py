"""SD 3.x ControlNets as diffusers' StableDiffusion3ControlNetPipeline and StableDiffusion3ControlNetInpaintingPipeline
run them: the control picture goes through the VAE to latents, the nets (`models.SD3ControlNetModel`) read them with
the latents, and the sum of their block samples, each net's times its scale inside its guidance window, is added to
the transformer's image tokens (`block_controlnet_hidden_states`).

The control latents are the VAE posterior's mean: diffusers draws a posterior sample from torch's global generator,
not from the call's `generator`, so no seed reproduces its draw; the mean keeps an image a function of its seed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax.numpy as jnp

from ..models.sd3_controlnet import SD3ControlNetModel
from .controlnet import ControlInputs, ControlNet, as_nets, check_control_images, window_scales
from .types import batched, float32_array


@flax.struct.dataclass
class SD3ControlInputs(ControlInputs):
    """ControlInputs and `controlnet_pooled_projections` (B, P): the nets' pooled input in place of the prompt's."""

    pooled: Any = batched()


@dataclasses.dataclass(frozen=True)
class SD3ControlNet(ControlNet):
    """SD 3.x ControlNets (diffusers' SD3ControlNetModel, several summed as SD3MultiControlNetModel) steering the
    transformer; `params["controlnet"]` as for the UNet's nets. `vae` encodes the control pictures, `transformer`
    lends its patch embedding to nets without their own (SD 3.5 Large's)."""

    vae: Any = None  # pipeline.vae.VAE
    transformer: Any = None  # models.SD3Transformer2DModel

    net_class = SD3ControlNetModel
    net_needs = "an SD3ControlNetModel (or a list of them) from SD3ControlNetModel.from_pretrained"
    extra_channels = 0  # the control latents' channels beyond the VAE's

    @classmethod
    def build(cls, parts, vae, denoiser) -> "SD3ControlNet":
        piece = cls(tuple(parts.controlnet or ()), vae, denoiser.model)
        piece.check_nets()
        return piece

    @classmethod
    def config_problem(cls, net, transformer, vae) -> str | None:
        """What does not fit in the configs of a net, the transformer and the VAE (the command line's check)."""
        return mismatch(net, transformer, vae.latent_channels, cls.extra_channels)

    @property
    def takes_given_pooled(self) -> bool:
        """Whether `controlnet_pooled_projections` reaches the nets (diffusers gives InstantX's nets zeros)."""
        return not self.zeros_for_pooled

    @property
    def zeros_for_pooled(self) -> bool:
        """InstantX's nets see zeros as their pooled input and unshifted control latents (diffusers' pipeline reads
        the first net's config for every net; mixed nets are refused)."""
        return self.nets[0].config.force_zeros_for_pooled_projection

    def check_nets(self):
        """Each net fits the transformer and the VAE (`mismatch`); the nets are of one kind."""
        for k, net in enumerate(self.nets):
            cfg, name = net.config, f"ControlNet {k}" if len(self.nets) > 1 else "the ControlNet"
            problem = mismatch(cfg, self.transformer.config, self.vae.latent_channels, self.extra_channels)
            if problem:
                raise ValueError(f"{name} {problem}")
            if cfg.force_zeros_for_pooled_projection != self.nets[0].config.force_zeros_for_pooled_projection:
                raise ValueError("ControlNets of both kinds, InstantX's (force_zeros_for_pooled_projection) and "
                                 "Stability's: diffusers encodes every control image by the first net's rule; give "
                                 "nets of one kind")

    def call_inputs(self, args: dict, settings, batch, leading_dims) -> SD3ControlInputs:
        given = super().call_inputs({**args, "control_image": args.get("control_image")}, settings, batch,
                                    leading_dims)
        pooled = args.get("controlnet_pooled_projections")
        if pooled is not None:
            pooled = float32_array(pooled)
            width = self.transformer.config.pooled_projection_dim
            if leading_dims is not None and tuple(pooled.shape) != (*batch, width):
                raise ValueError(f"controlnet_pooled_projections has shape {pooled.shape}; expected "
                                 f"{(*batch, width)}: one pooled embedding per image")
            if not self.takes_given_pooled:
                raise ValueError("controlnet_pooled_projections: these ControlNets (force_zeros_for_pooled_projection, "
                                 "InstantX's) see zeros there, as diffusers gives them: leave it out")
        return SD3ControlInputs(given.image, given.scale, given.start, given.end, pooled)

    def check_images(self, spec, given, leading_dims, batch):
        check_control_images((3,) * len(self.nets), given, leading_dims, batch)

    def control_latents(self, params, inputs, given) -> tuple:
        """Each net's control latents (B, C, h, w)."""
        shift = self.vae.shift * self.vae.vae.config.scaling_factor if self.zeros_for_pooled else 0.0
        return tuple(self.encode(params, image * 2 - 1) + shift for image in as_nets(given.image))

    def encode(self, params, image):
        """Latents of pictures (B, 3, H, W) in [-1, 1]: the posterior's mean, shifted and scaled."""
        f = self.vae.scale_factor
        mean = jnp.zeros((image.shape[0], self.vae.latent_channels, image.shape[2] // f, image.shape[3] // f))
        return self.vae.encode(params, image, mean)

    def pooled_input(self, given, pooled):
        """The nets' pooled input for the denoiser's rows, whose pooled text embedding is `pooled`."""
        if given.pooled is not None:
            return jnp.tile(given.pooled, (pooled.shape[0] // given.pooled.shape[0], 1)).astype(pooled.dtype)
        return jnp.zeros_like(pooled) if self.zeros_for_pooled else pooled

    def wrap(self, params, inputs, settings, cond, start):
        net_params = as_nets(params["controlnet"])
        given = inputs.condition(self.params_name)
        controls = self.control_latents(params, inputs, given)
        scale_at = window_scales(given, len(self.nets), start.state.timesteps.shape[0])

        def wrapper(unet_fn):
            def controlled(x, t, context, step, **extra):
                pooled = self.pooled_input(given, extra.get("pooled_projections",
                                                            cond.unet_kwargs["pooled_projections"]))
                scales, samples = scale_at(step), None
                for k, (net, p, control) in enumerate(zip(self.nets, net_params, controls)):
                    control = jnp.tile(control, (x.shape[0] // control.shape[0], 1, 1, 1))  # [uncond; cond] rows
                    hidden = x if net.config.use_pos_embed else self.transformer_patches(params, x)
                    text = context if net.config.joint_attention_dim is not None else None
                    s = net.apply(p, hidden.astype(net.dtype), control.astype(net.dtype), scales[k], text, pooled, t)
                    samples = s if samples is None else tuple(a + b for a, b in zip(samples, s))  # zip: as diffusers
                return unet_fn(x, t, context, step, block_controlnet_hidden_states=samples, **extra)

            return controlled

        return wrapper

    def transformer_patches(self, params, x):
        """The transformer's patch embedding of latents (B, C, H, W) -> (B, N, D), with its params."""
        return self.transformer.patch_embed().apply({"params": params["transformer"]["pos_embed"]},
                                                    jnp.transpose(x, (0, 2, 3, 1)).astype(self.transformer.dtype))


@dataclasses.dataclass(frozen=True)
class SD3ControlNetInpaint(SD3ControlNet):
    """Alimama's inpainting ControlNet: its control latents are the VAE latents of the picture with the repainted
    pixels set to -1, then 1 - the mask at latent size (17 channels); the latents start from noise, nothing is
    pasted back, and the pooled input is zeros unless `controlnet_pooled_projections` is given, as diffusers'."""

    picture = None  # it reads the pipeline's image and mask (the start's pictures, checked as every pipeline's)
    extra_channels = 1
    zeros_for_pooled = True  # (without controlnet_pooled_projections), whatever the nets' configs say
    takes_given_pooled = True

    def control_latents(self, params, inputs, given) -> tuple:
        repainted = (jnp.asarray(inputs.mask, jnp.float32) >= 0.5).astype(jnp.float32)  # binarised, as diffusers
        latents = self.encode(params, jnp.where(repainted == 1, -1.0, jnp.asarray(inputs.image, jnp.float32)))
        f = self.vae.scale_factor
        control = jnp.concatenate([latents, 1 - repainted[:, :, ::f, ::f]], axis=1)  # nearest, as torch's
        return (control,) * len(self.nets)


def mismatch(net, transformer, latent_channels: int, extra_channels: int = 0) -> str | None:
    """Why a net's config (SD3ControlNetConfig) does not fit a transformer's config and control latents of the VAE's
    channels and `extra_channels` (the inpainting net's mask), or None."""
    channels = latent_channels + extra_channels
    mine = (net.inner_dim, net.patch_size, net.pooled_projection_dim, net.joint_attention_dim or
            transformer.joint_attention_dim)
    theirs = (transformer.inner_dim, transformer.patch_size, transformer.pooled_projection_dim,
              transformer.joint_attention_dim)
    if mine != theirs:
        return (f"(token width, patch, pooled width, text width {mine}) was made for another transformer than the "
                f"checkpoint's {theirs}: use a ControlNet trained for this base model")
    if net.control_channels != channels:
        inpainting = net.extra_conditioning_channels != extra_channels
        fix = ("StableDiffusion3ControlNetInpaint is for inpainting ControlNets (extra_conditioning_channels=1), "
               "StableDiffusion3ControlNet for the others" if inpainting else "use a ControlNet made for this VAE")
        return f"reads {net.control_channels} control latent channels, this pipeline gives {channels}: {fix}"
    return None
