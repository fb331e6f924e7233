"""The one generate every pipeline runs: text conditioning -> initial latents -> the guided scan -> decode.

A `Spec` names the pieces (`types.Spec`): a family's text conditioning (`text.SDText`, `text.SDXLText`,
`sd3_text.SD3Text`), a start (`starts.FromNoise`, `FromImage`, `FromImageMask`), UNet wrappers
(`controlnet.ControlNet`), the denoiser (`denoisers`: a UNet or SD 3's transformer), the VAE and the scheduler.
`generate_fn` is the computation; `runner.Runner` builds its jit, pmap and jit + NamedSharding programs, and
`generate` (`sdflax.generate`) is its jit program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import sampling
from ..guiders import Guider
from ..hooks.core import Hook, intercept
from .runner import Runner
from .starts import schedule_window
from .types import Inputs, Output, Settings, Spec


def generate(spec: Spec, params, inputs: Inputs, settings: Settings) -> Output:
    """`generate_fn` compiled (`spec` and `settings` static): one compile per spec, settings and input shapes, none
    for new traced values; the pipelines' one-device program. A pure function still: jit, vmap and grad apply to
    it (a caller's transformation of traced arguments compiles it without the pipelines' compiler options, which
    only a top-level jit takes)."""
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves((params, inputs))):
        return _NESTED(spec, params, inputs, settings)
    return _PROGRAMS.jit(spec, params, inputs, settings)


def generate_fn(spec: Spec, params, inputs: Inputs, settings: Settings) -> Output:
    """The whole prompt (+ image) -> images computation as a pure function of `params` and `inputs`, uncompiled.

    Differentiable end to end (each sampler step is rematerialised).
    """
    spec = dataclasses.replace(spec, scheduler=settings.scheduler(spec.scheduler))  # a custom schedule's
    cond = spec.text.encode(params, inputs, settings)
    if not settings.classifier_free_guidance:
        cond = cond.conditional()
    hooks = tuple(inputs.hooks or ())
    # checked before the hooks' conditions: two that each add a perturbed batch fail there
    combines = [hook for hook in hooks if type(hook).combine is not Hook.combine]
    if len(combines) > 1:
        first, second = (f"{'the guider' if isinstance(h, Guider) else 'the hook'} {type(h).__name__}"
                         for h in combines[:2])
        raise ValueError(f"{first} and {second} both combine the UNet's predictions: give one "
                         "(PerturbedAttentionGuidance is a guider too)")
    for hook in hooks:
        cond = hook.condition(cond, settings)
    start = spec.start.begin(params, inputs, settings, spec.scheduler)
    chunks = cond.context.shape[0] // start.latents.shape[0]  # the UNet's batch: chunks of B rows
    sites = set()  # the attention layers the hooks saw, as the scan's body is traced

    def unet_fn(x, t, context, step, **extra):  # extra: residuals, or inputs that replace cond's for fewer rows
        if not hooks:
            return spec.denoiser(params, x, t, context, **{**cond.unet_kwargs, **extra})
        with intercept(hooks, step, chunks, sites):  # the UNet's layers only, not a ControlNet's
            return spec.denoiser(params, x, t, context, **{**cond.unet_kwargs, **extra})

    if start.wrap_unet is not None:
        unet_fn = start.wrap_unet(unet_fn)
    for wrapper in spec.wrappers:  # each wraps the last, so the first listed is the innermost
        unet_fn = wrapper.wrap(params, inputs, settings, cond, start)(unet_fn)
    for hook in hooks:
        unet_fn = hook.wrap_unet(unet_fn)
    takes_unconditional = getattr(spec.scheduler, "takes_unconditional", False)
    if combines and takes_unconditional:
        raise ValueError(f"{type(spec.scheduler).__name__} (CFG++) re-noises with classifier-free guidance's "
                         f"unconditional prediction, which {type(combines[0]).__name__} replaces: use another "
                         "scheduler with it")
    num_steps = settings.num_inference_steps - schedule_window(spec.scheduler, settings)[0]  # those run
    if combines:
        model = sampling.chunked_model(unet_fn, cond.context, chunks,
                                       lambda *out: combines[0].combine(out, inputs, settings))
    elif settings.classifier_free_guidance:
        guidance = settings.guidance or sampling.rescaled_guidance(jnp.asarray(inputs.guidance_rescale, jnp.float32))
        model = sampling.guided_model(unet_fn, cond.context, jnp.asarray(inputs.guidance_scale, jnp.float32),
                                      guidance, with_unconditional=takes_unconditional)
    else:
        model = sampling.conditional_model(unet_fn, cond.context)
    out = sampling.denoise(model, spec.scheduler, start.latents, settings.num_inference_steps, start.sampler_key,
                           callback=settings.callback, return_trajectory=settings.return_trajectory,
                           state=start.state, post_step=start.post_step, model_takes_step=True,
                           num_evals=start.num_evals, memory=any(hook.carries for hook in hooks),
                           num_steps=num_steps)
    for hook in hooks:
        hook.check_layers(sites)
    latents, trajectory = out if isinstance(out, tuple) else (out, None)
    if settings.output_type == "latent":
        return Output(latents, trajectory)
    return Output(spec.vae.decode(params, latents), trajectory)


_PROGRAMS = Runner(generate_fn)  # generate's: the pipelines' one-device program, made when first called
_NESTED = jax.jit(generate_fn, static_argnums=(0, 3))
