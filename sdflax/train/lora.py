"""LoRA training state as a pytree: {component: {"a/b/kernel": {"down": (r, in[, kh, kw]), "up": (out, r[, 1, 1])}}}
in PyTorch layout (PEFT's lora_A / lora_B), merged into the frozen params by `sdflax.loading.lora.merge_lora` inside the
loss, so the model modules stay as they are and only these arrays get gradients.

A target is named as PEFT names one (`target_modules`): a module whose PyTorch path ends with it ("to_q",
"to_out.0", "ff.net.0.proj"). Our module path joined with "_" is the PyTorch path joined with "_" (weights.py), so
the match is on those joined names; the PyTorch path itself, which the saved files need, comes back through
`TORCH_NAMES`.
"""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from .files import write_safetensors
from ..loading.lora import read_lora

# Joined-name pieces whose PyTorch path is not "_" -> "." at the numbers: {component: [(pattern, replacement)]}
TORCH_NAMES = {
    "unet": [(r"^(down_blocks|up_blocks)_(\d+)_(attentions|resnets)_(\d+)", r"\1.\2.\3.\4"),
             (r"^mid_block_(attentions|resnets)_(\d+)", r"mid_block.\1.\2")],
    "text_encoder": [(r"^encoder_layers_(\d+)", r"text_model.encoder.layers.\1"),
                     (r"^final_layer_norm", r"text_model.final_layer_norm")],
}
TORCH_NAMES["text_encoder_2"] = TORCH_NAMES["text_encoder"]
# the last segments a target may have in our names: "to_out_0" is "to_out.0", "self_attn_q_proj" "self_attn.q_proj"
TAIL_NAMES = [(r"transformer_blocks_(\d+)", r"transformer_blocks.\1"), (r"^self_attn_", "self_attn."),
              (r"^mlp_", "mlp.")]
KOHYA_PREFIXES = {"unet": "lora_unet_", "text_encoder": "lora_te_", "text_encoder_2": "lora_te2_"}
KOHYA_XL_PREFIXES = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}


def joined(name: str) -> str:
    return name.replace(".", "_")


def find_targets(params, targets) -> list[tuple[str, ...]]:
    """The kernel paths of `params` (one model's) whose module is a target: its joined path is a target's joined
    name or ends with "_" and it. Sorted."""
    wanted = [joined(t) for t in targets]
    found = []
    for path in traverse_util.flatten_dict(params):
        if path[-1] != "kernel":
            continue
        module = "_".join(path[:-1])
        if any(module == t or module.endswith("_" + t) for t in wanted):
            found.append(path)
    return sorted(found)


def torch_name(component: str, path) -> str:
    """The PyTorch module path of our kernel `path` ("down_blocks_0_attentions_0", "transformer_blocks_0", "attn1",
    "to_q", "kernel") -> "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"."""
    parts = list(path[:-1])
    for pattern, replacement in TORCH_NAMES.get(component, []):
        parts[0] = re.sub(pattern, replacement, parts[0])
    for i, part in enumerate(parts[1:], 1):
        for pattern, replacement in TAIL_NAMES:
            part = re.sub(pattern, replacement, part)
        parts[i] = re.sub(r"_(\d+)$", r".\1", part)  # to_out_0 -> to_out.0
    return ".".join(parts)


def init_lora(params, targets: dict, rank: int, key, init: str = "default") -> dict:
    """A fresh LoRA for `targets` ({component: [kernel path]}): A as PEFT initialises it ("default": Kaiming-uniform
    with a = √5, i.e. U(±1/√fan_in); "gaussian": N(0, 1/rank)), B zero, so training starts from the model itself."""
    flat_params = {c: traverse_util.flatten_dict(params[c]) for c in targets}
    lora = {}
    for component, paths in sorted(targets.items()):
        for path in paths:
            kernel = flat_params[component][path]
            *window, inp, out = kernel.shape  # (in, out) or HWIO
            down_shape = (rank, inp, *window)
            key, sub = jax.random.split(key)
            if init == "gaussian":
                down = jax.random.normal(sub, down_shape, jnp.float32) / rank
            else:
                bound = 1.0 / math.sqrt(inp * math.prod(window))
                down = jax.random.uniform(sub, down_shape, jnp.float32, -bound, bound)
            up = jnp.zeros((out, rank, *((1, 1) if window else ())), jnp.float32)
            lora.setdefault(component, {})["/".join(path)] = {"down": down, "up": up}
    return lora


def read_initial_lora(path, params, unet_config) -> tuple[dict, dict]:
    """(lora, alphas) from a LoRA file (`sdflax.loading.lora.read_lora`'s layouts): the trainable down/up in float32 and
    {component: {name: alpha}}."""
    lora, alphas = {}, {}
    for component, modules in read_lora(path, params, unet_config).items():
        for name, w in modules.items():
            lora.setdefault(component, {})[name] = {"down": jnp.asarray(w["down"], jnp.float32),
                                                    "up": jnp.asarray(w["up"], jnp.float32)}
            alphas.setdefault(component, {})[name] = float(w["alpha"])
    return lora, alphas


def with_alphas(lora, alphas) -> dict:
    """`lora` in `merge_lora`'s form: each target's alpha beside its down / up."""
    return {c: {name: {**w, "alpha": alphas[c][name]} for name, w in modules.items()} for c, modules in lora.items()}


def save_lora(path, lora, alphas, format="diffusers", sdxl=False, targets=None, overwrite=False):
    """Write a trained LoRA. "diffusers": PEFT's names (unet.<module>.lora_A.weight / lora_B.weight), with the
    LoRA config in the `lora_adapter_metadata` diffusers writes, so that `load_lora_weights` rebuilds the same
    adapter; "kohya": lora_unet_<module>.lora_down.weight / lora_up.weight / alpha, which A1111 and ComfyUI read
    (SDXL's text encoders as lora_te1_ / lora_te2_)."""
    if format not in ("diffusers", "kohya"):
        raise ValueError(f"save_lora: format={format!r}; choose 'diffusers' or 'kohya'")
    tensors, metadata = {}, {}
    for component, modules in lora.items():
        ranks, component_alphas = {}, {}
        for name, w in modules.items():
            module = torch_name(component, name.split("/"))
            down, up = np.asarray(w["down"], np.float32), np.asarray(w["up"], np.float32)
            if format == "diffusers":
                tensors[f"{component}.{module}.lora_A.weight"] = down
                tensors[f"{component}.{module}.lora_B.weight"] = up
            else:
                prefix = (KOHYA_XL_PREFIXES if sdxl else KOHYA_PREFIXES)[component] + joined(module)
                tensors[f"{prefix}.lora_down.weight"] = down
                tensors[f"{prefix}.lora_up.weight"] = up
                tensors[f"{prefix}.alpha"] = np.asarray(alphas[component][name], np.float32)
            ranks[module], component_alphas[module] = down.shape[0], alphas[component][name]
        if format == "diffusers":
            metadata.update(_peft_config(component, ranks, component_alphas, (targets or {}).get(component)))
    extra = {"lora_adapter_metadata": json.dumps(metadata, sort_keys=True)} if metadata else {}
    write_safetensors(path, tensors, {"format": "pt", **extra}, overwrite=overwrite)


def _peft_config(component, ranks, alphas, targets) -> dict:
    """PEFT's LoraConfig fields for one model, prefixed "<component>." as diffusers packs them: the most common
    rank and alpha, and the modules that differ in `rank_pattern` / `alpha_pattern`."""
    rank = max(set(ranks.values()), key=list(ranks.values()).count)
    alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    config = {"r": rank, "lora_alpha": alpha,
              "target_modules": sorted(targets) if targets else sorted(ranks),
              "rank_pattern": {m: r for m, r in ranks.items() if r != rank},
              "alpha_pattern": {m: a for m, a in alphas.items() if a != alpha}}
    return {f"{component}.{key}": value for key, value in config.items()}
