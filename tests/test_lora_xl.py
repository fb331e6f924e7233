"""LoRA for SDXL (UNet and both text encoders) and kohya's original-UNet names (SDXL and SD 1.x), against
diffusers' load_lora_weights + fuse_lora (PyTorch, peft)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from builders import torch_pipeline, torch_xl_pipeline
from safetensors.torch import save_file
from test_lora import IMAGE_ATOL, assert_params_close, both, kohya_file, kohya_stem, peft_file

import jax

from sdflax import StableDiffusion, StableDiffusionXL
from sdflax.loading.ldm_names import unet_table
from sdflax.loading.lora import LoraMismatchError, read_lora
from sdflax.loading.weights import convert_state_dict

SCALE = 0.7
PROMPTS = ["a photo of an astronaut riding a horse on mars"]


def load(cls, theirs, folder):
    theirs.save_pretrained(folder)
    pipe, params = cls.from_pretrained(folder)
    return theirs, pipe, params


@pytest.fixture(scope="module")
def xl(tmp_path_factory):
    return load(StableDiffusionXL, torch_xl_pipeline("euler"), tmp_path_factory.mktemp("sdxl"))


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    return load(StableDiffusion, torch_pipeline("sd1"), tmp_path_factory.mktemp("sd1"))


def diffusers_fused(theirs, path, scale):
    """A copy of `theirs` with the file loaded by diffusers' own loader and fused at `scale`."""
    fused = copy.deepcopy(theirs)
    # diffusers maps original UNet names given the UNet's config, which only its SDXL pipeline passes itself
    kwargs = {} if "text_encoder_2" in both(fused) else {"unet_config": fused.unet.config}
    fused.load_lora_weights(str(path.parent), weight_name=path.name, **kwargs)
    fused.fuse_lora(lora_scale=scale)
    fused.unload_lora_weights()
    return fused


def as_params(pipe, params, fused):
    """Our params holding the weights of a diffusers pipeline's UNet and text encoder(s)."""
    out = dict(params)
    for component, model in both(fused).items():
        state = {k: v.numpy() for k, v in model.state_dict().items()}
        out[component] = convert_state_dict(state, getattr(pipe, component).param_shapes())
    return out


def sdxl_stem(component, name):
    """kohya's SDXL prefixes: lora_te1_ for the first text encoder (lora_te2_ for the second)."""
    return kohya_stem(component, name).replace("lora_te_", "lora_te1_", 1)


def original_unet_stem(pipe, te_stem=kohya_stem):
    """kohya's names of the UNet in the original (LDM) layout, lora_unet_input_blocks_4_1_proj_in: the inverse of
    the LDM table of single-file checkpoints. diffusers reading the same file to the same weights shows the names
    are the real ones."""
    inverse = {}
    for ldm, entry in unet_table(pipe.unet.config).items():
        target, leaves = entry if isinstance(entry, tuple) else (entry, {})
        inverse[target] = ldm, {diffusers: original for original, diffusers in leaves.items()}

    def stem(component, name):
        if component != "unet":
            return te_stem(component, name)
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in inverse:
                ldm, leaves = inverse[".".join(parts[:n])]
                rest = ".".join(parts[n:])
                return "lora_unet_" + ".".join(filter(None, [ldm, leaves.get(rest, rest)])).replace(".", "_")
        raise KeyError(f"no LDM name for {name}")

    return stem


def changed(ours, params, component):
    return sum(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ours[component]),
                                                         jax.tree.leaves(params[component])))


@pytest.fixture(scope="module")
def peft_fused(xl, tmp_path_factory):
    """A diffusers/PEFT LoRA file (lora_A/lora_B, alphas in lora_adapter_metadata) on the UNet and both text
    encoders: our merged params, and diffusers' pipeline with the same file fused."""
    theirs, pipe, params = xl
    path = tmp_path_factory.mktemp("peft") / "lora.safetensors"
    layers = peft_file(path, theirs)
    assert set(layers) == {"unet", "text_encoder", "text_encoder_2"}
    return pipe.load_lora(params, path, scale=SCALE), diffusers_fused(theirs, path, SCALE), layers


def test_sdxl_peft_lora_equals_diffusers_fuse_lora(xl, peft_fused):
    theirs, pipe, params = xl
    ours, fused, layers = peft_fused
    assert_params_close(ours, as_params(pipe, params, fused))
    for component in ("unet", "text_encoder", "text_encoder_2"):
        assert changed(ours, params, component) == len(layers[component])  # every target moved
    assert changed(ours, params, "vae") == 0


def test_sdxl_images_match_diffusers_with_lora_fused(xl, peft_fused):
    theirs, pipe, params = xl
    ours_params, fused, _ = peft_fused
    size = pipe.unet.config.sample_size
    latents = np.random.default_rng(0).standard_normal((1, 4, size, size), dtype=np.float32)
    with torch.no_grad():
        expected, plain = (model(PROMPTS, num_inference_steps=3, latents=torch.from_numpy(latents),
                                 output_type="np").images for model in (fused, theirs))
    ours = pipe(pipe.prepare_inputs(PROMPTS), ours_params, jax.random.key(0), 3, latents=latents).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=IMAGE_ATOL)
    assert np.abs(expected - plain).max() > 0.05  # the LoRA at this scale changes the picture


def check_original_names(setup, tmp_path, te_stem, diffusers_misreads=()):
    """A kohya file in the original UNet names loads to the params of its diffusers-named twin, and diffusers'
    loader fuses it (less `diffusers_misreads`) to the same weights. Uniform alphas: diffusers' kohya converter
    loses per-module alphas."""
    theirs, pipe, params = setup
    original, twin = tmp_path / "original.safetensors", tmp_path / "twin.safetensors"
    stem = original_unet_stem(pipe, te_stem)
    layers = kohya_file(original, theirs, uniform=True, stem=stem)
    kohya_file(twin, theirs, uniform=True, stem=te_stem)
    ours = pipe.load_lora(params, original, scale=SCALE)
    assert_params_close(ours, pipe.load_lora(params, twin, scale=SCALE), atol=0)
    assert changed(ours, params, "unet") == len(layers["unet"])

    if diffusers_misreads:
        original = tmp_path / "for_diffusers.safetensors"
        kohya_file(original, theirs, uniform=True, stem=stem, keep=lambda c, name: name not in diffusers_misreads)
        ours = pipe.load_lora(params, original, scale=SCALE)
    assert_params_close(ours, as_params(pipe, params, diffusers_fused(theirs, original, SCALE)))
    return original


def test_sdxl_kohya_original_unet_names(xl, tmp_path):
    path = check_original_names(xl, tmp_path, sdxl_stem)
    _, pipe, params = xl
    with pytest.raises(LoraMismatchError, match="original UNet names: pass unet_config"):
        read_lora(path, params)  # the table comes from the UNet's config


def test_sd1_kohya_original_unet_names(sd1, tmp_path):
    # diffusers reads the second module of every output block as an attention, so the upsampler of SD 1.x's first
    # up block (no attention: output_blocks_2_1_conv) is lost on its side; sdflax reads it by the LDM table.
    check_original_names(sd1, tmp_path, kohya_stem, diffusers_misreads={"up_blocks.0.upsamplers.0.conv"})


@pytest.mark.parametrize("made_for, fmt, expected", [
    ("xl", "kohya", "SDXL, this pipeline is SD 1.x/2.x (names of SDXL's two text encoders): load it with "
                    "StableDiffusionXL"),
    ("xl", "peft", "SDXL, this pipeline is SD 1.x/2.x (names of SDXL's two text encoders): load it with "
                   "StableDiffusionXL"),
    ("sd1", "kohya", "SD 1.x/2.x, this pipeline is SDXL (kohya's name of SD's one text encoder): load it with "
                     "StableDiffusion"),
    ("sd1", "peft", "a model of 32-wide text states, this pipeline is SDXL (its cross-attention reads 32-wide text "
                    "states, this UNet's 64): use a LoRA made for SDXL"),
])
def test_a_lora_for_the_other_family_says_which_it_is_for(xl, sd1, tmp_path, made_for, fmt, expected):
    (theirs, _, _), (_, pipe, params) = (xl, sd1) if made_for == "xl" else (sd1, xl)
    path = tmp_path / "lora.safetensors"
    if fmt == "kohya":
        kohya_file(path, theirs, stem=sdxl_stem if made_for == "xl" else kohya_stem)
    else:
        peft_file(path, theirs)
    with pytest.raises(LoraMismatchError) as error:
        pipe.load_lora(params, path)
    message = str(error.value)
    assert message == f"{path} is a LoRA for {expected}"  # one short line: the file once, no tensor names


def test_the_family_of_a_full_size_lora_comes_from_its_cross_attention_width(tmp_path):
    """An SDXL UNet LoRA (2048-wide text states) on an SD 1.x UNet (768): shapes alone, no names, tell."""
    name = "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k"
    params = {"unet": {name.replace(".", "_"): {"kernel": np.zeros((768, 320), np.float32)}}, "text_encoder": {}}
    save_file({f"unet.{name}.lora_A.weight": torch.zeros(4, 2048), f"unet.{name}.lora_B.weight": torch.zeros(640, 4)},
              tmp_path / "xl.safetensors")
    with pytest.raises(LoraMismatchError, match=r"is a LoRA for SDXL, this pipeline is SD 1.x \(its cross-attention "
                                                r"reads 2048-wide text states, this UNet's 768\): load it with "
                                                r"StableDiffusionXL$"):
        read_lora(tmp_path / "xl.safetensors", params)
