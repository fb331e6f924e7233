"""SD 3.x LoRA files in the diffusers/PEFT, OneTrainer and kohya/ComfyUI (Stability's MMDiT names) layouts, merged by
sdflax's `load_lora`, on the small random SD 3.5 Medium-shaped pipeline of test_sd3_pipeline.py (qk RMSNorm, a
dual-attention block, CLIP-L, CLIP-G, T5):

- PEFT files: against diffusers' StableDiffusion3Pipeline.load_lora_weights, two adapters at two weights
  (`set_adapters`) and `fuse_lora`: the merged MMDiT, CLIP-L and CLIP-G weights, and one image.
- kohya / ComfyUI files: diffusers' SD 3 loader reads none of them, so the reference is diffusers' single-file
  converter (`convert_sd3_transformer_checkpoint_to_diffusers`) run on the Stability-named weights with each LoRA
  added by the formula W + scale * alpha / rank * up @ down: it places fused qkv LoRAs and swaps the (shift, scale)
  halves as diffusers does; the text encoders (T5's lora_te3_ included, which ComfyUI merges) by the same formula.
- a traced scale compiles once; the other families' LoRAs are refused in one line, both ways.
"""

from __future__ import annotations

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from builders import REPO
from safetensors.torch import save_file
from test_flux_lora import (ALPHAS, RANK, assert_params_close, fused_params, one_line_error, peft_file,
                            random_lora, torch_layers)
from test_sd3_pipeline import (NEGATIVE, PROMPTS, T5_LENGTH, check_images, latents_for, ours_images, theirs_images,
                               torch_sd3_pipeline)
from test_sd3_single_file import mmdit_to_stability

from sdflax import StableDiffusion, StableDiffusion3, StableDiffusion3Img2Img
from sdflax.loading.lora import merge_lora
from sdflax.loading.sd3_lora import read_sd3_lora
from sdflax.loading.weights import convert_state_dict

TEXT = ("text_encoder", "text_encoder_2")  # the encoders diffusers' SD 3 loader takes LoRAs for
KOHYA_TEXT = {"text_encoder": ("lora_te1_", "clip_l"), "text_encoder_2": ("lora_te2_", "clip_g"),
              "text_encoder_3": ("lora_te3_", "t5xxl")}


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sd3_lora")
    theirs = torch_sd3_pipeline(tmp)
    theirs.save_pretrained(tmp / "sd3", safe_serialization=True)
    return (theirs, *StableDiffusion3.from_pretrained(tmp / "sd3"))


# ---- LoRA files ---------------------------------------------------------------------------------------------------
def half(down, up):
    return down.half().float(), up.half().float()  # kohya's files are float16: the reference uses what they hold


def stability_layers(transformer, seed) -> dict:
    """{Stability's module name: (down, up, alpha)} for every linear layer of the MMDiT (a fused qkv as one LoRA;
    the (shift, scale) modulations included)."""
    state = mmdit_to_stability(transformer.state_dict(), dict(transformer.config), p="")
    g = torch.Generator().manual_seed(seed)
    return {name.removesuffix(".weight"): (*half(*random_lora(g, w.shape[1], w.shape[0], RANK)), ALPHAS[i % 4])
            for i, (name, w) in enumerate(sorted(state.items())) if name.endswith(".weight") and w.ndim == 2}


def kohya_layers(theirs, seed) -> dict:
    """{component: {module: (down, up, alpha)}}: the MMDiT in Stability's names, CLIP-L, CLIP-G and T5 in
    transformers'."""
    layers = {"transformer": stability_layers(theirs.transformer, seed)}
    for i, component in enumerate(KOHYA_TEXT):
        layers[component] = {name: (*half(down, up), alpha) for name, (down, up, alpha)
                             in torch_layers(getattr(theirs, component), seed + 1 + i).items()}
    return layers


def kohya_file(path, layers, comfy=False):
    """kohya's sd-scripts (lora_unet_ / lora_te1_ .. lora_te3_, "_"-joined) or ComfyUI's (diffusion_model. /
    text_encoders.clip_l.transformer. ...) names, float16, alphas stored."""
    tensors = {}
    for component, modules in layers.items():
        kohya, comfy_name = KOHYA_TEXT.get(component, ("lora_unet_", None))
        prefix = ("diffusion_model." if comfy_name is None else f"text_encoders.{comfy_name}.transformer.") \
            if comfy else kohya
        for name, (down, up, alpha) in modules.items():
            stem = prefix + (name if comfy else name.replace(".", "_"))
            tensors.update({f"{stem}.lora_down.weight": down.half(), f"{stem}.lora_up.weight": up.half(),
                            f"{stem}.alpha": torch.tensor(alpha).half()})
    save_file(tensors, path)


def onetrainer_file(path, peft_path):
    """A PEFT file's transformer LoRAs as OneTrainer writes them: lora_transformer_<diffusers name "_"-joined>,
    lora_down / lora_up, the alphas stored."""
    from safetensors import safe_open

    with safe_open(str(peft_path), "pt") as f:
        config = {k.removeprefix("transformer."): v
                  for k, v in json.loads(f.metadata()["lora_adapter_metadata"]).items()}
        tensors = {}
        for key in f.keys():
            if key.startswith("transformer.") and key.endswith(".lora_A.weight"):
                name = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
                stem = "lora_transformer_" + name.replace(".", "_")
                tensors.update({f"{stem}.lora_down.weight": f.get_tensor(key),
                                f"{stem}.lora_up.weight": f.get_tensor(key.replace("lora_A", "lora_B")),
                                f"{stem}.alpha": torch.tensor(config["alpha_pattern"].get(name,
                                                                                         config["lora_alpha"]))})
    save_file(tensors, path)


# ---- references ---------------------------------------------------------------------------------------------------
def theirs_merged(theirs, files: dict):
    """A copy of `theirs` with diffusers' load_lora_weights of each file (path -> weight), set_adapters, fuse_lora."""
    fused = copy.deepcopy(theirs)
    names = [f"lora{i}" for i in range(len(files))]
    for name, path in zip(names, files):
        fused.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
    fused.set_adapters(names, list(files.values()))
    fused.fuse_lora(components=["transformer", *TEXT], adapter_names=names)
    return fused


def formula_merged(theirs, pipe, layers, scale) -> dict:
    """sdflax params of `theirs` with each LoRA added by the formula: the MMDiT's in Stability's names, then through
    diffusers' single-file converter; the text encoders' in transformers' names."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    def added(state, modules):
        state = {k: v.clone() for k, v in state.items()}
        for name, (down, up, alpha) in modules.items():
            state[f"{name}.weight"] += scale * alpha / down.shape[0] * (up @ down)
        return state

    stability = mmdit_to_stability(theirs.transformer.state_dict(), dict(theirs.transformer.config))
    stability = added(stability, {f"model.diffusion_model.{k}": v for k, v in layers["transformer"].items()})
    state = convert_sd3_transformer_checkpoint_to_diffusers(stability)
    out = {"transformer": convert_state_dict({k: v.numpy() for k, v in state.items()},
                                             pipe.transformer.param_shapes())}
    for component in KOHYA_TEXT:
        state = added(getattr(theirs, component).state_dict(), layers[component])
        out[component] = convert_state_dict({k: v.numpy() for k, v in state.items()},
                                            getattr(pipe, component).param_shapes())
    return out


def changed(ours, params, component) -> int:
    return sum(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ours[component]),
                                                         jax.tree.leaves(params[component])))


# ---- tests --------------------------------------------------------------------------------------------------------
def test_two_peft_loras_at_two_weights_merge_as_diffusers_adapters(sd3, tmp_path):
    """Every linear layer of the MMDiT, CLIP-L and CLIP-G, ranks 2..4 and alphas per layer (PEFT's patterns), two
    files at 0.7 and -0.4; StableDiffusion3Img2Img loads them as the text-to-image class."""
    theirs, pipe, params = sd3
    for name, seed in (("a", 1), ("b", 2)):
        peft_file(tmp_path / f"{name}.safetensors", theirs, seed, components=("transformer", *TEXT))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    ours = pipe.load_lora(pipe.load_lora(params, a, 0.7), b, -0.4)
    fused = theirs_merged(theirs, {a: 0.7, b: -0.4})
    for component in ("transformer", *TEXT):
        assert_params_close(ours[component], fused_params(getattr(fused, component),
                                                          getattr(pipe, component).param_shapes()))
        assert changed(ours, params, component) > 0
    assert ours["vae"] is params["vae"] and ours["text_encoder_3"] is params["text_encoder_3"]

    img2img = StableDiffusion3Img2Img(**pipe.components())
    again = img2img.load_lora(img2img.load_lora(params, a, 0.7), b, -0.4)
    assert all(jax.tree.all(jax.tree.map(np.array_equal, again[c], ours[c])) for c in ("transformer", *TEXT))


@pytest.mark.parametrize("comfy", [False, True], ids=["kohya", "comfy"])
def test_kohya_and_comfy_names_merge_as_diffusers_converts_them(sd3, tmp_path, comfy):
    """Stability's names (fused qkv, the swapped modulations of the final layer and the last text block) through
    diffusers' single-file converter; lora_te1_ .. lora_te3_ (ComfyUI: text_encoders.clip_l / clip_g / t5xxl)."""
    theirs, pipe, params = sd3
    layers = kohya_layers(theirs, seed=3)
    assert {"final_layer.adaLN_modulation.1", "joint_blocks.2.context_block.adaLN_modulation.1",
            "joint_blocks.0.x_block.attn2.qkv", "joint_blocks.1.context_block.attn.qkv"} <= set(layers["transformer"])
    kohya_file(tmp_path / "k.safetensors", layers, comfy)
    ours = pipe.load_lora(params, tmp_path / "k.safetensors", scale=0.6)
    expected = formula_merged(theirs, pipe, layers, 0.6)
    for component in expected:
        assert_params_close(ours[component], expected[component])
        assert changed(ours, params, component) > 0


def test_onetrainer_names_read_as_peft(sd3, tmp_path):
    """lora_transformer_<diffusers name> with stored alphas reads to the PEFT file's LoRAs."""
    theirs, pipe, params = sd3
    peft_file(tmp_path / "p.safetensors", theirs, 4, components=("transformer",))
    onetrainer_file(tmp_path / "o.safetensors", tmp_path / "p.safetensors")
    peft, onetrainer = (read_sd3_lora(tmp_path / f"{n}.safetensors", params) for n in "po")
    assert peft["transformer"].keys() == onetrainer["transformer"].keys()
    for name, w in peft["transformer"].items():
        for part in ("down", "up", "alpha"):
            np.testing.assert_array_equal(onetrainer["transformer"][name][part], w[part], err_msg=name)


def test_traced_scale_does_not_recompile(sd3, tmp_path):
    theirs, pipe, params = sd3
    kohya_file(tmp_path / "k.safetensors", kohya_layers(theirs, seed=5))
    lora = read_sd3_lora(tmp_path / "k.safetensors", params)
    merge = jax.jit(lambda p, lora, scale: merge_lora(p, lora, scale))
    for scale in (0.25, -1.0):
        merged, eager = merge(params, lora, jnp.float32(scale)), merge_lora(params, lora, scale)
        for component in lora:
            assert_params_close(merged[component], eager[component])
    assert merge._cache_size() == 1


def test_image_matches_diffusers_with_a_lora(sd3, tmp_path):
    theirs, pipe, params = sd3
    peft_file(tmp_path / "a.safetensors", theirs, 6, components=("transformer", *TEXT))
    fused = theirs_merged(theirs, {tmp_path / "a.safetensors": 0.8})
    expected = theirs_images(fused, PROMPTS[:1], latents=latents_for(1), guidance_scale=7.0,
                             negative_prompt=NEGATIVE[:1])
    plain = theirs_images(theirs, PROMPTS[:1], latents=latents_for(1), guidance_scale=7.0,
                          negative_prompt=NEGATIVE[:1])
    assert np.abs(expected - plain).max() > 0.05
    ids = pipe.prepare_inputs(PROMPTS[:1], max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs(NEGATIVE[:1], max_sequence_length=T5_LENGTH)
    merged = pipe.load_lora(params, tmp_path / "a.safetensors", scale=0.8)
    check_images(ours_images(pipe, merged, ids, latents=latents_for(1), guidance_scale=7.0, neg_prompt_ids=neg),
                 expected)


def test_other_families_loras_are_one_line(sd3, tmp_path):
    """SD 1.x's and Flux.1's LoRAs on SD 3, SD 3's on SD 1.x; names SD 3 has not."""
    theirs, pipe, params = sd3
    sd = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k"
    save_file({f"{sd}.lora_down.weight": torch.zeros(4, 768), f"{sd}.lora_up.weight": torch.zeros(640, 4)},
              tmp_path / "sd15.safetensors")
    one_line_error(lambda: pipe.load_lora(params, tmp_path / "sd15.safetensors"),
                   r"sd15.safetensors is a LoRA for SD 1.x, this pipeline is SD 3.x .*load it with StableDiffusion$")
    flux = "lora_unet_double_blocks_0_img_attn_qkv"
    save_file({f"{flux}.lora_down.weight": torch.zeros(4, 3072), f"{flux}.lora_up.weight": torch.zeros(9216, 4)},
              tmp_path / "flux.safetensors")
    one_line_error(lambda: pipe.load_lora(params, tmp_path / "flux.safetensors"),
                   r"flux.safetensors is a LoRA for Flux.1, this pipeline is SD 3.x .*load it with sdflax.Flux$")

    kohya_file(tmp_path / "sd3.safetensors", {"transformer": stability_layers(theirs.transformer, 7)})
    sd_pipe, sd_params = StableDiffusion.from_pretrained(REPO / "weights" / "tiny-sd")
    one_line_error(lambda: sd_pipe.load_lora(sd_params, tmp_path / "sd3.safetensors"),
                   r"sd3.safetensors is a LoRA for SD 3.x, this pipeline is SD 1.x/2.x .*StableDiffusion3$")

    save_file({"lora_unet_joint_blocks_9_x_block_attn_qkv.lora_down.weight": torch.zeros(4, 32),
               "lora_unet_joint_blocks_9_x_block_attn_qkv.lora_up.weight": torch.zeros(96, 4),
               "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight": torch.zeros(4, 32),
               "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight": torch.zeros(97, 4)},
              tmp_path / "bad.safetensors")
    message = one_line_error(lambda: pipe.load_lora(params, tmp_path / "bad.safetensors"), "does not fit")
    assert "targets not in the model: lora_unet_joint_blocks_9_x_block_attn_qkv.lora_down.weight" in message
    assert "x_block_attn_qkv.lora_up.weight: up (97, 4) does not split into 3 layers of 32 + 32 + 32 rows" in message
