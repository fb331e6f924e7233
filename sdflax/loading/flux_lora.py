"""Flux.1 LoRA files -> the pytree `lora.merge_lora` merges, for the transformer, CLIP-L and T5. Four layouts are in
circulation, told apart key by key by their prefixes and suffixes (diffusers' `FluxLoraLoaderMixin` and its
converters read the same files):

    diffusers / PEFT:  transformer.transformer_blocks.0.attn.to_q.lora_A.weight / .lora_B.weight, text_encoder.*
                       (alphas from `lora_adapter_metadata` or `.alpha` keys; none: alpha = rank); kohya's
                       diffusers-named flavour lora_transformer_transformer_blocks_0_attn_to_q.lora_down.weight
    kohya / ComfyUI:   lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight / .lora_up.weight / .alpha,
                       diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight, lora_te1_* (CLIP),
                       lora_te2_* and text_encoders.t5xxl.transformer.* (T5)
    XLabs:             double_blocks.0.processor.qkv_lora1.down.weight / .up.weight (the image stream's qkv),
                       proj_lora1, qkv_lora2 / proj_lora2 (the text's); single_blocks.0.processor.qkv_lora (linear1's
                       q, k, v), proj_lora (linear2); no alphas (scale 1)
    Black Forest Labs: double_blocks.0.img_attn.qkv.lora_A.weight / .lora_B.weight (their Control LoRAs, whose
                       RMSNorm `.scale`s replace the model's; fal's Kontext LoRAs under base_model.model.)

kohya's, XLabs' and BFL's names go through `flux_names.flux_table`. A LoRA on a fused layer (an attention's qkv, a
single block's linear1) is one `down` shared by the layers it holds, its `up` cut by rows into theirs (q, k, v,
then the MLP's input), as diffusers' converters do; the final modulation's up has its halves swapped (BFL's
(shift, scale), diffusers' (scale, shift)).
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import numpy as np

from .files import read_checkpoint
from .flux_names import SWAPPED, flux_table
from .lora import (SD3_NAMES, LoraMismatchError, checked_scale, grouped, kernel_index, merge_lora, peft_alphas,
                   resolve, transformer_key, unet_family)

COMPONENTS = ("transformer", "text_encoder", "text_encoder_2")
# ComfyUI's text-encoder prefixes -> those `lora.split_key` reads
COMFY_TEXT = {"text_encoders.clip_l.transformer.": "text_encoder.", "text_encoders.t5xxl.transformer.": "text_encoder_2."}
# Key suffix -> role, the first that matches (".lora_down.weight" before XLabs' ".down.weight")
ROLES = {".lora_A.weight": "down", ".lora_B.weight": "up", ".lora_down.weight": "down", ".lora_up.weight": "up",
         ".down.weight": "down", ".up.weight": "up", ".alpha": "alpha", ".scale": "value", ".lora_B.bias": "bias"}
# XLabs' attention-processor LoRAs -> the BFL layer each adapts and how many of its targets (a single block's
# qkv_lora is linear1's q, k and v, without the MLP's input)
XLABS = {"double_blocks": {"qkv_lora1": ("img_attn.qkv", 3), "proj_lora1": ("img_attn.proj", 1),
                           "qkv_lora2": ("txt_attn.qkv", 3), "proj_lora2": ("txt_attn.proj", 1)},
         "single_blocks": {"qkv_lora": ("linear1", 3), "proj_lora": ("linear2", 1)}}


def flat(name: str) -> str:
    return name.replace(".", "_")


def lora_table(transformer) -> dict:
    """{BFL or XLabs module name, "_"-joined: (its diffusers targets, "_"-joined; whether its halves swap)} for the
    blocks of `transformer` (its params)."""
    count = lambda blocks: sum(1 for k in transformer if re.fullmatch(rf"{blocks}_\d+", k))  # noqa: E731
    bfl = flux_table(SimpleNamespace(num_layers=count("transformer_blocks"),
                                     num_single_layers=count("single_transformer_blocks")))
    names = {k: v if isinstance(v, tuple) else (v,) for k, v in bfl.items()}
    for blocks, ours in (("double_blocks", "transformer_blocks"), ("single_blocks", "single_transformer_blocks")):
        for i in range(count(ours)):
            names.update({f"{blocks}.{i}.processor.{processor}": names[f"{blocks}.{i}.{layer}"][:n]
                          for processor, (layer, n) in XLABS[blocks].items()})
    return {flat(k): (tuple(flat(t) for t in targets), k == SWAPPED) for k, targets in names.items()}


def load_flux_lora(params, path, scale=1.0):
    """Read a Flux.1 LoRA file and merge it into `params` (a Flux pipeline's params dict) at `scale`."""
    checked_scale(scale)
    return merge_lora(params, read_flux_lora(path, params), scale)


def read_flux_lora(path, params) -> dict:
    """A Flux.1 LoRA file -> {component: {"a/b/kernel": {"down", "up", "alpha"} or {"value"}}}, `lora.read_lora`'s
    pytree for `lora.merge_lora`: targets the model lacks, shapes that do not fit and tensors that are not LoRA
    weights are one error naming them, or the family the file was made for."""
    name = os.fspath(path)
    tensors = read_checkpoint(name)
    table = lora_table(params["transformer"])
    groups, problems = grouped(tensors, lambda key: transformer_key(key, COMFY_TEXT, ROLES))
    indexes = {c: kernel_index(params[c]) for c in COMPONENTS if c in params}
    scales = {"_".join(path[:-1]): path for path in indexes["transformer"][1] if path[-1] == "scale"}
    lora = {}
    for (component, module), parts in groups.items():
        if "value" in parts:
            replace_norm(parts.pop("value"), scales.get(table.get(module, ((module,),))[0][0]),
                         indexes["transformer"][1], lora, problems)
        if "bias" in parts:
            problems.unsupported.setdefault("LoRA biases (lora_B.bias, as Flux Control LoRAs have)", []).append(
                parts.pop("bias")[0])
    for component, targets in resolve(groups, indexes, peft_alphas(name), problems, table).items():
        lora.setdefault(component, {}).update(targets)

    line = problems.line(name)
    if line:
        raise LoraMismatchError(other_family(name, tensors, groups, indexes) or line)
    if not lora:
        raise LoraMismatchError(f"LoRA file {name} holds no LoRA tensors")
    return lora


def replace_norm(value, path, weights, lora, problems):
    """A norm scale the file replaces (BFL's Control LoRAs carry the q / k RMSNorms they were trained with)."""
    key, array = value
    if path is None:
        problems.unknown.append(key)
    elif array.shape != tuple(weights[path].shape):
        problems.mismatched.append(f"{key}: shape {array.shape}, the model's {tuple(weights[path].shape)}")
    elif not np.isfinite(array).all():
        problems.not_finite.append(key)
    else:
        lora.setdefault("transformer", {})["/".join(path)] = {"value": array}


def other_family(name, tensors, groups, indexes) -> str | None:
    """One line saying what a LoRA that does not fit was made for, where its names say it: SD 1.x / 2.x or SDXL (a
    UNet's names; the cross-attention's width tells which), SD 3 (Stability's joint_blocks), or a Flux Control
    LoRA (an image embedder taking control latents too); else None."""
    keys = list(tensors)
    unet = unet_family(name, tensors, "Flux.1")
    if unet:
        return unet
    if any(SD3_NAMES.search(k) for k in keys):
        return (f"{name} is a LoRA for SD 3.x, this pipeline is Flux.1 (names of SD 3's joint blocks): load it with "
                "StableDiffusion3")
    image_in = groups.get(("transformer", "img_in"), groups.get(("transformer", "x_embedder"), {})).get("down")
    index, weights = indexes["transformer"]
    features = weights[index["x_embedder"]].shape[0]
    if image_in is not None and np.ndim(image_in[1]) == 2 and image_in[1].shape[1] > features:
        return (f"{name} is a Flux Control LoRA (its img_in takes {image_in[1].shape[1]} features per token, the "
                f"latents' and a control image's; this transformer takes {features}): sdflax has no Flux Control "
                "pipeline yet")
    return None
