"""SDXL single-file checkpoints (the SGM layout of sd_xl_base_1.0 / sd_xl_refiner_1.0) load to exactly the params
of their diffusers components.

The files are made here from small diffusers pipelines with test_single_file's diffusers -> LDM converters, and
diffusers' own from_single_file confirms each file holds the pipeline's weights.
"""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest
import torch
from builders import (REPO, SDXL, SDXL_SCHEDULER, TOKENIZER, torch_text_encoder, torch_text_encoder_2, torch_unet,
                      torch_vae)
from safetensors.torch import save_file
from test_single_file import (_meta_state, assert_same_params, clip_to_ldm, load_warning, openclip_to_ldm, unet_to_ldm,
                              vae_to_ldm)

import jax

from sdflax import StableDiffusion, StableDiffusionXL, StableDiffusionXLImg2Img
from sdflax.loading import single_file
from sdflax.loading.hub import ModelNotFoundError
from sdflax.models import CLIPTextConfig, UNetConfig, VAEConfig

CLIP_L, BIGG_BASE, BIGG_REFINER = ("conditioner.embedders.0.transformer.", "conditioner.embedders.1.model.",
                                   "conditioner.embedders.0.model.")
# The second encoder wider than the first (as bigG is than ViT-L: diffusers tells them apart by width) and with a
# projection that is not square (a missing transpose cannot pass); the refiner UNet attends to it alone and takes
# five time ids (sizes, crop, aesthetic score).
TEXT_ENCODER_2 = {**SDXL["text_encoder_2"], "hidden_size": 48, "intermediate_size": 64, "num_attention_heads": 6,
                  "projection_dim": 40}
UNETS = {
    "sdxl": {**SDXL["unet"], "cross_attention_dim": 32 + 48, "projection_class_embeddings_input_dim": 40 + 6 * 8},
    "sdxl_refiner": {**SDXL["unet"], "cross_attention_dim": 48, "projection_class_embeddings_input_dim": 40 + 5 * 8},
}


def torch_xl(version, seed=0):
    """A diffusers StableDiffusionXLPipeline ('sdxl') or refiner-shaped StableDiffusionXLImg2ImgPipeline."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

    parts = dict(vae=torch_vae(SDXL["vae"], seed), text_encoder_2=torch_text_encoder_2(TEXT_ENCODER_2, seed),
                 tokenizer_2=CLIPTokenizer.from_pretrained(TOKENIZER, pad_token="!"),
                 unet=torch_unet(UNETS[version], seed), scheduler=EulerDiscreteScheduler.from_config(SDXL_SCHEDULER),
                 add_watermarker=False)
    if version == "sdxl_refiner":
        return StableDiffusionXLImg2ImgPipeline(text_encoder=None, tokenizer=None, requires_aesthetics_score=True,
                                                force_zeros_for_empty_prompt=False, **parts)
    return StableDiffusionXLPipeline(text_encoder=torch_text_encoder(SDXL["text_encoder"], seed),
                                     tokenizer=CLIPTokenizer.from_pretrained(TOKENIZER), **parts)


def to_sgm(states: dict, configs: dict, refiner: bool) -> dict:
    """{component: diffusers state dict} -> one state dict in the SGM layout."""
    rng = np.random.default_rng(0)  # unused: SDXL's OpenCLIP projection is the text encoder's own
    sd = {**unet_to_ldm(states["unet"], configs["unet"]), **vae_to_ldm(states["vae"], configs["vae"]),
          **openclip_to_ldm(states["text_encoder_2"], configs["text_encoder_2"], rng,
                            BIGG_REFINER if refiner else BIGG_BASE)}
    if not refiner:
        sd.update(clip_to_ldm(states["text_encoder"], configs["text_encoder"], CLIP_L))
    return sd


def pipeline_to_sgm(theirs, version):
    names = single_file.file_contents(version).models
    states = {c: getattr(theirs, c).state_dict() for c in names}
    configs = {c: dict(getattr(theirs, c).config) if c in ("unet", "vae") else getattr(theirs, c).config.to_dict()
               for c in names}
    return {k: v.contiguous() for k, v in to_sgm(states, configs, version == "sdxl_refiner").items()}


def expected_params(version, folder):
    """What sdflax's diffusers-format loader gives for each component of the saved pipeline."""
    return {c: cls.from_pretrained(folder / c)[1] for c, cls in single_file.file_contents(version).models.items()}


@pytest.fixture(scope="module", params=["sdxl", "sdxl_refiner"])
def checkpoint(request, tmp_path_factory):
    """(version, torch pipeline, diffusers folder, .safetensors file, .ckpt file)."""
    version = request.param
    tmp = tmp_path_factory.mktemp(version)
    theirs = torch_xl(version)
    theirs.save_pretrained(tmp / "diffusers")
    state = pipeline_to_sgm(theirs, version)
    save_file(state, tmp / "model.safetensors")
    torch.save({"state_dict": state, "global_step": 1000}, tmp / "model.ckpt")  # a Lightning .ckpt, as SGM writes
    return version, theirs, tmp / "diffusers", tmp / "model.safetensors", tmp / "model.ckpt"


def test_diffusers_reads_the_test_file_to_the_pipeline_weights(checkpoint):
    """The file is genuine: diffusers' own single-file loader recovers every weight of the pipeline."""
    from diffusers import StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline

    version, theirs, folder, path, _ = checkpoint
    cls = StableDiffusionXLImg2ImgPipeline if version == "sdxl_refiner" else StableDiffusionXLPipeline
    loaded = cls.from_single_file(str(path), config=str(folder), local_files_only=True, add_watermarker=False)
    for name in single_file.file_contents(version).models:
        expected, got = getattr(theirs, name).state_dict(), getattr(loaded, name).state_dict()
        assert expected.keys() == got.keys(), name
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{name}.{key}")
    if version == "sdxl_refiner":
        assert loaded.text_encoder is None


@pytest.mark.parametrize("suffix", ["safetensors", "ckpt"])
def test_params_equal_the_diffusers_components(checkpoint, suffix):
    version, _, folder, safetensors_path, ckpt_path = checkpoint
    path = safetensors_path if suffix == "safetensors" else ckpt_path
    if version == "sdxl":
        pipe, params = StableDiffusionXL.from_single_file(path, config=folder)
        expected_pipe, expected = StableDiffusionXL.from_pretrained(folder)
        assert_same_params(params, expected)
        for name in ("unet", "vae", "text_encoder", "text_encoder_2", "scheduler"):
            assert getattr(pipe, name).config == getattr(expected_pipe, name).config, name
        prompts = ["a photo of an astronaut", ""]
        np.testing.assert_array_equal(pipe.prepare_inputs(prompts), expected_pipe.prepare_inputs(prompts))
        assert pipe.force_zeros_for_empty_prompt == expected_pipe.force_zeros_for_empty_prompt
    else:  # the refiner's parts, and the img2img pipeline built from them
        pipe, params = StableDiffusionXLImg2Img.from_single_file(path, config=folder)
        expected_pipe, expected = StableDiffusionXLImg2Img.from_pretrained(folder)
        assert_same_params(params, expected)
        assert pipe.text_encoder is None and pipe.tokenizer is None and pipe.requires_aesthetics_score
        np.testing.assert_array_equal(pipe.prepare_inputs(["a cat"]), expected_pipe.prepare_inputs(["a cat"]))
        parts, params = single_file.load_single_file(path, config=folder)
        assert_same_params(params, expected_params(version, folder))
        assert set(parts) == {"text_encoder_2", "unet", "vae", "tokenizer_2", "scheduler", "dtype",
                              "force_zeros_for_empty_prompt", "requires_aesthetics_score"}
        assert parts["requires_aesthetics_score"] and not parts["force_zeros_for_empty_prompt"]
        assert parts["unet"].config.projection_class_embeddings_input_dim == 40 + 5 * 8
        assert parts["tokenizer_2"]("a cat", padding="max_length", max_length=77).input_ids[-1] == 0  # "!"


def test_bundled_configs_path(checkpoint, monkeypatch):
    """Without `config`: the bundled tokenizers, configs and model_index.json options; the tiny test models
    stand in for the bundled SDXL configs (the full-size configs are checked against diffusers below)."""
    version, _, folder, path, _ = checkpoint
    bundled = folder.parent / "bundled"
    if not (bundled / version).exists():
        for part in single_file.file_contents(version).models | {"scheduler": None}:
            shutil.copytree(folder / part, bundled / version / part, ignore=shutil.ignore_patterns("*.safetensors"))
        shutil.copy(folder / "model_index.json", bundled / version)
    real_configs = single_file.bundled_config_folder
    monkeypatch.setattr(single_file, "bundled_config_folder", lambda v: str(bundled / v))
    expected = expected_params(version, folder)
    if version == "sdxl":
        pipe, params = StableDiffusionXL.from_single_file(path)
        ids = pipe.prepare_inputs(["a cat"])
        assert ids[0, 0, -1] == 49407 and ids[0, 1, -1] == 0  # <|endoftext|> pads the first, "!" the second
        assert pipe.force_zeros_for_empty_prompt
    else:
        parts, params = single_file.load_single_file(path)
        assert parts["requires_aesthetics_score"] and not parts["force_zeros_for_empty_prompt"]
    assert_same_params(params, expected)
    monkeypatch.setattr(single_file, "bundled_config_folder", real_configs)
    with pytest.raises(single_file.SingleFileError, match="bundled stable-diffusion-xl-.*pass config=") as error:
        single_file.load_single_file(path)  # the real SDXL configs do not fit the tiny models, and it says so
    assert "\n" not in str(error.value)


def test_the_wrong_pipeline_class_names_the_right_one(checkpoint, tmp_path):
    version, _, _, path, _ = checkpoint
    right = "StableDiffusionXLImg2Img" if version == "sdxl_refiner" else "StableDiffusionXL"
    for cls in (StableDiffusion, StableDiffusionXL):
        if cls is StableDiffusion or version == "sdxl" and cls.__name__ != right:  # SDXL pipelines take refiners
            with pytest.raises(single_file.SingleFileError, match=f"SDXL .*: use {right}.from_single_file$"):
                cls.from_single_file(path)
    if version == "sdxl":  # an SD folder's configs for an SDXL file
        with pytest.raises(ModelNotFoundError, match="missing text_encoder_2/config.json, tokenizer_2/"):
            StableDiffusionXL.from_single_file(path, config=REPO / "weights" / "tiny-sd")
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2),
               "cond_stage_model.transformer.text_model.final_layer_norm.weight": torch.zeros(2)},
              tmp_path / "sd1.safetensors")
    with pytest.raises(single_file.SingleFileError, match="SD 1.x .*: use StableDiffusion.from_single_file$"):
        StableDiffusionXL.from_single_file(tmp_path / "sd1.safetensors")


def test_missing_encoders_unknown_and_extra_tensors(checkpoint, tmp_path):
    version, theirs, folder, _, _ = checkpoint
    state = pipeline_to_sgm(theirs, version)
    # A base file without its second encoder (a refiner without its one), or with a refiner's encoder too (a
    # refiner with a base's first): one line each.
    encoder = BIGG_REFINER if version == "sdxl_refiner" else BIGG_BASE
    stray = {"sdxl": f"{BIGG_REFINER}positional_embedding", "sdxl_refiner": f"{CLIP_L}text_model.x.weight"}[version]
    for case in ({k: v for k, v in state.items() if not k.startswith(encoder)}, {**state, stray: torch.zeros(2)}):
        save_file(case, tmp_path / "broken.safetensors")
        with pytest.raises(single_file.SingleFileError, match=r"conditioner\.embedders\.") as error:
            single_file.load_single_file(tmp_path / "broken.safetensors", config=folder)
        assert "SDXL" in str(error.value)
        assert "\n" not in str(error.value)

    extras = {"model_ema.decay": torch.tensor(0.9999), "first_stage_model.loss.logvar": torch.zeros(())}
    unused = {"denoiser.sigmas": torch.ones(1000), f"{encoder}logit_scale": torch.tensor(4.6)}  # skipped silently
    save_file({**state, **extras, **unused}, tmp_path / "extras.safetensors")
    params, messages = load_warning(lambda: single_file.load_single_file(tmp_path / "extras.safetensors",
                                                                         config=folder)[1])
    assert len(messages) == 1 and messages[0].startswith(f"ignoring {len(extras)} tensors")
    assert_same_params(params, expected_params(version, folder))

    layers = TEXT_ENCODER_2["num_hidden_layers"]  # SDXL uses every OpenCLIP layer: one more is not skipped
    bad = {f"{encoder}transformer.resblocks.{layers}.ln_1.weight": torch.zeros(2),
           "model.diffusion_model.label_emb.0.4.weight": torch.zeros(2), "conditioner.mystery": torch.zeros(2)}
    save_file({**state, **bad}, tmp_path / "bad.safetensors")
    with pytest.raises(single_file.SingleFileError, match="^3 tensors that no table maps") as error:
        single_file.load_single_file(tmp_path / "bad.safetensors", config=folder)
    assert all(key in str(error.value) for key in bad) and "\n" not in str(error.value)


# --------------------------------------------------------------------------------------------------------------
# The bundled full-size configs and the tables, against diffusers' own models built on the meta device


@pytest.mark.parametrize("version", ["sdxl", "sdxl_refiner"])
def test_bundled_configs_map_a_full_size_checkpoint(version):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig as TorchCLIPConfig
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    folder = single_file.bundled_config_folder(version)
    contents = single_file.file_contents(version)
    configs = {c: json.load(open(f"{folder}/{c}/config.json")) for c in contents.models}
    torch_classes = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection}
    with torch.device("meta"):
        models = {c: torch_classes[c](TorchCLIPConfig(**configs[c])) for c in contents.models if c in torch_classes}
        models["unet"] = UNet2DConditionModel(**{k: v for k, v in configs["unet"].items() if k != "_class_name"})
        models["vae"] = AutoencoderKL(**{k: v for k, v in configs["vae"].items() if k != "_class_name"})
    states = {c: _meta_state(m) for c, m in models.items()}
    file_state = to_sgm(states, configs, version == "sdxl_refiner")
    assert single_file.detect_version(file_state) == version

    from_dict = {"unet": UNetConfig.from_dict, "vae": VAEConfig.from_dict}
    sdflax_configs = {c: from_dict.get(c, CLIPTextConfig.from_dict)(configs[c]) for c in contents.models}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mapped = single_file.split_components(file_state, sdflax_configs, version)
    assert not caught  # OpenCLIP's logit_scale is expected: no warning
    for component, state in states.items():
        # The VAE's attention stays a 1x1 conv here; weights.py takes it as the linear layer it is.
        squeeze = lambda k, s: s[:2] if ".mid_block.attentions." in k and s[2:] == (1, 1) else s  # noqa: E731
        got = {k.removeprefix("text_model."): squeeze(k, v.shape) for k, v in mapped[component].items()}
        assert got == {k.removeprefix("text_model."): v.shape for k, v in state.items()}, component
    # And sdflax builds the same sizes from the bundled configs (shapes only: nothing is computed).
    for component, cls in contents.models.items():
        shapes = cls.from_config(configs[component]).param_shapes()
        assert sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes)) == \
            sum(int(np.prod(v.shape)) for v in states[component].values()), component
