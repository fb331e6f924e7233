"""Flux.1's ControlNets and Flux Control (Black Forest Labs' Canny and Depth dev), as diffusers'
FluxControlNet* and FluxControlPipeline run them.

`FluxControlNets` is a denoiser wrapper, as `pipeline/controlnet.py`'s for UNets: the control pictures go through the
VAE once (XLabs' nets read the pictures themselves), and at every evaluation each net reads the packed latents, the
prompt, the timestep and its picture's tokens; their residuals, each times its scale inside its guidance window,
are added after the transformer's blocks. Under true CFG the nets see the prompt's rows only and the negative's
rows take the same residuals, as diffusers. A Union net reads each of several pictures with its own mode.

`ControlLatents` is Flux Control's conditioning: its transformer takes the control picture's latents beside the
latents on its channels (128 features per token), as Fill takes the masked image's, whatever the start (noise, an
image, an image and a mask); the control picture is given as the ControlNets' is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from ..pipeline.checks import check_picture_values
from ..models.flux_controlnet import FluxControlNetModel
from ..pipeline.controlnet import ControlInputs, ControlNet, as_nets, window_scales
from ..pipeline.starts import FromImageMask, with_channels
from ..pipeline.types import batched, float32_array, random_draws
from .flux_text import image_ids, pack, text_ids

CONTROL_DRAWS = 1  # folded into the call's key for the control pictures' VAE posterior samples


def control_draws(prng_seed, shape, count):
    """`count` standard-normal arrays of `shape` for the control pictures' posterior samples, from the call's key
    (or one key per image) folded with CONTROL_DRAWS: apart from the start's draws, as image b's alone."""
    typed = jnp.issubdtype(prng_seed.dtype, jax.dtypes.prng_key)
    fold = functools.partial(jax.random.fold_in, data=CONTROL_DRAWS)
    keys = fold(prng_seed) if prng_seed.ndim == (0 if typed else 1) else jax.vmap(fold)(prng_seed)
    return random_draws(keys, shape, count)[0]


def encode_picture(vae, params, picture, eps):
    """A control picture (B, 3, H, W) in [0, 1] -> its VAE latents (B, C, H/f, W/f), or latents given as they are."""
    if vae.is_latent_image(picture):
        return picture.astype(jnp.float32)
    return vae.encode(params, picture * 2.0 - 1.0, eps)


@flax.struct.dataclass
class FluxControlInputs(ControlInputs):
    """ControlInputs with the Union nets' modes (`control_mode`), one per picture, -1 for the other nets."""

    mode: Any = None


@dataclasses.dataclass(frozen=True)
class FluxControlNets(ControlNet):
    """The residuals of one or several Flux ControlNets (diffusers' FluxMultiControlNetModel sums them); their params
    are `params["controlnet"]`, a list for several nets. One Union net given several pictures reads each with its
    mode, as diffusers' Multi model of one net."""

    vae: Any = None  # pipeline.vae.VAE: encodes the control pictures

    net_class = FluxControlNetModel
    net_needs = "a FluxControlNetModel (or a list of them) from sdflax.FluxControlNetModel.from_pretrained"

    @classmethod
    def build(cls, parts, vae, denoiser) -> "FluxControlNets":
        nets = tuple(parts.controlnet or ())
        if len({net.config.conditioning_embedding_channels is None for net in nets}) > 1:
            raise ValueError("XLabs' ControlNets (an input_hint_block) and the others add their residuals to the "
                             "transformer's blocks differently: give nets of one kind")
        return cls(nets, vae)

    @property
    def reads_pixels(self) -> bool:
        """XLabs' nets: the pictures through their own encoder, and residuals repeated over the blocks."""
        return self.nets[0].config.conditioning_embedding_channels is not None

    def nets_for(self, count) -> tuple:
        """The net that reads each of `count` pictures."""
        return self.nets * count if len(self.nets) == 1 else self.nets

    def call_inputs(self, args: dict, settings, batch, leading_dims) -> FluxControlInputs:
        given = super().call_inputs(args, settings, batch, leading_dims)
        modes = control_modes(args.get("control_mode"), self.nets_for(len(as_nets(given.image))))
        return FluxControlInputs(given.image, given.scale, given.start, given.end, jnp.asarray(modes, jnp.int32))

    def pixel_size(self, picture) -> tuple:
        """(H, W) in pixels of a control picture, or of the latents given in its place."""
        f = self.vae.scale_factor if self.vae.is_latent_image(picture) else 1
        return tuple(side * f for side in picture.shape[-2:])

    def check_images(self, spec, given, leading_dims, batch):
        """One picture (batch) per net (several for one Union net), RGB in [0, 1] or latents, one size."""
        pictures = as_nets(given)
        if len(self.nets) > 1 and len(pictures) != len(self.nets):
            raise ValueError(f"{len(pictures)} control images for {len(self.nets)} ControlNets: give one image "
                             "(batch) per net, in the order of the nets")
        channels = (3, self.vae.latent_channels) if not self.reads_pixels else (3,)
        for k, picture in enumerate(pictures):
            what = f"control image {k}" if len(pictures) > 1 else "the control image"
            expected = ("(devices, B, " if leading_dims == 2 else "(B, ") + "3, H, W)"
            if picture.ndim != leading_dims + 3 or picture.shape[-3] not in channels:
                raise ValueError(f"{what} has shape {picture.shape}; expected {expected}: make it with "
                                 "pipeline.prepare_image_inputs(pictures)")
            if picture.shape[-3] == 3:
                check_picture_values(what, picture, "pipeline.prepare_image_inputs(pictures)")
            if picture.shape[:leading_dims] != batch:
                raise ValueError(f"{what} has shape {picture.shape} for a batch of {batch}: give one control "
                                 "image per prompt")
            if picture.shape[-2:] != pictures[0].shape[-2:]:
                raise ValueError(f"{what} is {picture.shape[-1]}x{picture.shape[-2]}, the first "
                                 f"{pictures[0].shape[-1]}x{pictures[0].shape[-2]}: give control images of one size")

    def wrap(self, params, inputs, settings, cond, start):
        given = inputs.condition(self.params_name)
        pictures = as_nets(given.image)
        n = len(pictures)
        nets = self.nets_for(n)
        net_params = as_nets(params[self.params_name]) * (n if len(self.nets) == 1 else 1)
        modes = jnp.broadcast_to(given.mode, (n,))
        scale_at = window_scales(given, n, start.state.timesteps.shape[0])
        b = pictures[0].shape[0]
        if self.reads_pixels:
            conditions = [picture * 2.0 - 1.0 for picture in pictures]
        else:  # each picture's latents, packed, once (diffusers' draws: the pictures in order, before the latents)
            f = self.vae.scale_factor
            shape = (b, self.vae.latent_channels, *(side // f for side in pictures[0].shape[-2:]))
            eps = control_draws(inputs.prng_seed, shape, n)
            conditions = [pack(encode_picture(self.vae, params, picture, e)) for picture, e in zip(pictures, eps)]
        prompt = cond.conditional() if settings.classifier_free_guidance else cond  # the nets read the prompt's rows

        def wrapper(unet_fn):
            def controlled(x, t, context, step, **residuals):
                latents = x[:b]  # every chunk of the guided batch holds the same latents
                tokens, ids = pack(latents), image_ids(*latents.shape[2:])
                timestep = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (b,)) / 1000
                pooled, guidance = prompt.unet_kwargs["pooled_projections"], prompt.unet_kwargs.get("guidance")
                samples, scales = [None, None], scale_at(step)
                for k, (net, p, condition) in enumerate(zip(nets, net_params, conditions)):
                    out = net.apply(p, tokens.astype(net.dtype), condition.astype(net.dtype), modes[k], scales[k],
                                    prompt.context, pooled, timestep, ids, text_ids(prompt.context.shape[1]),
                                    guidance if net.config.guidance_embeds else None)
                    samples = [new if total is None else total if new is None else
                               tuple(a + c for a, c in zip(total, new)) for total, new in zip(samples, out)]
                rows = x.shape[0] // b
                double, single = (None if s is None else tuple(jnp.tile(r, (rows, 1, 1)) for r in s) for s in samples)
                return unet_fn(x, t, context, step, controlnet_block_samples=double,
                               controlnet_single_block_samples=single, controlnet_blocks_repeat=self.reads_pixels,
                               **residuals)

            return controlled

        return wrapper


def control_modes(given, nets) -> list:
    """One mode per picture: a Union net's kind of picture (0 .. num_mode - 1), -1 for the other nets; one value
    for every picture, or one each."""
    modes = list(given) if isinstance(given, (list, tuple)) else [given] * len(nets)
    if len(modes) != len(nets):
        raise ValueError(f"control_mode has {len(modes)} entries for {len(nets)} control images: give one per "
                         "image (None for a net that is not a Union net)")
    for k, (net, mode) in enumerate(zip(nets, modes)):
        what = f"control image {k}'s net" if len(nets) > 1 else "the ControlNet"
        union = net.config.num_mode
        if union is None and mode is not None:
            raise ValueError(f"control_mode={mode!r}, but {what} is not a Union net (no num_mode): leave "
                             "control_mode out (None)")
        if union is not None and (isinstance(mode, bool) or not isinstance(mode, (int, np.integer))
                                  or not 0 <= mode < union):
            raise ValueError(f"control_mode={mode!r}: {what} is a Union net of {union} modes; give the kind of its "
                             f"picture, a whole number in 0 .. {union - 1} (its model card lists them)")
    return [-1 if mode is None else int(mode) for mode in modes]


def control_latents(vae, params, picture, prng_seed):
    """Flux Control's control picture (B, 3, H, W) in [-1, 1], or its latents, -> its VAE latents (B, C, h, w), a
    posterior sample drawn apart from the start's (diffusers encodes it with the pipeline's generator)."""
    if vae.is_latent_image(picture):
        return picture.astype(jnp.float32)
    shape = (picture.shape[0], vae.latent_channels, *(side // vae.scale_factor for side in picture.shape[2:]))
    return vae.encode(params, picture, control_draws(prng_seed, shape, 1)[0])


def check_control_transformer(vae, denoiser):
    """A Control transformer: the latents and the control picture's, packed (128 features per token for FLUX.1)."""
    c = vae.latent_channels
    if denoiser.in_channels != 2 * c:
        raise ValueError(f"Flux Control's transformer takes {8 * c} features per token (the latents and the "
                         f"control picture's, packed); this one takes {4 * denoiser.in_channels}: use Flux, "
                         "FluxImg2Img or FluxInpaint (FluxControlNet* with a ControlNet) for an ordinary Flux "
                         "checkpoint")


@flax.struct.dataclass
class ControlPictureInputs:
    image: Any = batched()  # (B, 3, H, W) in [0, 1], or its latents (B, C, h, w)


@dataclasses.dataclass(frozen=True)
class ControlLatents:
    """Flux Control's control picture: its VAE latents beside the latents on the channels at every step, as
    diffusers' FluxControlPipeline, FluxControlImg2ImgPipeline and FluxControlInpaintPipeline."""

    vae: Any

    # the weights it runs are the VAE's (it encodes the picture); its inputs are Inputs.conditions["vae"]
    params_name = "vae"
    picture = "control_image"
    arguments = {}

    @classmethod
    def build(cls, parts, vae, denoiser) -> "ControlLatents":
        check_control_transformer(vae, denoiser)
        return cls(vae)

    def pixel_size(self, picture) -> tuple:
        """(H, W) in pixels of the control picture, or of the latents given in its place."""
        f = self.vae.scale_factor if self.vae.is_latent_image(picture) else 1
        return tuple(side * f for side in picture.shape[-2:])

    def check_images(self, spec, given, leading_dims, batch):
        """One picture per prompt, RGB in [0, 1] or latents."""
        expected = ("(devices, B, " if leading_dims == 2 else "(B, ") + "3, H, W)"
        if isinstance(given, (list, tuple)) or given.ndim != leading_dims + 3 or given.shape[-3] not in (
                3, self.vae.latent_channels):
            raise ValueError(f"the control image has shape {described_shape(given)}; expected {expected}: make it "
                             "with pipeline.prepare_inputs(prompts, images, ..., control_images=pictures)")
        if given.shape[-3] == 3:
            check_picture_values("the control image", given, "pipeline.prepare_inputs(..., control_images=...)")
        if given.shape[:leading_dims] != batch:
            raise ValueError(f"the control image has shape {given.shape} for a batch of {batch}: give one control "
                             "image per prompt")

    def call_inputs(self, args: dict, settings, batch, leading_dims) -> ControlPictureInputs:
        return ControlPictureInputs(float32_array(args["control_image"]))

    def wrap(self, params, inputs, settings, cond, start):
        picture = inputs.condition(self.params_name).image
        if not self.vae.is_latent_image(picture):
            picture = picture * 2.0 - 1.0
        return functools.partial(with_channels, control_latents(self.vae, params, picture, inputs.prng_seed))


def described_shape(given) -> str:
    return f"a list of {len(given)}" if isinstance(given, (list, tuple)) else str(given.shape)


@dataclasses.dataclass(frozen=True)
class FromImageMaskPasted(FromImageMask):
    """Flux Control's inpainting: the known region pasted back after every step (diffusers'
    FluxControlInpaintPipeline), the transformer's other channels the control picture's (`ControlLatents`)."""

    @classmethod
    def build(cls, vae, denoiser) -> "FromImageMaskPasted":
        return cls(vae, False)  # the transformer's other channels: checked by ControlLatents
