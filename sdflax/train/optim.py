"""The optimizer of diffusers' training scripts in optax: `clip_grad_norm_`, then `torch.optim.AdamW`, at the
learning rate of `diffusers.optimization.get_scheduler`, stepped once per optimizer update; and float16's dynamic
loss scale as accelerate runs `torch.amp.GradScaler`."""

from __future__ import annotations

import math

import flax
import jax
import jax.numpy as jnp
import optax

# torch.amp.GradScaler's defaults, which accelerate's fp16 uses: the first scale, its factors, and how many
# updates without an overflow double it
LOSS_SCALE_INIT = 2.0 ** 16
LOSS_SCALE_GROWTH = 2.0
LOSS_SCALE_BACKOFF = 0.5
LOSS_SCALE_GROWTH_INTERVAL = 2000


def learning_rate_schedule(config):
    """count (optimizer updates so far) -> learning rate: diffusers' schedules, warmup linear from 0."""
    peak, warmup, total = config.learning_rate, config.lr_warmup_steps, config.max_train_steps
    kind = config.lr_scheduler

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        if kind == "constant":
            return jnp.full((), peak, jnp.float32)
        ramp = count / max(1, warmup)
        if kind == "constant_with_warmup":
            factor = jnp.where(count < warmup, ramp, 1.0)
        else:
            progress = (count - warmup) / max(1, total - warmup)
            decay = (jnp.maximum(0.0, (total - count) / max(1, total - warmup)) if kind == "linear"
                     else jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(math.pi * 2.0 * 0.5 * progress))))
            factor = jnp.where(count < warmup, ramp, decay)
        return peak * factor

    return schedule


def clip_by_global_norm_torch(max_norm: float) -> optax.GradientTransformation:
    """torch.nn.utils.clip_grad_norm_: g * min(1, max_norm / (‖g‖ + 1e-6)), ‖g‖ the L2 norm of all gradients."""

    def update(updates, state, params=None):
        norm = optax.tree.norm(updates)
        factor = jnp.minimum(1.0, max_norm / (norm + 1e-6))
        return jax.tree.map(lambda g: g * factor.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def optimizer(config) -> optax.GradientTransformation:
    """Clipping (unless max_grad_norm is None), then AdamW with torch's update: decoupled weight decay on the
    weights before the step (the same as optax's decay term added to the Adam direction, both from the old
    weights), ε outside the square root, bias correction on both moments."""
    adamw = optax.adamw(learning_rate_schedule(config), b1=config.adam_beta1, b2=config.adam_beta2,
                        eps=config.adam_epsilon, weight_decay=config.adam_weight_decay)
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(clip_by_global_norm_torch(config.max_grad_norm), adamw)


def ema_decay_at(config, updates):
    """diffusers' EMAModel.get_decay after `updates` optimizer updates (no warmup): 0 at the first, then
    min(decay, (1 + n) / (10 + n)) with n = updates - 1."""
    n = jnp.asarray(updates, jnp.float32) - 1.0
    return jnp.where(n <= 0, 0.0, jnp.minimum(config.ema_decay, (1.0 + n) / (10.0 + n)))


def ema_update(ema, params, decay):
    """EMAModel.step: s ← s - (1 - decay) (s - p)."""
    return jax.tree.map(lambda s, p: s - (1.0 - decay) * (s - p), ema, params)


@flax.struct.dataclass
class LossScale:
    """float16's dynamic loss scale (`mixed_precision="fp16"`): the loss is multiplied by `scale` before the
    gradients are taken, so that small gradients survive float16, and the gradients divided by it after; an update
    whose gradients overflowed is skipped (the weights, Adam's state and the learning-rate schedule stay; accelerate
    steps its scheduler only after an update) and the scale halved."""

    scale: jnp.ndarray  # float32
    good_steps: jnp.ndarray  # int32: updates since the scale last changed (GradScaler's growth tracker)
    skipped: jnp.ndarray  # int32: updates skipped so far

    @classmethod
    def initial(cls) -> LossScale:
        return cls(scale=jnp.asarray(LOSS_SCALE_INIT, jnp.float32), good_steps=jnp.zeros((), jnp.int32),
                   skipped=jnp.zeros((), jnp.int32))

    def after(self, finite, growth_interval: int = LOSS_SCALE_GROWTH_INTERVAL) -> LossScale:
        """torch's `_amp_update_scale_`: halve on an overflow, double after `growth_interval` good updates."""
        good = jnp.where(finite, self.good_steps + 1, 0)
        grow = good == growth_interval
        scale = jnp.where(finite, jnp.where(grow, self.scale * LOSS_SCALE_GROWTH, self.scale),
                          self.scale * LOSS_SCALE_BACKOFF)
        return LossScale(scale=scale, good_steps=jnp.where(grow, 0, good),
                         skipped=self.skipped + jnp.where(finite, 0, 1))
