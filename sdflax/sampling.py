"""The denoising loop: one `lax.scan` over a scheduler's pure `step`, with classifier-free guidance around the UNet.

A scheduler is anything with
    state = scheduler.set_timesteps(num_inference_steps, shape=latents.shape)   # state.timesteps: (evals,)
    x = scheduler.scale_model_input(state, x, i)
    x, state = scheduler.step(state, model_output, i, x, key=key)
where `i` indexes the model evaluations (a traced int32 inside the scan).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def classifier_free_guidance(uncond, cond, scale):
    """ε̂ = ε(x, ∅) + s (ε(x, c) − ε(x, ∅))  (Ho & Salimans 2022)."""
    return uncond + scale * (cond - uncond)


def guided_model(unet_fn, context, guidance_scale, guidance=classifier_free_guidance):
    """One UNet call on the doubled batch [unconditional; conditional], combined by `guidance`.

    `unet_fn(x, t, context) -> prediction`; `context` is (2B, T, D), unconditional rows first.
    """

    def model(x, t):
        out = unet_fn(jnp.concatenate([x, x]), t, context).astype(jnp.float32)
        uncond, cond = jnp.split(out, 2)
        return guidance(uncond, cond, guidance_scale)

    return model


def denoise(model, scheduler, latents, num_inference_steps, key, use_scan=True, callback=None):
    """Run the sampler from `latents` (already scaled by the scheduler's init_noise_sigma) to x₀'s latents.

    `model(x, t) -> prediction` in the scheduler's `prediction_type`. `use_scan=False` runs the same steps
    as a Python loop, for debugging (print, breakpoints); it gives the same result.
    `callback(step, num_steps, latents)` runs on the host after every model evaluation (progress bars,
    previews), through `jax.debug.callback`, so the loop stays one compiled scan.
    """
    state = scheduler.set_timesteps(num_inference_steps, shape=latents.shape)
    num_evals = state.timesteps.shape[0]
    steps = jnp.arange(num_evals)

    def step(carry, i):
        x, state = carry
        model_input = scheduler.scale_model_input(state, x, i)
        prediction = model(model_input, state.timesteps[i])
        x, state = scheduler.step(state, prediction, i, x, key=jax.random.fold_in(key, i))
        if callback is not None:
            jax.debug.callback(lambda i, x: callback(int(i), num_evals, x), i, x)
        return (x, state), None

    if use_scan:
        (latents, _), _ = jax.lax.scan(step, (latents, state), steps)
        return latents
    carry = (latents, state)
    for i in steps:
        carry, _ = step(carry, i)
    return carry[0]
