"""`from_config` / `from_pretrained` for the models, and `apply` that takes a bare params tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .layers import Kernels, resolve_kernels, shapes_only


class Pretrained:
    """Mixed into each model. Subclasses set `config_class`, define `dummy_inputs()` for shape inference and take
    a `kernels` field (`layers.Kernels`) that they hand to every layer.

    The models read no files: `from_pretrained` hands its work to the loading layer (`sdflax.loading.folders`),
    imported when called: importing a model loads no loader, and the loader keeps one path for every source.
    """

    def apply(self, variables, *args, **kwargs):
        if "params" not in variables:  # a bare params tree, as `from_pretrained` returns it
            variables = {"params": variables}
        return super().apply(variables, *args, **kwargs)

    @classmethod
    def from_config(cls, config: dict, dtype=jnp.float32, attention="auto", kernels: Kernels | None = None):
        """The model for a config.json dict; its kernels are `kernels`, or resolved here, once, for jax's first
        device and the `attention` choice."""
        if kernels is not None and attention not in ("auto", kernels.attention):
            raise ValueError(f"attention={attention!r} and kernels with attention={kernels.attention!r}: give the "
                             "choice in one place (resolve_kernels(attention))")
        return cls(cls.config_class.from_dict(config), dtype=dtype, kernels=kernels or resolve_kernels(attention))

    def param_shapes(self):
        """The params tree as ShapeDtypeStructs, traced without computing anything (`sdflax.cache.param_shapes`
        keeps them between processes)."""
        with shapes_only():
            return jax.eval_shape(lambda: self.init(jax.random.key(0), *self.dummy_inputs())["params"])

    def init_params(self, key):
        """Random params (for tests and benchmarks)."""
        return self.init(key, *self.dummy_inputs())["params"]

    @classmethod
    def from_pretrained(cls, path_or_repo_id, subfolder=None, revision=None, dtype=jnp.float32, variant=None,
                        **kwargs):
        """(module, params) from a diffusers/transformers model folder or hub id; `subfolder` e.g. "unet"."""
        from ..loading.folders import load_model

        return load_model(cls, path_or_repo_id, subfolder, revision, dtype, variant, **kwargs)
