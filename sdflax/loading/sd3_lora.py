"""SD 3.x LoRA files -> the pytree `lora.merge_lora` merges, for the MMDiT, CLIP-L, CLIP-G and T5. The layouts in
circulation, told apart key by key by their prefixes (diffusers' `SD3LoraLoaderMixin` reads the first; ComfyUI's
`model_lora_keys_unet` / `model_lora_keys_clip` all):

    diffusers / PEFT:  transformer.transformer_blocks.0.attn.to_q.lora_A.weight / .lora_B.weight, text_encoder.*
                       (CLIP-L), text_encoder_2.* (CLIP-G); alphas from `lora_adapter_metadata` (none: alpha = rank)
    OneTrainer:        lora_transformer_transformer_blocks_0_attn_to_q.lora_down.weight / .lora_up.weight / .alpha
    kohya / ComfyUI:   lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight (Stability's MMDiT names, as its
                       single files, `ldm_names.mmdit_table`), diffusion_model.joint_blocks.0.context_block.attn.proj.*;
                       lora_te1_* (CLIP-L), lora_te2_* (CLIP-G), lora_te3_* (T5), text_encoders.clip_l.transformer.*

A LoRA on a fused qkv is one `down` shared by q, k and v, its `up` cut in thirds; the modulations Stability stores as
(shift, scale) (the final layer's, the last block's text stream's) have their up's halves swapped, as the single
files' weights. diffusers loads no T5 LoRA: sdflax merges kohya's lora_te3_ by the formula, as ComfyUI does.
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

from .files import read_checkpoint
from .ldm_names import mmdit_table, swapped_halves
from .lora import (FLUX_BLOCKS, LoraMismatchError, checked_scale, grouped, kernel_index, merge_lora, peft_alphas,
                   resolve, transformer_key, unet_family)

COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
COMFY_TEXT = {"text_encoders.clip_l.transformer.": "text_encoder.", "text_encoders.clip_g.transformer.":
              "text_encoder_2.", "text_encoders.t5xxl.transformer.": "text_encoder_3."}


def lora_table(transformer) -> dict:
    """{Stability's module name, "_"-joined: (its diffusers targets, "_"-joined; whether its halves swap)} for the
    blocks of `transformer` (its params)."""
    cfg = SimpleNamespace(num_layers=sum(1 for k in transformer if re.fullmatch(r"transformer_blocks_\d+", k)))
    swapped = {name.rpartition(".")[0] for name in swapped_halves(cfg)}
    table = {}
    for theirs, entry in mmdit_table(cfg).items():
        prefix, leaves = entry if isinstance(entry, tuple) else (entry, {"": ""})
        for leaf, ours in leaves.items():
            ours = tuple(".".join(filter(None, (prefix, o))) for o in (ours if isinstance(ours, tuple) else (ours,)))
            table[".".join(filter(None, (theirs, leaf))).replace(".", "_")] = (
                tuple(o.replace(".", "_") for o in ours), ours[0] in swapped)
    return table


def read_sd3_lora(path, params) -> dict:
    """An SD 3.x LoRA file -> {component: {"a/b/kernel": {"down", "up", "alpha"}}}, `lora.read_lora`'s pytree for
    `lora.merge_lora`: targets the model lacks, shapes that do not fit and tensors that are not LoRA weights are one
    error naming them, or the family the file was made for."""
    name = os.fspath(path)
    tensors = read_checkpoint(name)
    table = lora_table(params["transformer"])
    groups, problems = grouped(tensors, lambda key: transformer_key(key, COMFY_TEXT))
    indexes = {c: kernel_index(params[c]) for c in COMPONENTS if c in params}
    lora = resolve(groups, indexes, peft_alphas(name), problems, table)
    line = problems.line(name)
    if line:
        raise LoraMismatchError(other_family(name, tensors) or line)
    if not lora:
        raise LoraMismatchError(f"LoRA file {name} holds no LoRA tensors")
    return lora


def other_family(name, tensors) -> str | None:
    """One line saying what a LoRA that does not fit was made for where its names say it: Flux.1 (its blocks'
    names), SD 1.x / 2.x or SDXL (a UNet's); else None."""
    if any(re.search(FLUX_BLOCKS, k) for k in tensors):
        return (f"{name} is a LoRA for Flux.1, this pipeline is SD 3.x (names of Flux's double- and single-stream "
                "blocks): load it with sdflax.Flux")
    return unet_family(name, tensors, "SD 3.x")


def load_sd3_lora(params, path, scale=1.0):
    """Read an SD 3.x LoRA file and merge it into `params` (an SD 3 pipeline's params dict) at `scale`."""
    checked_scale(scale)
    return merge_lora(params, read_sd3_lora(path, params), scale)
