"""LoRA (Hu et al. 2021) files merged into a params pytree: W' = W + scale * (alpha / rank) * up @ down.

Two naming schemes are in circulation and both are read:

    kohya / A1111:     lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight / .lora_up.weight / .alpha
                       lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight ...
                       SDXL: lora_te1_* (text_encoder), lora_te2_* (text_encoder_2), and the UNet in the original
                       (LDM) names kohya's SDXL trainer writes: lora_unet_input_blocks_4_1_proj_in, ...
    diffusers / PEFT:  unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight / .lora_B.weight
                       text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight, text_encoder_2.* ...
                       (older diffusers: ...attn1.processor.to_q_lora.down.weight, ...to_q.lora.down.weight)

Both name a module by its PyTorch path, which is our module path with "." -> "_" (see weights.py), so a target
is found by name alone. Original UNet names (input_blocks / middle_block / output_blocks) go through the LDM
table of single-file checkpoints (`ldm_names.unet_table`), built from the UNet's config. The transformers' layouts
are read into the same pytree by `flux_lora.py` (Flux.1: diffusers, kohya, XLabs, Black Forest Labs) and
`sd3_lora.py` (SD 3.x: diffusers, kohya / ComfyUI in Stability's MMDiT names), through the helpers below
(`grouped`, `resolve`, `transformer_key`).

`read_lora` turns a file into a small pytree (torch-layout `down`/`up` and `alpha` per target kernel);
`merge_lora` is a pure function of (params, lora, scale), so LoRAs stack by calling it twice and
`jax.jit(merge_lora)` takes the scale as a traced value: a new scale does not recompile.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from .files import read_checkpoint, safetensors_metadata
from .ldm_names import map_key, unet_table
from ..utils import is_float32
from .weights import short_list

__all__ = ["LoraMismatchError", "load_lora", "merge_lora", "read_lora"]

COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3")

# Name prefix -> (component, separator between module names in the rest of the key).
PREFIXES = {
    "lora_unet_": ("unet", "_"),
    "lora_te_": ("text_encoder", "_"),
    "lora_te1_": ("text_encoder", "_"),
    "lora_te2_": ("text_encoder_2", "_"),
    "lora_te3_": ("text_encoder_3", "_"),  # SD 3's T5
    "unet.": ("unet", "."),
    "text_encoder.": ("text_encoder", "."),
    "text_encoder_2.": ("text_encoder_2", "."),
    "text_encoder_3.": ("text_encoder_3", "."),
}

# Key suffix -> role of the tensor. Longest first, so ".lora.down.weight" is not taken for "_lora.down.weight".
ROLES = {
    ".lora_linear_layer.down.weight": "down",
    ".lora_linear_layer.up.weight": "up",
    ".lora_down.weight": "down",
    ".lora_up.weight": "up",
    ".lora.down.weight": "down",
    ".lora.up.weight": "up",
    "_lora.down.weight": "down",
    "_lora.up.weight": "up",
    ".lora_A.weight": "down",
    ".lora_B.weight": "up",
    ".alpha": "alpha",
}

# Older diffusers attention-processor names -> module names (UNet Attention / CLIP self-attention).
PROCESSOR_RENAMES = {
    "unet": {"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out.0"},
    "text_encoder": {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"},
}
PROCESSOR_RENAMES["text_encoder_2"] = PROCESSOR_RENAMES["text_encoder"]

# Wrappers some writers put in front of the module path.
STRIP = ("base_model.model.", "text_model.", "text_model_")
# The text encoders' prefixes in the transformer families' files (`transformer_key`), and what a transformer's keys
# may start with (diffusers', kohya's, OneTrainer's, ComfyUI's, PEFT's), the rest a module name joined by "." or "_"
TEXT_PREFIXES = tuple(p for p in PREFIXES if p.startswith(("lora_te", "text_encoder")))
TRANSFORMER_PREFIXES = ("transformer.", "lora_transformer_", "lora_unet_", "model.diffusion_model.",
                        "diffusion_model.", "base_model.model.")


# The width of the text states a UNet's cross-attention reads (its attn2.to_k input) -> the family that has it
FAMILIES = {768: "SD 1.x", 1024: "SD 2.x", 2048: "SDXL"}
# Names only one family's LoRAs have: SDXL's two text encoders (kohya's te1 / te2, diffusers' text_encoder_2), and
# kohya's one text encoder of SD 1.x / 2.x (its SDXL files say te1 and te2)
SDXL_NAMES = ("lora_te1_", "lora_te2_", "text_encoder_2.")
SD_NAMES = ("lora_te_",)
# Names only Flux.1's LoRAs have, in any of its layouts: BFL's and kohya's blocks, diffusers' single-stream blocks,
# kohya's diffusers-named flavour
FLUX_BLOCKS = r"(^|[._])(double_blocks|single_blocks|single_transformer_blocks)[._]\d"
FLUX_NAMES = re.compile(FLUX_BLOCKS + "|^lora_transformer_")
# Names of a UNet's LoRAs (SD 1.x / 2.x, SDXL; kohya's diffusers and LDM names, diffusers')
UNET_NAMES = re.compile(r"lora_unet_(down_blocks|mid_block|up_blocks|input_blocks|middle_block|output_blocks)_|unet\.")
# Names of SD 3's MMDiT in Stability's layout (kohya's, ComfyUI's)
SD3_NAMES = re.compile(r"(^|[._])joint_blocks[._]\d")


MODULE_NAME = re.compile(r"[A-Za-z0-9_.]{1,256}")


class LoraMismatchError(ValueError):
    """The LoRA file names modules the model does not have, or its shapes do not fit them."""


def ldm_names(unet_config) -> dict:
    """`ldm_names.unet_table` with every "_" in its names read as ".": kohya flattens the LDM module path with
    "_" (input_blocks_4_1_proj_in), so that name with "_" -> "." looks up in it through `ldm_names.map_key`."""
    def dots(name):
        return name.replace("_", ".")

    table = {}
    for ldm, entry in unet_table(unet_config).items():
        if isinstance(entry, tuple):  # (diffusers prefix, leaf renames such as in_layers.2 -> conv1)
            entry = (entry[0], {dots(leaf): target for leaf, target in entry[1].items()})
        table[dots(ldm)] = entry
    return table


def split_key(key: str, ldm=None):
    """'unet.a.b.lora_A.weight' -> ('unet', 'a.b', 'a_b', 'down'); None for keys that are not LoRA tensors.

    The second item is the module's PyTorch name (what PEFT's alpha_pattern matches), the third our flat name.
    `ldm` (from `ldm_names`) maps kohya's original UNet names; no LDM name is also a diffusers one.
    """
    suffix = next((s for s in ROLES if key.endswith(s)), None)
    if suffix is None:
        return None
    stem = key[: -len(suffix)]
    prefix = next((p for p in PREFIXES if stem.startswith(p)), "")
    component, sep = PREFIXES.get(prefix, ("unet", "."))  # no prefix: a file of UNet tensors only
    stem = stem[len(prefix):]
    if sep == ".":
        parts = [p for p in stem.split(".") if p != "processor"]
        if suffix.startswith("_lora."):  # ...attn1.processor.to_q_lora.down.weight
            parts[-1] = PROCESSOR_RENAMES[component].get(parts[-1], parts[-1])
        stem = ".".join(parts)
    flat = stem
    for wrapper in STRIP:
        flat = flat.removeprefix(wrapper)
    if component == "unet" and sep == "_" and ldm is not None:
        names = map_key(flat.replace("_", "."), ldm)  # input.blocks.4.1.proj.in -> down_blocks.1.attentions.0.proj.in
        flat = names[0].replace(".", "_") if names else flat
    return component, stem, flat.replace(".", "_"), ROLES[suffix]


def peft_alphas(path) -> dict:
    """{component: (lora_alpha, alpha_pattern, use_rslora)} from diffusers' `lora_adapter_metadata`, if present."""
    if not str(path).endswith(".safetensors"):
        return {}
    raw = safetensors_metadata(path).get("lora_adapter_metadata")
    if not raw:
        return {}
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict):
            raise TypeError(f"a JSON object, not {type(meta).__name__}")
        out = {}
        for component in COMPONENTS:
            if f"{component}.lora_alpha" in meta:
                pattern = meta.get(f"{component}.alpha_pattern") or {}
                if not isinstance(pattern, dict):
                    raise TypeError(f"{component}.alpha_pattern must be an object")
                # PEFT reads the keys as regular expressions; diffusers writes module names. A file's regex is
                # not run here: it can be malformed or backtrack for minutes.
                for key in pattern:
                    if not MODULE_NAME.fullmatch(str(key)):
                        raise TypeError(f"{component}.alpha_pattern key {str(key)[:60]!r} is not a module name "
                                        "(letters, digits, '_' and '.')")
                alphas = [float(meta[f"{component}.lora_alpha"]), *(float(v) for v in pattern.values())]
                if not all(math.isfinite(a) for a in alphas):
                    raise ValueError(f"{component}: lora_alpha and alpha_pattern values must be finite numbers")
                out[component] = (alphas[0], {str(k): float(v) for k, v in pattern.items()},
                                  bool(meta.get(f"{component}.use_rslora", False)))
    except (ValueError, TypeError, RecursionError, OverflowError) as e:  # OverflowError: float() of a huge int
        raise LoraMismatchError(f"LoRA file {os.fspath(path)}: its lora_adapter_metadata is not a diffusers LoRA "
                                f"config ({' '.join(str(e).split())[:200]})") from None
    return out


def peft_alpha(module_path: str, lora_alpha, alpha_pattern, use_rslora, rank):
    # PEFT matches pattern keys against the end of the dotted module name.
    for pattern, value in alpha_pattern.items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module_path):
            lora_alpha = float(value)
            break
    return lora_alpha * np.sqrt(rank) if use_rslora else lora_alpha  # rsLoRA scales by alpha / sqrt(rank)


def kernel_index(params) -> tuple[dict, dict]:
    """({'down_blocks_0_attentions_0_proj_in': path of its kernel}, flat params) for one model's layers."""
    flat = traverse_util.flatten_dict(params)
    return {"_".join(path[:-1]): path for path in flat if path[-1] == "kernel"}, flat


def expected_kernel(down, up, kernel_ndim):
    """The Flax kernel shape that up @ down gives: (in, out) or HWIO, or None if the two do not chain."""
    if up.ndim not in (2, 4) or down.ndim not in (2, 4):
        return None
    rank = down.shape[0]
    if up.shape[1] != rank or up.shape[2:] not in ((), (1, 1)):
        return None
    out, inp, window = up.shape[0], down.shape[1], tuple(down.shape[2:]) or (1, 1)
    if kernel_ndim == 2:
        return (inp, out) if window == (1, 1) else None
    return (*window, inp, out)


@dataclasses.dataclass
class Problems:
    """The tensors of a LoRA file that do not fit, by kind, for its one-line error."""

    unknown: list = dataclasses.field(default_factory=list)  # targets the model lacks
    mismatched: list = dataclasses.field(default_factory=list)  # messages: shapes, rank 0, alphas
    incomplete: list = dataclasses.field(default_factory=list)  # a down without its up, or the reverse
    not_finite: list = dataclasses.field(default_factory=list)
    not_lora: list = dataclasses.field(default_factory=list)
    unsupported: dict = dataclasses.field(default_factory=dict)  # what -> keys: LoRA tensors sdflax does not merge

    def line(self, name, hint="") -> str | None:
        problems = []
        if self.unknown:
            problems.append(f"targets not in the model{hint}: {short_list(set(self.unknown))}")
        if self.mismatched:
            problems.append("shape mismatch: " + "; ".join(list(dict.fromkeys(self.mismatched))[:8]))
        if self.incomplete:
            problems.append(f"down/up pairs with a half missing: {short_list(self.incomplete)}")
        if self.not_finite:
            problems.append(f"values that are not finite (NaN or inf): {short_list(set(self.not_finite))}")
        for what, keys in self.unsupported.items():
            problems.append(f"{what}: {short_list(keys)}")
        if self.not_lora:
            problems.append("not LoRA tensors (LoHa/LoKr/DoRA and Tucker LoRA are not supported): "
                            + short_list(self.not_lora))
        return f"LoRA file {name} does not fit this pipeline: " + " | ".join(problems) if problems else None


def lora_entry(parts, up, kernel_shape, default_alpha, problems: Problems) -> dict | None:
    """{"down", "up", "alpha"} of one target kernel (`up`: the rows of `parts`' up that reach it), or None with
    what is wrong added to `problems`. `default_alpha(rank)`: the alpha where the file stores none."""
    down = parts["down"][1]
    if expected_kernel(down, up, len(kernel_shape)) != kernel_shape:
        problems.mismatched.append(f"{parts['down'][0]}: down {down.shape} and up {up.shape} do not make a kernel "
                                   f"of {kernel_shape} (Flax layout)")
        return None
    rank = down.shape[0]
    if rank == 0:
        problems.mismatched.append(f"{parts['down'][0]}: rank 0 (down {down.shape}), an empty LoRA")
        return None
    bad = next((parts[role][0] for role in ("down", "up") if not np.isfinite(parts[role][1]).all()), None)
    if bad is not None:  # merged, they would make a black image
        problems.not_finite.append(bad)
        return None
    if "alpha" not in parts:
        return {"down": down, "up": up, "alpha": np.float32(default_alpha(rank))}
    stored = np.asarray(parts["alpha"][1], np.float32)
    if stored.size != 1 or not np.isfinite(stored).all():
        problems.mismatched.append(f"{parts['alpha'][0]}: alpha must be one finite number, got {stored.shape} "
                                   f"{stored.ravel()[:4]}")
        return None
    return {"down": down, "up": up, "alpha": np.float32(stored.reshape(()))}


def grouped(tensors, parse) -> tuple[dict, Problems]:
    """A file's tensors by the module they adapt: {(component, module "_"-joined): {"name": its PyTorch name,
    role: (key, array)}}, and the Problems the keys that are not LoRA tensors start. `parse(key)` -> (component,
    PyTorch module name, module "_"-joined, role) or None."""
    groups, problems = {}, Problems()
    for key, array in tensors.items():
        parsed = parse(key)
        if parsed is None:
            problems.not_lora.append(key)
            continue
        component, torch_name, module, role = parsed
        groups.setdefault((component, module), {"name": torch_name})[role] = (key, np.asarray(array))
    return groups, problems


def resolve(groups, indexes, peft, problems, table=None) -> dict:
    """`grouped`'s groups -> {component: {"a/b/kernel": {"down", "up", "alpha"}}}, what does not fit added to
    `problems`. `indexes`: `kernel_index` per component; `peft`: `peft_alphas`; `table`: a transformer's original
    module names -> (the "_"-joined modules each adapts, whether its up's halves swap), a fused layer's up cut by
    rows into its targets' (`rows`), one down shared; any other name adapts the module it names."""
    lora = {}
    for (component, module), parts in sorted(groups.items()):
        torch_name = parts.pop("name")
        if not parts:
            continue
        keys = [k for k, _ in parts.values()]
        if "down" not in parts or "up" not in parts:
            problems.incomplete.extend(keys)
            continue
        index, weights = indexes.get(component, ({}, {}))
        targets, swapped = (table or {}).get(module, ((module,), False)) if component == "transformer" else \
            ((module,), False)
        paths = [index.get(t) for t in targets]
        if None in paths:
            problems.unknown.extend(k for k in keys if not k.endswith(".alpha"))
            continue
        ups = rows(parts["up"], [weights[p].shape[-1] for p in paths], swapped, problems)
        default = (lambda rank: peft_alpha(torch_name, *peft[component], rank)) if component in peft else float
        for path, up in zip(paths, ups):
            entry = lora_entry(parts, up, tuple(weights[path].shape), default, problems)  # no alpha: scale 1
            if entry is not None:
                lora.setdefault(component, {})["/".join(path)] = entry
    return lora


def rows(up, widths, swapped, problems) -> list:
    """A LoRA's up (key, array) cut by rows into its targets' (`widths`: their output features), its halves swapped
    where Stability's and BFL's (shift, scale) is diffusers' (scale, shift); [] with the mismatch added to
    `problems`."""
    key, array = up
    if np.ndim(array) == 0 or array.shape[0] != sum(widths):
        if len(widths) == 1 and not swapped:
            return [array]  # `lora_entry` says what is wrong
        problems.mismatched.append(f"{key}: up {array.shape} does not split into {len(widths)} layers of "
                                   f"{' + '.join(map(str, widths))} rows")
        return []
    if swapped:
        array = np.concatenate(np.split(array, 2)[::-1])
    return np.split(array, np.cumsum(widths)[:-1])


def transformer_key(key, renames, roles=None):
    """A transformer family's key -> `grouped`'s (component, PyTorch name, module "_"-joined, role); None for a key
    that is not a LoRA tensor. `renames`: ComfyUI's text-encoder prefixes -> diffusers' (which `split_key` reads)."""
    for comfy, ours in renames.items():
        if key.startswith(comfy):
            key = ours + key[len(comfy):]
    if key.startswith(TEXT_PREFIXES):
        return split_key(key)
    roles = roles or ROLES
    suffix = next((s for s in roles if key.endswith(s)), None)
    if suffix is None:
        return None
    stem = key[: -len(suffix)]
    stem = stem[len(next((p for p in TRANSFORMER_PREFIXES if stem.startswith(p)), "")):]
    return "transformer", stem, stem.replace(".", "_"), roles[suffix]


def read_lora(path, params, unet_config=None) -> dict:
    """A LoRA file -> {component: {"a/b/kernel": {"down", "up", "alpha"}}} for the models in `params`.

    `params` is the pipeline's params dict ({"unet": ..., "text_encoder": ..., SDXL: "text_encoder_2": ...}); it is
    only read, to resolve the names and check the shapes. `unet_config` (`pipeline.unet.config`) lets kohya's
    original UNet names (lora_unet_input_blocks_*) resolve. Unknown targets and keys that are not LoRA tensors are
    an error that lists them. (A Flux.1 pipeline's LoRAs: `flux_lora.read_flux_lora`.)
    """
    name = os.fspath(path)
    tensors = read_checkpoint(name)
    ldm = None if unet_config is None else ldm_names(unet_config)
    groups, problems = grouped(tensors, lambda key: split_key(key, ldm))
    indexes = {c: kernel_index(params[c]) for c in COMPONENTS if c in params}
    lora = resolve(groups, indexes, peft_alphas(name), problems)

    hint = " (original UNet names: pass unet_config=pipeline.unet.config)" if ldm is None and any(
        re.match(r"lora_unet_(input_blocks|middle_block|output_blocks)_", k) for k in problems.unknown) else ""
    line = problems.line(name, hint)
    if line:
        raise LoraMismatchError(family_mismatch(name, list(tensors), groups, params, indexes.get("unet")) or line)
    if not lora:
        raise LoraMismatchError(f"LoRA file {name} holds no LoRA tensors")
    return lora


def family_mismatch(name, keys, groups, params, unet_index) -> str | None:
    """One line saying which model family a LoRA that does not fit was made for, and which this pipeline is, where
    its names (`SDXL_NAMES`, `SD_NAMES`) or its cross-attention width (`FAMILIES`) say so; else None."""
    xl = "text_encoder_2" in params
    width = None
    if unet_index is not None:
        index, flat = unet_index
        width = next((flat[path].shape[0] for module, path in index.items() if module.endswith("attn2_to_k")), None)
    ours = "SDXL" if xl else FAMILIES.get(width, "SD 1.x/2.x")
    theirs_width = next((parts["down"][1].shape[1] for (component, module), parts in groups.items()
                         if component == "unet" and module.endswith("attn2_to_k") and "down" in parts
                         and parts["down"][1].ndim == 2), None)
    downs = tuple(suffix for suffix, role in ROLES.items() if role == "down")  # one key per module
    named = lambda prefixes: any(k.startswith(prefixes) and k.endswith(downs) for k in keys)  # noqa: E731
    if any(FLUX_NAMES.search(k) for k in keys):  # before te1 / te2: kohya's Flux files name CLIP lora_te1_
        theirs, why = "Flux.1", "names of Flux's double- and single-stream blocks"
    elif any(SD3_NAMES.search(k) for k in keys):
        theirs, why = "SD 3.x", "names of SD 3's joint blocks"
    elif named(SDXL_NAMES) and not xl:
        theirs, why = "SDXL", "names of SDXL's two text encoders"
    elif named(SD_NAMES) and xl:
        theirs, why = FAMILIES.get(theirs_width, "SD 1.x/2.x"), "kohya's name of SD's one text encoder"
    elif theirs_width and width and theirs_width != width:
        theirs = FAMILIES.get(theirs_width, f"a model of {theirs_width}-wide text states")
        why = f"its cross-attention reads {theirs_width}-wide text states, this UNet's {width}"
    else:
        return None
    fix = ("load it with StableDiffusionXL" if theirs == "SDXL" else "load it with StableDiffusion3"
           if theirs == "SD 3.x" else "load it with StableDiffusion" if xl and theirs.startswith("SD")
           else "load it with sdflax.Flux" if theirs == "Flux.1" else f"use a LoRA made for {ours}")
    return f"{name} is a LoRA for {theirs}, this pipeline is {ours} ({why}): {fix}"


def unet_family(name, tensors, ours) -> str | None:
    """One line for a UNet's LoRA (SD 1.x / 2.x or SDXL: its cross-attention's width tells which) on the transformer
    family `ours`; None where its names are not a UNet's."""
    keys = list(tensors)
    if not any(UNET_NAMES.match(k) for k in keys):
        return None
    width = next((np.shape(tensors[k])[-1] for k in keys if re.search(r"attn2[._]to_k.*(lora_down|lora_A|down)"
                                                                       r"\.weight$", k)), None)
    theirs = FAMILIES.get(width, "SD 1.x/2.x or SDXL")
    fix = "StableDiffusionXL" if theirs == "SDXL" else "StableDiffusion" if width in FAMILIES else \
        "StableDiffusion or StableDiffusionXL"
    return f"{name} is a LoRA for {theirs}, this pipeline is {ours} (its names are a UNet's): load it with {fix}"

def _delta(down, up, kernel_shape):
    """(up @ down) in torch layout -> the Flax kernel layout: linear (in, out), conv HWIO. float32.

    With numpy inputs (an eager merge) the product is computed on the host: no compilation per layer shape.
    """
    xp = np if isinstance(down, np.ndarray) and isinstance(up, np.ndarray) else jnp
    rank = down.shape[0]
    up, down = up.reshape(up.shape[0], rank).astype(np.float32), down.reshape(rank, -1).astype(np.float32)
    product = up @ down if xp is np else jnp.matmul(up, down, precision=jax.lax.Precision.HIGHEST)
    if len(kernel_shape) == 2:
        return product.T  # (out, in) -> (in, out); a 1x1 conv LoRA on a linear layer is the same matrix
    kh, kw, inp, out = kernel_shape
    return product.reshape(out, inp, kh, kw).transpose(2, 3, 1, 0)  # OIHW -> HWIO


def merge_lora(params, lora, scale=1.0):
    """params with every LoRA target replaced by W + scale * (alpha / rank) * up @ down (a `"value"` entry: by that
    value, as diffusers loads the norm scales of Flux Control LoRAs); a pure function.

    `scale` may be a traced value (`jax.jit(merge_lora)(params, lora, scale)` compiles once for all scales).
    Sums are done in float32 and cast back to each weight's dtype.
    """
    merged = dict(params)
    for component, targets in lora.items():
        if component not in params:
            raise KeyError(f"the LoRA has weights for {component!r} but params holds only {sorted(params)}")
        flat = traverse_util.flatten_dict(params[component], sep="/")
        for name, w in targets.items():
            kernel = flat[name]
            if "value" in w:  # a weight the file replaces (Flux Control LoRAs' RMSNorm scales), at any scale
                flat[name] = jnp.asarray(w["value"]).astype(kernel.dtype)
                continue
            delta = _delta(w["down"], w["up"], kernel.shape)
            flat[name] = _add(kernel, delta, w["alpha"] / w["down"].shape[0], scale)
        merged[component] = traverse_util.unflatten_dict(flat, sep="/")
    return merged


@jax.jit
def _add(kernel, delta, alpha_over_rank, scale):
    return (kernel.astype(jnp.float32) + (scale * alpha_over_rank) * delta).astype(kernel.dtype)


def checked_scale(scale):
    """`scale`, where it is a finite float32 number or traced; else a ValueError."""
    if isinstance(scale, (int, float)) and not is_float32(scale):
        raise ValueError(f"LoRA scale must be a finite float32 number (1 is the LoRA's full strength, 0 leaves the "
                         f"model as it is), got {scale}")
    return scale


def load_lora(params, path, scale=1.0, unet_config=None):
    """Read a LoRA file and merge it into `params` (the pipeline's params dict) at `scale`."""
    checked_scale(scale)
    return merge_lora(params, read_lora(path, params, unet_config), scale)
