"""SD 3's skip-layer guidance as diffusers' StableDiffusion3Pipeline takes it (`skip_guidance_layers=[7, 8, 9]`,
`skip_layer_guidance_scale`, `_start`, `_stop`): its checks, and the `SkipLayerGuidance` guider it becomes."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from ..guiders.perturbed import LayerSkipConfig, PipelineSkipLayerGuidance


def skip_layer_guider(args, inputs):
    """SD 3's skip_guidance_layers= and skip_layer_guidance_* as the SkipLayerGuidance they are, with the window of
    diffusers' pipeline; the CFG and skip-layer scales stay traced, the blocks and the window are static."""
    ends = [args[f"skip_layer_guidance_{end}"] for end in ("start", "stop")]
    if any(isinstance(end, jax.core.Tracer) for end in ends):
        raise ValueError("skip_layer_guidance_start and skip_layer_guidance_stop fix which steps run the skipped "
                         "pass (static): give numbers, not traced values")
    start, stop = (float(np.asarray(end).reshape(-1)[0]) for end in ends)
    return PipelineSkipLayerGuidance(
        guidance_scale=inputs.guidance_scale, guidance_rescale=inputs.guidance_rescale,
        skip_layer_guidance_scale=jnp.asarray(args["skip_layer_guidance_scale"], jnp.float32),
        skip_layer_guidance_start=start, skip_layer_guidance_stop=stop,
        skip_layer_config=LayerSkipConfig(args["skip_guidance_layers"], fqn="transformer_blocks"))


def check_skip_layers(spec, layers) -> tuple:
    """Skip-layer guidance's blocks as a tuple of block indices of the transformer."""
    count = getattr(spec.denoiser.model.config, "num_layers", 0)
    given = [layers] if isinstance(layers, numbers.Integral) else layers
    if not isinstance(given, (list, tuple)) or not given or not all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < count for i in given):
        raise ValueError(f"skip_guidance_layers={layers!r}: give the transformer blocks to skip, a list of indices in "
                         f"0 .. {count - 1} (SD 3.5 Medium: [7, 8, 9])")
    return tuple(int(i) for i in given)


def check_skip_layer_window(args, steps: int):
    """Skip-layer guidance's start and stop: finite fractions, start <= stop, and a window that holds a step (it runs
    at the evaluations i with steps · start < i < steps · stop, as diffusers' SD 3 pipeline), else it would be
    recorded and never run. Traced values are the caller's to check."""
    start, stop = (args.get(f"skip_layer_guidance_{end}") for end in ("start", "stop"))
    if isinstance(start, jax.core.Tracer) or isinstance(stop, jax.core.Tracer):
        return
    start, stop = np.float32(np.asarray(start).reshape(-1)[0]), np.float32(np.asarray(stop).reshape(-1)[0])
    if not (np.isfinite(start) and np.isfinite(stop) and 0 <= start <= stop <= 1):
        raise ValueError(f"skip_layer_guidance_start={start:.6g} and skip_layer_guidance_stop={stop:.6g} must be "
                         "fractions of the steps with 0 <= start <= stop <= 1")
    if not any(steps * start < i < steps * stop for i in range(steps)):
        raise ValueError(f"skip-layer guidance from {start:.6g} to {stop:.6g} of {steps} steps runs at no step (it "
                         "runs at the steps i with steps * start < i < steps * stop): run more steps, or widen "
                         "skip_layer_guidance_start / skip_layer_guidance_stop")
