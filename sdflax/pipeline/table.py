"""The pipelines as data: a family (`sdflax.families`) lists one row per (start, wrappers) cell, naming its pieces
and its public argument order, from which its public classes are made here. A new UNet-side conditioning is a piece
and a row; a new family a text piece and its rows.

Every argument means the same in every class (docs/design.md, "How a pipeline is built"); the defaults are diffusers'
for the matching pipeline: `DEFAULTS`, with a row's own values where diffusers' pipelines differ.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

from .core import Pipeline, bind, prepared_inputs
from .images import preprocess_adapter_images, preprocess_control_images
from .starts import FromImage, FromImageMask, FromNoise, FromNoiseBesideImageMask
from .t2i_adapter import T2IAdapters

DEFAULTS = {"num_inference_steps": 50, "height": None, "width": None, "guidance_scale": 7.5, "latents": None,
            "noise": None, "neg_prompt_ids": None, "jit": False, "callback": None, "guidance_rescale": 0.0,
            "guidance": None, "return_trajectory": False, "prompt_embeds": None, "neg_prompt_embeds": None,
            "pooled_prompt_embeds": None, "neg_pooled_prompt_embeds": None, "original_size": None,
            "crops_coords_top_left": (0, 0), "target_size": None, "aesthetic_score": 6.0,
            "negative_aesthetic_score": 2.5, "denoising_start": None, "denoising_end": None, "output_type": "np",
            "strength": 1.0, "controlnet_conditioning_scale": 1.0, "control_guidance_start": 0.0,
            "control_guidance_end": 1.0, "guess_mode": False, "timesteps": None, "sigmas": None,
            "ip_adapter_image": None, "ip_adapter_image_embeds": None, "ip_adapter_scale": 1.0,
            "ip_adapter_masks": None, "negative_ip_adapter_image": None, "negative_ip_adapter_image_embeds": None,
            "adapter_image": None, "adapter_conditioning_scale": 1.0, "adapter_conditioning_factor": 1.0,
            "skip_guidance_layers": None, "skip_layer_guidance_scale": 2.8, "skip_layer_guidance_start": 0.01,
            "skip_layer_guidance_stop": 0.2, "true_cfg_scale": 1.0}
REQUIRED = ("prompt_ids", "image", "mask", "control_image", "params", "prng_seed")

# argument orders, as the classes have always had them (the SD ones follow diffusers' old Flax pipelines)
CONTROL = "control_guidance_start control_guidance_end guess_mode"
SCHEDULE = "timesteps sigmas"  # near the end of every class, as diffusers' pipelines take them
# every class, with load_ip_adapter
IP_ADAPTER = "ip_adapter_image ip_adapter_image_embeds ip_adapter_scale ip_adapter_masks"
# last in the classes whose row has no T2I-Adapter: an adapter given to them (adapter=) reads these
T2I_ADAPTER = "adapter_image adapter_conditioning_scale adapter_conditioning_factor"


class Row(NamedTuple):
    start: type
    wrappers: tuple
    arguments: str  # positional order after the fixed leading ones
    defaults: dict  # where this pipeline's defaults differ from DEFAULTS
    doc: str
    renamed: dict = {}  # call arguments that fill another Inputs field (Flux: guidance_scale is the distilled one)


def signature(row: Row, text) -> inspect.Signature:
    defaults = {**DEFAULTS, **row.defaults}
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    unet = text.denoiser.component == "unet"  # IP-Adapters and T2I-Adapters act on UNets
    ip_adapter = IP_ADAPTER if unet else getattr(text, "ip_adapter_arguments", "")  # a transformer's own
    tail = SCHEDULE.split() + ip_adapter.split() + (
        T2I_ADAPTER.split() if unet and T2IAdapters not in row.wrappers else [])
    defaults.update(getattr(text, "call_arguments", {}))  # a text piece's own (SD's A1111 weights, clip_skip)
    return inspect.Signature([inspect.Parameter(name, kind) if name in REQUIRED else
                              inspect.Parameter(name, kind, default=defaults[name])
                              for name in row.arguments.split() + tail + list(getattr(text, "call_arguments", {}))])


def make_class(name: str, row: Row, family) -> type:
    """The public class of a family's row: `__call__` and `prepare_inputs` with the row's signatures."""
    text = family.text
    call_signature = signature(row, text)
    pictures = [f"{n}s" for n, _ in row.start.images]
    if row.start.images:  # a text-to-image ControlNet pipeline takes its control images apart (the old Flax API)
        pictures += [f"{wrapper.picture}s" for wrapper in row.wrappers if wrapper.picture]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    prepare_signature = inspect.Signature([inspect.Parameter("prompts", kind)] + [
        inspect.Parameter(n, kind, default=None) for n in pictures] + [
        inspect.Parameter(n, kind, default=default) for n, default in text.prompt_arguments.items()])

    def __call__(self, *args, **kwargs):
        return self._call(args, kwargs)

    def prepare_inputs(self, *args, **kwargs):
        values = bind(prepare_signature, args, kwargs)
        texts = {name: values.pop(name) for name in text.prompt_arguments}
        return prepared_inputs(text, self.parts(), self.vae_scale_factor, values.pop("prompts"), texts, values)

    with_self = [inspect.Parameter("self", kind)]
    __call__.__signature__ = call_signature.replace(parameters=with_self + list(call_signature.parameters.values()))
    __call__.__doc__ = ("Images (B, H, W, 3) in [0, 1]; with `jit=True` under `jax.pmap` (inputs `shard`ed, params "
                        "`replicate`d): (devices, B, H, W, 3). The arguments: docs/design.md, \"How a pipeline is "
                        "built\".")
    prepare_inputs.__signature__ = prepare_signature.replace(
        parameters=with_self + list(prepare_signature.parameters.values()))
    prepare_inputs.__doc__ = prepared_inputs.__doc__
    namespace = {"family": family, "text": text, "start": row.start, "wrappers": row.wrappers,
                 "signature": call_signature,
                 "defaults": {n: p.default for n, p in call_signature.parameters.items() if n not in REQUIRED},
                 "renamed": {**row.renamed, **({"image": row.wrappers[0].picture}
                                               if row.wrappers and not row.start.images else {})},
                 "__call__": __call__, "prepare_inputs": prepare_inputs, "__doc__": row.doc,
                 "__module__": family.module}
    if row.wrappers and not row.start.images:
        namespace.update(prepare_text_inputs=prepare_text_inputs, prepare_image_inputs=(
            prepare_adapter_image_inputs if T2IAdapters in row.wrappers else prepare_image_inputs))
    return type(name, (Pipeline,), namespace)


def prepare_text_inputs(self, prompts, prompts_2=None):
    """= prepare_inputs (the name in diffusers' old Flax ControlNet pipeline)."""
    return prepared_inputs(self.text, self.parts(), self.vae_scale_factor, prompts, {"prompts_2": prompts_2}, {})


def prepare_image_inputs(self, images):
    """Control images -> float32 (B, 3, H, W) in [0, 1]."""
    return preprocess_control_images(images, self.vae_scale_factor)


def prepare_adapter_image_inputs(self, images):
    """Adapter pictures -> float32 (B, C, H, W) in [0, 1], C the adapter's input channels (grey for 1): a list of
    them for several adapters, one list of pictures each."""
    if len(self.adapters) > 1:
        if not isinstance(images, (list, tuple)) or len(images) != len(self.adapters):
            raise ValueError(f"{len(self.adapters)} T2I-Adapters: give one list of pictures per adapter")
        return [preprocess_adapter_images(pictures, self.vae_scale_factor, adapter.config.in_channels)
                for pictures, adapter in zip(images, self.adapters)]
    return preprocess_adapter_images(images, self.vae_scale_factor, self.adapters[0].config.in_channels)


# a start's name by the pictures a call gives it (SD 3.x's inpainting ControlNet takes an image and a mask)
START_NAMES = {FromNoise: "noise", FromImage: "image", FromImageMask: "image_mask",
               FromNoiseBesideImageMask: "image_mask"}
