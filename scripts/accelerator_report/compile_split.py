"""Where a setting's cold compile goes, model by model, and what scanning over the repeated layers would save of
it."""

from __future__ import annotations

import contextlib
import math
import statistics
import time

from .configs import TEXT_ENCODERS, configs_for
from .correctness import compare
from .models import model_calls, model_classes, random_params
from .timing import log, timed


def one_layer_configs(configs) -> dict:
    """{model: config} of the models whose layers repeat, each stack cut to one layer: the UNet's transformer
    stacks (SDXL's ten), CLIP's encoder layers. What a model whose repeated layers were one `lax.scan` body would
    compile, so its compile beside the whole model's bounds what scanning them could save."""
    cut = {}
    unet = configs.get("unet")
    if unet:
        layers = unet.get("transformer_layers_per_block", 1)
        per_block = layers if isinstance(layers, list) else [layers] * len(unet["block_out_channels"])
        if max(per_block) > 1:
            cut["unet"] = {**unet, "transformer_layers_per_block": [min(n, 1) for n in per_block]}
    for name in TEXT_ENCODERS:
        if name in configs and configs[name]["num_hidden_layers"] > 1:
            cut[name] = {**configs[name], "num_hidden_layers": 1}
    return cut


def compile_split(job, size, repeats):
    """Where a setting's cold compile goes: each model's call of `model_calls` at the job's batch, lowered and
    compiled alone on this device from the param shapes (no weights, no compile cache) with the kernels the speed
    jobs pick, as the pipeline's dtype. Beside a speed job's `compile_s` (the whole program, the sampling loop and
    the guidance around them included) they say which model's compile to shorten. Then what scanning over the
    repeated layers would save: `one_layer`, the same for the models of `one_layer_configs` (a bound); `scanned`,
    for the UNet with each stack of transformer layers one `lax.scan` (`scanned_transformer_stacks`); and
    `unet_runs`, both UNets run with the same random weights: seconds an evaluation, what scanning costs of the
    speed, and the scanned output against the plain one."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sdflax.loading.assemble import build_models
    from sdflax.cache import param_shapes

    jax.config.update("jax_enable_compilation_cache", False)
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    classes, batch = model_classes(job["family"]), job["batches"][0]
    configs = configs_for(job["family"], size)

    def compile_each(configs, names, what=""):
        """({name: module}, {name: times}, {name: compiled call}) of the models `names`."""
        modules = build_models(classes, configs, dtype, "auto")
        times, compiled = {}, {}
        for name, (function, inputs, keywords) in model_calls(modules, configs, batch).items():
            if name not in names:
                continue
            log(f"compile split {job['family']}: {name}{what} ...")
            params = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, dtype), param_shapes(modules[name]))
            start = time.perf_counter()
            lowered = jax.jit(function).lower(params, *inputs, **keywords)
            lowered_at = time.perf_counter()
            compiled[name] = lowered.compile()
            times[name] = {"lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at,
                           "stablehlo_lines": lowered.as_text().count("\n")}
        return modules, times, compiled

    modules, times, plain = compile_each(configs, set(classes))
    cut = one_layer_configs(configs)
    out = {"batch": batch, "dtype": jnp.dtype(dtype).name, "device": jax.devices()[0].device_kind, "models": times,
           "one_layer": compile_each({**configs, **cut}, set(cut), ", one layer a stack")[1]}
    if "unet" not in modules:
        return out
    with scanned_transformer_stacks():
        _, out["scanned"], scanned = compile_each(configs, {"unet"}, ", its stacks scanned")
    # both UNets on the same random weights and inputs
    _, shapes, keyword_shapes = model_calls(modules, configs, batch)["unet"]
    params = random_params(modules["unet"], dtype)
    keys = iter(jax.random.split(jax.random.key(0), len(shapes) + len(keyword_shapes)))
    draw = lambda shape: jax.random.normal(next(keys), shape.shape).astype(shape.dtype)  # noqa: E731
    inputs, keywords = [draw(shape) for shape in shapes], {k: draw(shape) for k, shape in keyword_shapes.items()}
    runs, outputs = {}, {}
    for name, call in (("plain", plain["unet"]), ("scanned", scanned["unet"])):
        log(f"compile split {job['family']}: the {name} UNet runs ...")
        first, seconds = timed(lambda i: outputs.__setitem__(name, call(params, *inputs, **keywords)
                                                             .block_until_ready()), repeats)
        runs[name] = {"first_call_s": first, "seconds_per_call": statistics.median(seconds),
                      "seconds_per_call_min": min(seconds), "seconds_per_call_max": max(seconds)}
    out["unet_runs"] = {**runs, "scanned_rel_l2": compare(outputs["scanned"], outputs["plain"], math.inf)["rel_l2"],
                        "output_std": float(np.asarray(outputs["plain"], np.float64).std())}
    return out


@contextlib.contextmanager
def scanned_transformer_stacks():
    """Within, the UNets built run each stack of two or more transformer layers as one `lax.scan` over the layers'
    params, stacked in the program (the params tree, and so loading, stay as they are): sdflax's `Transformer2DModel`
    with its loop of layers replaced, for `compile_split` to measure. Hooks, which address layers by name, would not
    see the layers inside the scan: an experiment, not a way sdflax runs."""
    import flax.linen as nn
    import jax

    from sdflax.models import unet

    class ScannedTransformer2DModel(unet.Transformer2DModel):
        @nn.compact
        def __call__(self, x, context):
            b, h, w, c = x.shape
            linear = self.config.use_linear_projection
            project = lambda name: (unet.Dense(c, dtype=self.dtype, name=name) if linear  # noqa: E731
                                    else unet.conv(c, kernel=1, name=name, dtype=self.dtype, kernels=self.kernels))
            hidden = unet.GroupNorm(self.config.norm_num_groups, 1e-6, self.dtype, name="norm")(x)
            hidden = project("proj_in")(hidden).reshape(b, h * w, c)
            block = lambda **where: unet.BasicTransformerBlock(  # noqa: E731
                self.heads, c // self.heads, self.config.upcast_attention, self.dtype, self.kernels, **where)
            names = [f"transformer_blocks_{i}" for i in range(self.layers)]
            if self.is_initializing() or self.layers == 1:  # the params, one tree a layer, as the loaders fill them
                for name in names:
                    hidden = block(name=name)(hidden, context)
            else:
                stacked = jax.tree.map(lambda *layers: jax.numpy.stack(layers),
                                       *(self.variables["params"][name] for name in names))
                step = lambda h, params: (block(parent=None).apply({"params": params}, h, context), None)  # noqa
                hidden = jax.lax.scan(step, hidden, stacked)[0]
            return x + project("proj_out")(hidden.reshape(b, h, w, c))

    plain = unet.Transformer2DModel
    unet.Transformer2DModel = ScannedTransformer2DModel
    try:
        yield
    finally:
        unet.Transformer2DModel = plain
