"""Everything checked before a pipeline traces or compiles, as pure functions of what the pipeline runs (its
`types.Spec`: the pieces and the models they hold) and a call's arguments: what jax would otherwise accept and run into garbage, or
fail on deep inside the trace. `split` turns a call's arguments into the (Inputs, Settings) that `generate` takes.

`leading_dims`: 1 for (B, ...) inputs, 2 for pmap's (devices, B, ...), None inside a caller's trace (no checks
that need concrete values).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import warnings
from collections.abc import Mapping

import flax
import jax
import jax.numpy as jnp
import numpy as np

from ..guiders import Guider
from ..guiders.base import NUMBER_BOUND
from ..schedulers import common
from . import ip_adapter
from .arguments import check_kinds, described, picture_arrays
from .controlnet import as_nets
from .skip_layers import check_skip_layer_window, check_skip_layers, skip_layer_guider
from .starts import schedule_window
from .t2i_adapter import T2IAdapters
from .types import Inputs, Settings, float32_array

INPUTS = tuple(f.name for f in dataclasses.fields(Inputs))
SETTINGS = tuple(f.name for f in dataclasses.fields(Settings))


def split(spec, args: dict, leading_dims, renamed: Mapping, hooks=(), defaults: Mapping = {}):
    """(Inputs, Settings) from a call's arguments (`renamed`: argument names that differ from the Inputs field
    they fill; `defaults`: the pipeline class's), checked."""
    check_kinds(args)
    call = args  # as given: the checks below name its arguments
    scheduler = spec.scheduler
    if args.get("timesteps") is not None or args.get("sigmas") is not None:  # their steps, as diffusers
        scheduler = scheduler.with_schedule(args.get("timesteps"), args.get("sigmas"))
        args = {**args, "num_inference_steps": common.custom_steps(scheduler.config),
                "timesteps": scheduler.config.custom_timesteps, "sigmas": scheduler.config.custom_sigmas}
    steps = args["num_inference_steps"]
    for name in ("height", "width"):
        check_size(name, args.get(name))
    if args.get("output_type", "np") not in ("np", "latent"):
        raise ValueError(f"output_type={args['output_type']!r}: 'np' (images in [0, 1]) or 'latent' (the latents, "
                         "undecoded, e.g. for a refiner)")
    if args.get("skip_guidance_layers") is not None:
        args = {**args, "skip_guidance_layers": check_skip_layers(spec, args["skip_guidance_layers"])}
    args = {renamed.get(name, name): value for name, value in args.items()}
    defaults = {renamed.get(name, name): value for name, value in defaults.items()}
    for name in [wrapper.picture for wrapper in spec.wrappers if wrapper.picture]:  # checked as arrays
        if args.get(name) is not None:
            args[name] = picture_arrays(name, args[name])
    values = {name: args[name] for name in INPUTS if args.get(name) is not None}
    for name, _ in spec.start.images:
        values[name] = jax.tree.map(float32_array, values[name])
    values.setdefault("guidance_rescale", 0.0)
    for name in Inputs.shared_fields():  # arrays, so that a Python float and an array share one program
        if name in values:
            values[name] = jnp.asarray(values[name], jnp.float32)
    inputs = Inputs(**values, hooks=tuple(hooks) or None)
    if hasattr(spec.text, "match_chunks"):  # A1111's prompts: the negative's chunk count the prompt's
        inputs = spec.text.match_chunks(inputs)
    if leading_dims is not None:
        spec.text.check_inputs(inputs)
        check_shapes(spec, inputs, leading_dims)
        check_values(spec, inputs, leading_dims)
    height, width = sizes(spec, *image_size(spec, inputs, args, leading_dims, args.get("height"), args.get("width")))
    guides = spec.text.can_guide(inputs)  # Flux's true CFG needs a negative prompt; the others' default to ""
    inputs = spec.text.fill_inputs(inputs, height, width)
    guiders = [hook for hook in hooks if isinstance(hook, Guider)]
    if guiders and args.get("guidance") is not None:
        raise ValueError(f"guidance= and the pipeline's guider ({type(guiders[0]).__name__}) both combine the "
                         "predictions: give one")
    if guiders:
        check_left_to_the_guider(guiders[0], args, defaults, {field: name for name, field in renamed.items()})
    check_hooks_fit(spec, hooks, args.get("skip_guidance_layers"))
    settings = Settings(**{**{name: args[name] for name in SETTINGS if name in args},
                           "height": height, "width": width,
                           # a guider decides with its own traced scale; a guidance function of the user's
                           # combines both halves at any scale, and a CFG++ scheduler re-noises with the
                           # unconditional half at any scale
                           "classifier_free_guidance": guiders[0].enabled if guiders else
                           args.get("guidance") is not None or guided(args["guidance_scale"]) and guides
                           or getattr(scheduler, "takes_unconditional", False),
                           "image_seq_len": spec.denoiser.image_seq_len(height // spec.vae.scale_factor,
                                                                        width // spec.vae.scale_factor)})
    scheduler = settings.scheduler(spec.scheduler)  # at this size, where the schedule depends on it (SD 3)
    scheduler.check_steps(steps)
    skipped_start, _ = schedule_window(scheduler, settings)  # checked before anything is traced
    if settings.skip_guidance_layers:
        check_skip_layer_window(args, settings.num_inference_steps - skipped_start)
    for guider in guiders:
        warn_if_never_perturbed(guider, settings.num_inference_steps - skipped_start)
    if settings.skip_guidance_layers and settings.classifier_free_guidance:  # as diffusers: with CFG only
        if args.get("guidance") is not None:
            raise ValueError("guidance= and skip_guidance_layers (a SkipLayerGuidance) both combine the predictions: "
                             "give one")
        inputs = inputs.replace(hooks=(skip_layer_guider(args, inputs), *(inputs.hooks or ())))
    if not nets_of(spec, T2IAdapters):
        check_unused(args, T2I_ARGUMENTS, "T2I-Adapters: make the pipeline with them (sdflax.StableDiffusionAdapter."
                     "from_pretrained(..., adapter=...))")
    if ip_adapter.piece(spec) is None:
        ip_adapter.check_absent(args)
        check_unused(args, IP_ADAPTER_ARGUMENTS, "an IP-Adapter: pipeline, params = pipeline.load_ip_adapter(params, "
                     "...)")
    batch = inputs.prompts().shape[:leading_dims or 1]
    conditions = {wrapper.params_name: wrapper.call_inputs(args, settings, batch, leading_dims)
                  for wrapper in spec.wrappers}
    if leading_dims is not None:
        check_finite(call)  # after the checks that say more of a particular argument
    return inputs.replace(conditions=conditions or None), settings


# The T2I-Adapters' call arguments and their defaults: what a pipeline without them refuses other values of
T2I_ARGUMENTS = {"adapter_image": None, "adapter_conditioning_scale": 1.0, "adapter_conditioning_factor": 1.0}
IP_ADAPTER_ARGUMENTS = {"ip_adapter_scale": 1.0, "ip_adapter_masks": None}  # (ip_adapter_image: call_inputs says)


def check_unused(args, defaults: dict, needs: str):
    """Arguments that do nothing on this pipeline are refused unless they are left at their defaults: given, they
    would be recorded and silently ignored."""
    for name, default in defaults.items():
        value = args.get(name, default)
        if value is default or (type(value) in (int, float) and value == default):
            continue
        raise ValueError(f"{name} applies with {needs}, or drop {name}")


def check_hooks_fit(spec, hooks, skip_guidance_layers):
    """Each hook on a denoiser where it has a meaning (`Hook.check_model`); skip_guidance_layers= is a
    SkipLayerGuidance of its own."""
    if skip_guidance_layers is not None and any(isinstance(hook, Guider) for hook in hooks):
        raise ValueError("skip_guidance_layers runs with the pipeline's classifier-free guidance, as diffusers' SD 3 "
                         "pipeline: drop the guider (with_guider(None)), or drop skip_guidance_layers and give "
                         "SkipLayerGuidance(skip_layer_config=LayerSkipConfig([7, 8, 9], fqn='transformer_blocks'))")
    for hook in hooks:
        hook.check_model(spec.denoiser)


def check_left_to_the_guider(guider, args, defaults, called):
    """A guider's scale and rescale are its own: the call's, if not the class default or the guider's value, would
    be ignored (`called`: the call's names of renamed fields, Flux's true_cfg_scale)."""
    for name in ("guidance_scale", "guidance_rescale"):
        given, default = args.get(name), defaults.get(name)
        if given is None or isinstance(given, jax.core.Tracer) or np.ndim(given) or default is None:
            continue
        own = getattr(guider, name, None)
        if isinstance(own, jax.core.Tracer):  # the caller's jit or grad traces the guider: its value is unknown
            continue
        if np.float32(given) not in [np.float32(default)] + ([] if own is None else [np.float32(own)]):
            held = f"its {name} is {float(np.float32(own)):g}" if own is not None else f"it takes no {name}"
            name = called.get(name, name)
            raise ValueError(f"{name}={float(given):g} with the pipeline's guider {type(guider).__name__}, whose "
                             f"numbers apply ({held}): give it to the guider (pipeline.with_guider(...)), or leave "
                             f"{name} out")


def warn_if_never_perturbed(guider, steps: int):
    """A perturbed guider whose window holds none of the call's steps gives plain guidance's images: PAG's default
    window, 0.01 to 0.2 of the steps, holds none of 4."""
    if not getattr(guider, "extra_predictions", ()) or not hasattr(guider, "perturbed_window"):
        return
    names = guider.arguments
    start, stop = getattr(guider, names.start), getattr(guider, names.stop)
    if not any(guider.perturbed_window(step, steps, start, stop) for step in range(steps)):
        warnings.warn(f"{type(guider).__name__}: {names.start}={start:g} and {names.stop}={stop:g} hold none of the "
                      f"{steps} steps (it acts after step int({start:g} x {steps}) and before int({stop:g} x "
                      f"{steps})): the images are plain guidance's; widen the window or take more steps",
                      stacklevel=5)


def check_finite(args):
    """Every number and picture of a call finite in float32, where the program computes with it: NaN, inf and
    values past float32's range (sigmas=[1e300, 0]) drew black images without a word."""
    for name, value in args.items():
        if name.endswith("_ids") or callable(value) or isinstance(value, (str, bool)) or value is None:
            continue
        leaves = jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, (jax.Array, np.ndarray)))
        if any(not finite_float32(leaf) for leaf in leaves):
            raise ValueError(f"{name} holds NaN, inf or a number past float32's range (about 3.4e38): give finite "
                             "numbers")
        largest = max((largest_magnitude(leaf) for leaf in leaves), default=0.0)
        if name.endswith(("_scale", "_factor")) and largest > NUMBER_BOUND:  # a conditioning's own scales too
            raise ValueError(f"{name}={largest:g} is past {NUMBER_BOUND:g}, where float32 arithmetic overflows into "
                             "a black image: give a smaller number")


def largest_magnitude(x) -> float:
    """The largest |value| of a number or array (0 for tracers, keys, text and booleans)."""
    if isinstance(x, (jax.core.Tracer, bool, str, np.bool_)) or not hasattr(x, "dtype") and \
            not isinstance(x, numbers.Real):
        return 0.0
    if hasattr(x, "dtype") and not any(jnp.issubdtype(x.dtype, kind) for kind in (jnp.floating, jnp.integer)):
        return 0.0
    with np.errstate(all="ignore"):
        return float(np.max(np.abs(np.asarray(x, np.float64)), initial=0.0))


def finite_float32(x) -> bool:
    """Whether a number or array is finite as float32 (keys, tracers, text and booleans are taken as they are)."""
    if isinstance(x, jax.core.Tracer) or isinstance(x, (bool, str, np.bool_)):
        return True
    if isinstance(x, jax.Array):
        if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
            return True  # a key, or booleans
        return bool(jnp.isfinite(x.astype(jnp.float32)).all())
    if isinstance(x, numbers.Real) or isinstance(x, np.ndarray) and x.dtype.kind in "fiu":
        with np.errstate(all="ignore"):
            return bool(np.isfinite(np.asarray(x, np.float32)).all())
    return True


def guided(guidance_scale) -> bool:
    """Classifier-free guidance runs for scales above 1, as diffusers decides; at 1 or below the UNet sees only
    the conditional batch. A scale traced by the caller's own jit keeps guidance on (its value is unknown)."""
    if isinstance(guidance_scale, jax.core.Tracer):
        return True
    return bool(np.any(np.asarray(guidance_scale) > 1))


def check_size(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0):
        raise ValueError(f"{name} must be a positive whole number of pixels (or None for the default), got "
                         f"{described(value) if hasattr(value, 'shape') else repr(value)}")


def sizes(spec, height, width):
    """(height, width): as given, or the denoiser's sample size in pixels; multiples of the VAE scale factor (times
    a transformer's patch)."""
    f, patch = spec.vae.scale_factor, spec.denoiser.patch
    height = height or spec.denoiser.sample_size * f
    width = width or spec.denoiser.sample_size * f
    step = f * patch
    for name, value in (("height", height), ("width", width)):
        if value % step:
            what = f"the VAE scale factor {f}" + (f" times the patch size {patch}" if patch > 1 else "")
            raise ValueError(f"{name}={value} is not a multiple of {what}: use {value // step * step} or "
                             f"{(value // step + 1) * step}")
    return height, width


def check_shapes(spec, inputs, leading_dims):
    ids = inputs.prompts()
    if ids is None:
        raise ValueError("give prompt_ids (from pipeline.prepare_inputs(prompts)) or prompt_embeds")
    tail = tuple(spec.text.ids_tail(inputs.prompt_ids))
    sharded = " and shard()" if leading_dims == 2 else ""
    for name in ("prompt_ids", "neg_prompt_ids"):
        value = getattr(inputs, name)
        if value is not None and (value.ndim != leading_dims + len(tail) or value.shape[-len(tail):] != tail):
            expected = ("(devices, batch, " if leading_dims == 2 else "(batch, ") + ", ".join(map(str, tail)) + ")"
            both = " (ids of both tokenizers)" if len(tail) == 2 else ""
            raise ValueError(f"{name} has shape {value.shape}; expected {expected}{both}: make it with "
                             f"pipeline.prepare_inputs(prompts){sharded}")
    for name, twin in (("neg_prompt_ids", "prompt_ids"), ("neg_prompt_embeds", "prompt_embeds")):
        a, b = getattr(inputs, name), getattr(inputs, twin)
        if a is not None and b is not None and a.shape != b.shape:
            raise ValueError(f"{name} {a.shape} and {twin} {b.shape} differ: give one negative prompt per prompt")
    batch = ids.shape[:leading_dims]
    if 0 in batch:
        raise ValueError(f"{'prompt_ids' if inputs.prompt_ids is not None else 'prompt_embeds'} of shape "
                         f"{ids.shape} holds no prompt: give at least one")
    width = spec.denoiser.context_width
    for name in ("prompt_embeds", "neg_prompt_embeds"):
        value = getattr(inputs, name)
        if value is not None and value.shape[-1] != width:
            raise ValueError(f"{name} has shape {value.shape}; the UNet takes text states {width} wide: make them "
                             "with this pipeline's text encoder(s) (pipeline.encode_prompt)")
    start = spec.start
    make = "pipeline.prepare_inputs(prompts, " + ", ".join(f"{name}s" for name, _ in start.images) + ")"
    size = None
    for name, channels in start.images:
        x = getattr(inputs, name)
        channels = channels if isinstance(channels, tuple) else (channels,)  # (3, 4): RGB, or latents
        expected = ("(devices, B, " if leading_dims == 2 else "(B, ") + f"{' or '.join(map(str, channels))}, H, W)"
        if x.ndim != leading_dims + 3 or x.shape[-3] not in channels:
            raise ValueError(f"{name} has shape {x.shape}; expected {expected}: make it with {make}{sharded}")
        if x.shape[:leading_dims] != batch:
            raise ValueError(f"{name} has shape {x.shape} for prompt_ids of {ids.shape}: give one {name} per "
                             "prompt")
        if size is not None and x.shape[-2:] != size:
            raise ValueError(f"{name} is {x.shape[-1]}x{x.shape[-2]} but the image is {size[1]}x{size[0]}: "
                             f"give a {name} of the image's size")
        size = x.shape[-2:]


def check_values(spec, inputs, leading_dims):
    """Keys, token ids and scales of the right kind (a (3,) guidance scale would broadcast over the latent
    width)."""
    check_key(inputs.prng_seed, leading_dims)
    t5 = getattr(spec.text, "t5", None)  # SD 3 and Flux: T5's ids follow CLIP's, from a smaller vocabulary
    clip = [getattr(spec.text, name, None) for name in ("text_encoder", "text_encoder_2")]
    vocab = min(encoder.config.vocab_size for encoder in clip if encoder is not None and encoder is not t5)
    for name in ("prompt_ids", "neg_prompt_ids"):
        ids = getattr(inputs, name)
        if ids is None or not hasattr(spec.text, "t5"):
            check_ids(name, ids, vocab)
            continue
        check_ids(name, ids[..., :spec.text.clip_columns], vocab)
        if t5 is not None:
            check_ids(name, ids[..., spec.text.clip_columns:], t5.config.vocab_size, "T5's")
    for name in ("guidance_scale", "guidance_rescale"):
        value = getattr(inputs, name)
        if value.ndim:
            raise ValueError(f"{name} must be one number, got an array of shape {value.shape}")
        if not isinstance(value, jax.core.Tracer) and not np.isfinite(np.asarray(value)):
            raise ValueError(f"{name} must be a finite number, got {float(value)}")


def check_params(spec, params, mode: str | None, pipeline_name: str):
    """params hold every model the pipeline runs, with a leading device axis exactly when pmap runs them.
    `mode`: "jit=True" (pmap), "jit=False", "generate_sharded", or None inside a caller's trace (either);
    `pipeline_name`: its class's name, for the message."""
    # every model this pipeline has (an SDXL refiner has no first text encoder), and its wrappers' params
    held = {spec.denoiser.component, "vae"}
    needed = [name for name in type(spec.text).models if name in held or getattr(spec.text, name, None) is not None]
    needed += [wrapper.params_name for wrapper in spec.wrappers]
    if getattr(ip_adapter.piece(spec), "image_encoder", None) is not None:
        needed.append("image_encoder")
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be the dict from from_pretrained ({', '.join(needed)}), got "
                        f"{type(params).__name__}")
    missing = [name for name in needed if name not in params]
    if missing:
        raise ValueError(f"params has no {', '.join(map(repr, missing))} (it has {', '.join(map(repr, params))}): "
                         f"pass the params from {pipeline_name}.from_pretrained")
    kernel, rank = spec.denoiser.replication_probe(params), spec.denoiser.probe_rank
    if kernel is None or mode is None:
        return
    replicated = mode == "jit=True"
    if kernel.ndim == rank + 1 and not replicated:
        raise ValueError(f"params are replicated (a leading device axis), but {mode} takes them as "
                         "from_pretrained gives them: pass unreplicated params, or call with jit=True")
    if kernel.ndim == rank and replicated:
        raise ValueError("jit=True runs under pmap and needs replicated params: sdflax.replicate(params)")
    if kernel.ndim == rank + 1 and kernel.shape[0] != jax.local_device_count():
        raise ValueError(f"params are replicated for {kernel.shape[0]} devices, but there are "
                         f"{jax.local_device_count()}: sdflax.replicate(params) on this machine")


@contextlib.contextmanager
def params_named_in_errors(pipeline_name: str):
    """A params tree that lacks a layer fails when the models are traced, in Flax's words: say it is `params`."""
    try:
        yield
    except flax.errors.ScopeParamNotFoundError as e:
        detail = str(e).split(" (https://")[0]
        raise ValueError(f"params lack a parameter a model reads ({detail}): pass the params from "
                         f"{pipeline_name}.from_pretrained") from None


def check_devices(inputs):
    """pmap's inputs: one slice of the batch and one key (or one per image) per local device."""
    devices = inputs.prompts().shape[0]
    if devices != jax.local_device_count():
        raise ValueError(f"prompt_ids lead with {devices}, but there are {jax.local_device_count()} devices: "
                         "shard(prompt_ids) splits a batch divisible by the device count")
    if inputs.prng_seed.shape[0] != devices:
        raise ValueError(f"prng_seed leads with {inputs.prng_seed.shape[0]} for {devices} devices: one key "
                         "per device (jax.random.split(key, devices)), or shard(keys) with one key per image")


def image_size(spec, inputs, args, leading_dims, height, width):
    """(height, width): the pictures' for pipelines that take pictures (a given height/width must agree), else as
    given."""
    sizes = [(name, pixels(spec, getattr(inputs, name))) for name, _ in spec.start.images]
    # the control images: the ControlNets', or Flux Control's picture beside an image start's
    control = next((piece for piece in spec.wrappers if piece.picture == "control_image"), None)
    if control:  # the control images
        first = given_pictures(args, "control_image")[0]
        if leading_dims is not None:
            control.check_images(spec, args.get("control_image"), leading_dims, inputs.prompts().shape[:leading_dims])
        sizes.append(("the control image", control.pixel_size(first)))
    if nets_of(spec, T2IAdapters):  # the T2I-Adapters' pictures
        first = given_pictures(args, "adapter_image")[0]
        if leading_dims is not None:
            check_adapter_images(spec, args.get("adapter_image"), leading_dims, inputs.prompts().shape[:leading_dims])
        sizes.append(("the adapter image", first.shape[-2:]))
    if not sizes:
        return height, width
    (first, actual), *others = sizes
    for name, size in others:
        if tuple(size) != tuple(actual):
            raise ValueError(f"{name} is {size[1]}x{size[0]} but {first} is {actual[1]}x{actual[0]}: give "
                             "images of one size")
    for name, given, side in (("height", height, actual[0]), ("width", width, actual[1])):
        if given is not None and given != side:
            raise ValueError(f"{name}={given} but the image is {side}: resize the image, or leave {name} out")
    return tuple(actual)


# the pictures a conditioning's nets take: (the nets, what to give, the pipeline whose `image` argument they are)
PICTURES = {"control_image": ("ControlNets", "their control images", "StableDiffusionControlNet"),
            "adapter_image": ("T2I-Adapters", "their pictures", "StableDiffusionAdapter")}


def given_pictures(args, name) -> tuple:
    """The arrays of `name`, one per net; a missing one in one line, inside a caller's jit too."""
    pictures = as_nets(args.get(name))
    if not all(hasattr(picture, "shape") for picture in pictures):
        nets, what, pipeline = PICTURES[name]
        given = "not given" if args.get(name) is None else described(args[name])
        raise ValueError(f"this pipeline has {nets}, but {name} is {given}: give {what} ({name}=, or the image "
                         f"argument of {pipeline}), made with pipeline.prepare_image_inputs(pictures)")
    return pictures


def pixels(spec, image):
    """(H, W) of an image, or of the image that latents (an image with the latent channels) decode to."""
    f = spec.vae.scale_factor if spec.vae.is_latent_image(image) else 1
    return tuple(side * f for side in image.shape[-2:])


def check_adapter_images(spec, given, leading_dims, batch):
    """One picture per T2I-Adapter, (B, C, H, W) with the adapter's channels, sides a multiple of its downscale."""
    images, adapters = as_nets(given), nets_of(spec, T2IAdapters)
    if len(images) != len(adapters):
        raise ValueError(f"{len(images)} adapter images for {len(adapters)} T2I-Adapters: give one per adapter")
    for k, (adapter, image) in enumerate(zip(adapters, images)):
        what = f"adapter image {k}" if len(images) > 1 else "the adapter image"
        expected = ("(devices, B, " if leading_dims == 2 else "(B, ") + f"{adapter.config.in_channels}, H, W)"
        check_picture_values(what, image, "pipeline.prepare_adapter_image_inputs(pictures)")
        if image.ndim != leading_dims + 3 or image.shape[-3] != adapter.config.in_channels:
            raise ValueError(f"{what} has shape {image.shape}; its adapter takes {expected}: make it with "
                             "pipeline.prepare_image_inputs(pictures)")
        if image.shape[:leading_dims] != batch:
            raise ValueError(f"{what} has shape {image.shape} for prompts of {batch}: give one per prompt")
        factor = adapter.total_downscale_factor
        if image.shape[-2] % factor or image.shape[-1] % factor:
            raise ValueError(f"{what} is {image.shape[-1]}x{image.shape[-2]}; this adapter needs sides that are "
                             f"multiples of {factor}")


def check_picture_values(what, image, make):
    """Pixels as sdflax takes them: floats in [0, 1] (not uint8, not 0-255)."""
    if not jnp.issubdtype(image.dtype, jnp.floating):
        raise TypeError(f"{what} is {image.dtype}; pictures are floats in [0, 1]: make it with {make}")
    if isinstance(image, jax.core.Tracer):
        return
    values = np.asarray(image, np.float32)
    if not np.isfinite(values).all():
        raise ValueError(f"{what} holds NaN or Inf; pictures are floats in [0, 1]: make it with {make}")
    low, high = float(values.min()), float(values.max())
    if low < 0 or high > 1:
        raise ValueError(f"{what} spans [{low:.4g}, {high:.4g}]; pictures are floats in [0, 1]: make it with {make}")


def nets_of(spec, wrapper) -> tuple:
    """The nets of the spec's `wrapper` (ControlNet, T2IAdapters): () where it has none."""
    return next((piece.nets for piece in spec.wrappers if isinstance(piece, wrapper)), ())


@functools.cache
def raw_key_size() -> int:
    """uint32 words in a raw key of the default PRNG implementation (2 for threefry), made once per process
    rather than on every call."""
    return jax.random.PRNGKey(0).shape[-1]


def check_key(key, leading_dims):
    """One PRNG key or one per image ((devices, ...) first under pmap): typed (`jax.random.key`) or raw uint32
    (`jax.random.PRNGKey`)."""
    raw_size = raw_key_size()
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key) if hasattr(key, "dtype") else False
    if not typed and not (hasattr(key, "dtype") and key.dtype == np.uint32 and key.ndim and key.shape[-1] == raw_size):
        what = f"a {key.dtype} array of shape {key.shape}" if hasattr(key, "dtype") else repr(key)
        raise TypeError(f"prng_seed must be a PRNG key (jax.random.PRNGKey(seed) or jax.random.key(seed)), got "
                        f"{what:.200}")
    key_dims = key.ndim - (0 if typed else 1)  # the dimensions that count keys
    if leading_dims == 2 and key_dims not in (1, 2):
        raise ValueError(f"prng_seed has shape {key.shape}: jit=True needs one key per device, "
                         "jax.random.split(key, jax.local_device_count()), or shard(keys) with one key per image")
    if leading_dims == 1 and key_dims > 1:
        raise ValueError(f"prng_seed has shape {key.shape}: give one key, or one key per image (B, ...)")


def check_ids(name, ids, vocab_size, encoder="the text encoder's"):
    if ids is None:
        return
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name} must be integer token ids (pipeline.prepare_inputs(prompts)), got {ids.dtype}")
    if isinstance(ids, jax.core.Tracer):
        return
    low, high = int(np.min(ids)), int(np.max(ids))
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}, outside {encoder} vocabulary [0, {vocab_size}): "
                         "make the ids with pipeline.prepare_inputs(prompts)")
