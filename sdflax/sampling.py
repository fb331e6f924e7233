"""The denoising loop: one `lax.scan` over a scheduler's pure `step`, with guidance around the UNet.

A scheduler is anything that follows `sdflax.schedulers.Scheduler` (a typing.Protocol): `set_timesteps` gives a
state (`state.timesteps`: (evals,), `state.init_noise_sigma`), and `scale_model_input`, `step`, `predict_x0` and
`add_noise` are pure functions of it and of `i`, the index of the model evaluation (a traced int32 in the scan).

A guidance function combines the unconditional and conditional predictions:
    guidance(uncond, cond, scale) -> prediction
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


def classifier_free_guidance(uncond, cond, scale):
    """ε̂ = ε(x, ∅) + s (ε(x, c) − ε(x, ∅))  (Ho & Salimans 2022)."""
    return uncond + scale * (cond - uncond)


def _std(x):
    """Standard deviation of each sample over all but the batch axis (torch's unbiased std, as diffusers)."""
    axes = tuple(range(1, x.ndim))
    n = x[0].size
    mean = x.mean(axes, keepdims=True)
    return jnp.sqrt(jnp.square(x - mean).sum(axes, keepdims=True) / (n - 1))


def rescale(guided, cond, guidance_rescale):
    """diffusers' `rescale_noise_cfg` (Lin et al. 2023, §3.4, eq. 15–16): the guided prediction scaled back to the
    conditional one's std, mixed with it by `guidance_rescale`."""
    rescaled = guided * (_std(cond) / _std(guided))
    return guidance_rescale * rescaled + (1 - guidance_rescale) * guided


def rescaled_guidance(guidance_rescale: float):
    """Classifier-free guidance with diffusers' `guidance_rescale` (`rescale`)."""

    def guidance(uncond, cond, scale):
        return rescale(classifier_free_guidance(uncond, cond, scale), cond, guidance_rescale)

    return guidance


def thresholded_guidance(mimic_scale: float = 7.0, percentile: float = 0.995):
    """Classifier-free guidance at a high scale, dynamically thresholded to the range of a milder one.

    Imagen's dynamic thresholding (Saharia et al. 2022, §2.3) moved into prediction space, as the popular
    "mimic scale" variant does: per sample and channel, the guided prediction's deviation from its mean is
    clipped at its `percentile` absolute value s and rescaled by max(m, ...) / s, where m is the largest
    deviation guidance at `mimic_scale` would give. High scales keep their direction without saturating.
    """

    def guidance(uncond, cond, scale):
        guided = classifier_free_guidance(uncond, cond, scale)
        mimic = classifier_free_guidance(uncond, cond, mimic_scale)
        b, c = guided.shape[:2]
        flat, flat_mimic = guided.reshape(b, c, -1), mimic.reshape(b, c, -1)
        mean = flat.mean(-1, keepdims=True)
        centred = flat - mean
        mimic_max = jnp.abs(flat_mimic - flat_mimic.mean(-1, keepdims=True)).max(-1, keepdims=True)
        s = jnp.maximum(jnp.quantile(jnp.abs(centred), percentile, axis=-1, keepdims=True), mimic_max)
        return (jnp.clip(centred, -s, s) * (mimic_max / s) + mean).reshape(guided.shape)

    return guidance


def guided_model(unet_fn, context, guidance_scale, guidance=classifier_free_guidance, with_unconditional=False):
    """One UNet call on the doubled batch [unconditional; conditional], combined by `guidance`.

    `unet_fn(x, t, context) -> prediction`; `context` is (2B, T, D), unconditional rows first. Called as
    `model(x, t, i)` (see `denoise(..., model_takes_step=True)`) it calls `unet_fn(x, t, context, i)`, so that
    UNet wrappers can depend on the evaluation index (ControlNet's guidance window). `with_unconditional`:
    `(prediction, unconditional prediction)`, for a scheduler that takes both (CFG++).
    """

    def model(x, t, *step):
        out = unet_fn(jnp.concatenate([x, x]), t, context, *step).astype(jnp.float32)
        uncond, cond = jnp.split(out, 2)
        guided = guidance(uncond, cond, guidance_scale)
        return (guided, uncond) if with_unconditional else guided

    return model


def conditional_model(unet_fn, context):
    """The UNet on the conditional batch alone (B rows): no classifier-free guidance, as for guidance scales <= 1."""

    def model(x, t, *step):
        return unet_fn(x, t, context, *step).astype(jnp.float32)

    return model


def chunked_model(unet_fn, context, chunks, combine):
    """One UNet call on `chunks` copies of the batch, each with its rows of `context` (chunks * B, T, D), and
    `combine(*outputs) -> prediction` (perturbed-attention guidance: [uncond; cond; perturbed])."""

    def model(x, t, *step):
        out = unet_fn(jnp.concatenate([x] * chunks), t, context, *step).astype(jnp.float32)
        return combine(*jnp.split(out, chunks))

    return model


def step_key(key, i):
    """The key of evaluation i: the sampler's key folded with i, or each image's key folded with i."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if key.ndim == (0 if typed else 1):
        return jax.random.fold_in(key, i)
    return jax.vmap(jax.random.fold_in, (0, None))(key, i)


# The scopes of the model evaluations being traced (innermost last): how hooks inside the UNet (sdflax.hooks) send
# values out of the scan and carry them to the next evaluation without changing the UNet's signature.
_local = threading.local()


class Scope:
    """What the hooks of one model evaluation share: its index, memory in, memory out, emitted values."""

    def __init__(self, step, memory, latent_size, num_evals, sealed=None, num_steps=None, batch=None):
        self.step, self.latent_size = step, tuple(latent_size)  # latent_size: the (h, w) of the latents
        self.batch = batch  # the sampler's rows (the model's batch holds a chunk of them per guidance pass)
        self.num_evals = num_evals  # evaluations in the scan
        self.num_steps = num_steps  # the call's steps as diffusers counts a guidance interval's (sdflax.guiders)
        self.memory = dict(memory) if memory is not None else None  # None: memory's shapes are being found
        self._emitted, self._sums = {}, {}
        self.sealed = sealed  # why values cannot leave from here (inside a lax.cond), or None

    def sealed_copy(self, reason) -> "Scope":
        """A scope of the same evaluation out of which nothing may be emitted or carried (e.g. inside a lax.cond,
        whose branches' values cannot leave it)."""
        return Scope(self.step, None, self.latent_size, self.num_evals, sealed=reason, num_steps=self.num_steps,
                     batch=self.batch)

    def _check(self):
        if self.sealed:
            raise ValueError(self.sealed)

    def emit(self, key, value):
        """Send (B, ...) out of the scan as trajectory.hooks[key] (evals, B, ...)."""
        self._check()
        if key in self._emitted or key in self._sums:
            raise ValueError(f"hook value {key!r} emitted twice in one evaluation: give each its own key")
        self._emitted[key] = value

    def emit_mean(self, key, value):
        """Send out the mean of the (B, ...) values given under key in this evaluation (e.g. over layers)."""
        self._check()
        total, count = self._sums.get(key, (0, 0))
        self._sums[key] = (total + value, count + 1)

    @property
    def emitted(self) -> dict:
        return {**self._emitted, **{key: total / count for key, (total, count) in self._sums.items()}}

    def read(self, key):
        """What the previous evaluation wrote under key; None while the memory's shapes are being found."""
        self._check()
        return None if self.memory is None else self.memory[key]

    def write(self, key, value):
        self._check()
        if self.memory is None:
            self.memory = {}
        self.memory[key] = value


@contextlib.contextmanager
def scope(step, memory=None, latent_size=(), num_evals=None, within=None, num_steps=None, batch=None):
    """Open the scope of a model evaluation (or, `within` a Scope, its copy `within.sealed_copy(reason)`)."""
    stack = _local.__dict__.setdefault("scopes", [])
    stack.append(within or Scope(step, memory, latent_size, num_evals, num_steps=num_steps, batch=batch))
    try:
        yield stack[-1]
    finally:
        stack.pop()


def current_scope() -> Scope:
    stack = getattr(_local, "scopes", [])
    if not stack:
        raise RuntimeError("a hook that emits or carries values runs only inside sampling.denoise (a pipeline call)")
    return stack[-1]


@contextlib.contextmanager
def batch_split(axis):
    """While a program is traced whose batch is split over the devices of mesh axis `axis` (the runner's pmap and
    sharded programs): `batch_sum` adds over them."""
    previous = getattr(_local, "batch_axis", None)
    _local.batch_axis = axis
    try:
        yield
    finally:
        _local.batch_axis = previous


def batch_sum(x):
    """`x`, a sum over this device's rows, summed over the devices the batch is split over: the whole batch's, as
    one device computes it (a hook's statistic of the batch decides alike on every device)."""
    axis = getattr(_local, "batch_axis", None)
    return x if axis is None else jax.lax.psum(x, axis)


def _zeros_like(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


class Trajectory(NamedTuple):
    """What the scan stacks at each model evaluation, (evals, *latents.shape) each."""

    latents: Any  # x after the step
    pred_x0: Any  # the scheduler's x̂₀ from that evaluation's prediction
    hooks: Any = None  # {key: (evals, B, ...)}: what hooks emitted (sdflax.hooks), without return_trajectory too


def denoise(model, scheduler, latents, num_inference_steps, key, use_scan=True, callback=None,
            return_trajectory=False, state=None, post_step=None, model_takes_step=False, num_evals=None,
            memory=False, num_steps=None):
    """Run the sampler from `latents` (already scaled by the scheduler's init_noise_sigma) to x₀'s latents.

    `model(x, t) -> prediction` in the scheduler's `prediction_type`, or `(prediction, unconditional prediction)`
    for a scheduler that takes the second as `step(..., unconditional=)` (CFG++). `use_scan=False` runs the same steps
    as a Python loop, for debugging (print, breakpoints); it gives the same result.
    `callback(step, num_steps, latents)` runs on the host after every model evaluation (progress bars,
    previews), through `jax.debug.callback`, so the loop stays one compiled scan.
    `return_trajectory=True` returns `(latents, Trajectory)`. `state` is the scheduler's state to begin from
    (img2img begins part-way: `set_timesteps(n, shape, start=k)`); by default the whole schedule.
    `post_step(x, i, state) -> x` changes x after every step, before the callback and trajectory see it
    (inpainting with an ordinary UNet pastes the known region back). With `model_takes_step=True` the model is
    called as `model(x, t, i)`, i the index of the evaluation. `num_evals` stops after that many evaluations of
    `state`'s schedule (SDXL's `denoising_end`: the schedule is cut, not respaced). `num_steps`: the steps a guider's
    interval is a fraction of, as diffusers counts them (img2img's are those left after `strength`; a Heun step's
    two evaluations are two steps); by default `num_inference_steps`.

    Every model evaluation runs in a `Scope`: what hooks emit comes back stacked in
    `Trajectory.hooks` (a Trajectory is then returned with latents and pred_x0 None unless `return_trajectory`),
    and with `memory=True` what they write is carried to the next evaluation (its shapes found by tracing one
    evaluation, its first value zeros).

    Each step is a `jax.checkpoint`: differentiating through the sampler keeps only the carry of every step
    and recomputes the UNet's activations one step at a time, so memory does not grow with the UNet per step.
    """
    if state is None:
        state = scheduler.set_timesteps(num_inference_steps, shape=latents.shape)
    num_evals = state.timesteps.shape[0] if num_evals is None else num_evals
    steps = jnp.arange(num_evals)

    def evaluate(x, state, i, memory):
        model_input = scheduler.scale_model_input(state, x, i)
        with scope(i, memory, x.shape[-2:], num_evals, batch=x.shape[0],
                   num_steps=num_inference_steps if num_steps is None else num_steps) as opened:
            prediction = model(model_input, state.timesteps[i], *((i,) if model_takes_step else ()))
        return prediction, opened

    memory = _zeros_like(jax.eval_shape(
        lambda x, state: evaluate(x, state, 0, None)[1].memory, latents, state)) if memory else None

    @jax.checkpoint
    def step(carry, i):
        x, state, memory = carry
        prediction, hooks = evaluate(x, state, i, memory)
        extra = {}
        if isinstance(prediction, tuple):  # (guided, unconditional), for CFG++
            prediction, extra["unconditional"] = prediction
        pred_x0 = scheduler.predict_x0(state, prediction, i, x) if return_trajectory else None
        x, state = scheduler.step(state, prediction, i, x, key=step_key(key, i), **extra)
        if post_step is not None:
            x = post_step(x, i, state)
        if callback is not None:
            jax.debug.callback(lambda i, x: callback(int(i), num_evals, x), i, x)
        out = Trajectory(x if return_trajectory else None, pred_x0, hooks.emitted or None)
        return (x, state, hooks.memory), out

    if use_scan:
        (latents, _, _), trajectory = jax.lax.scan(step, (latents, state, memory), steps)
    else:
        carry, outputs = (latents, state, memory), []
        for i in steps:
            carry, out = step(carry, i)
            outputs.append(out)
        latents = carry[0]
        trajectory = jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)
    if not return_trajectory:
        return latents if trajectory.hooks is None else (latents, trajectory)
    return latents, trajectory
