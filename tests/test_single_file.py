"""Single-file checkpoints (CompVis / A1111 layout) load to exactly the params from_pretrained gives.

The files are made here from small diffusers pipelines by the reverse of the LDM -> diffusers mapping, and
diffusers' own StableDiffusionPipeline.from_single_file confirms each file holds the pipeline's weights.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings

import numpy as np
import pytest
import torch
from builders import torch_pipeline
from safetensors.torch import save_file

import jax
from flax import traverse_util

from sdflax import StableDiffusion
from sdflax.loading import single_file
from sdflax.models import CLIPTextConfig, UNetConfig, VAEConfig

# --------------------------------------------------------------------------------------------------------------
# diffusers names -> original (LDM / OpenCLIP) names, written independently of sdflax/loading/single_file.py's tables

RESNET_BACK = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
               "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def unet_to_ldm(state, config):
    per = config["layers_per_block"]
    cross_up = [kind == "CrossAttnUpBlock2D" for kind in config["up_block_types"]]
    fixed = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",  # SDXL
             "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}
    out = {}
    for key, value in state.items():
        module, leaf = key.rsplit(".", 1)
        if module in fixed:
            new = fixed[module]
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)", module):
            b, j, name = int(m[1]), int(m[2]), m[3]
            new = f"input_blocks.{1 + b * (per + 1) + j}.0.{RESNET_BACK[name]}"
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", module):
            new = f"input_blocks.{1 + int(m[1]) * (per + 1) + int(m[2])}.1.{m[3]}"
        elif m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv", module):
            new = f"input_blocks.{1 + int(m[1]) * (per + 1) + per}.0.op"
        elif m := re.fullmatch(r"mid_block\.resnets\.(\d)\.(\w+)", module):
            new = f"middle_block.{2 * int(m[1])}.{RESNET_BACK[m[2]]}"
        elif m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)", module):
            new = f"middle_block.1.{m[1]}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)", module):
            new = f"output_blocks.{int(m[1]) * (per + 1) + int(m[2])}.0.{RESNET_BACK[m[3]]}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", module):
            new = f"output_blocks.{int(m[1]) * (per + 1) + int(m[2])}.1.{m[3]}"
        elif m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv", module):
            b = int(m[1])
            new = f"output_blocks.{b * (per + 1) + per}.{2 if cross_up[b] else 1}.conv"
        else:
            raise KeyError(key)
        out[f"model.diffusion_model.{new}.{leaf}"] = value
    return out


def vae_to_ldm(state, config):
    levels = len(config["block_out_channels"])
    attention = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    out = {}
    for key, value in state.items():
        module, leaf = key.rsplit(".", 1)
        new = module.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
        new = re.sub(r"mid_block\.resnets\.(\d)", lambda m: f"mid.block_{int(m[1]) + 1}", new)
        new = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets", r"encoder.down.\1.block", new)
        new = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0", r"encoder.down.\1.downsample", new)
        new = re.sub(r"decoder\.up_blocks\.(\d+)\.resnets", lambda m: f"decoder.up.{levels - 1 - int(m[1])}.block", new)
        new = re.sub(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0",
                     lambda m: f"decoder.up.{levels - 1 - int(m[1])}.upsample", new)
        if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)", new):
            new = f"{m[1]}.mid.attn_1.{attention[m[2]]}"
            if leaf == "weight" and value.ndim == 2:
                value = value[:, :, None, None]  # the original VAE attention is 1x1 convs
        out[f"first_stage_model.{new}.{leaf}"] = value
    return out


def clip_to_ldm(state, config, p="cond_stage_model.transformer."):
    return {f"{p}text_model.{key}": value for key, value in state.items()}


def openclip_to_ldm(state, config, rng, p="cond_stage_model.model."):
    """`state`: a CLIPTextModel's, or a CLIPTextModelWithProjection's (SDXL), whose projection OpenCLIP stores
    transposed (x @ text_projection); SD 2.x's file has a projection its text encoder does not use."""
    state = {k.removeprefix("text_model."): v for k, v in state.items()}
    projection = state["text_projection.weight"].T if "text_projection.weight" in state else \
        torch.from_numpy(rng.standard_normal((config["hidden_size"],) * 2, np.float32))
    out = {f"{p}token_embedding.weight": state["embeddings.token_embedding.weight"],
           f"{p}positional_embedding": state["embeddings.position_embedding.weight"],
           f"{p}ln_final.weight": state["final_layer_norm.weight"], f"{p}ln_final.bias": state["final_layer_norm.bias"],
           f"{p}text_projection": projection, f"{p}logit_scale": torch.tensor(4.6)}  # logit_scale: unused
    names = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj",
             "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
    for i in range(config["num_hidden_layers"]):
        layer, block = f"encoder.layers.{i}.", f"{p}transformer.resblocks.{i}."
        for ours, theirs in names.items():
            for leaf in ("weight", "bias"):
                out[f"{block}{theirs}.{leaf}"] = state[f"{layer}{ours}.{leaf}"]
        for leaf in ("weight", "bias"):
            fused = [state[f"{layer}self_attn.{n}_proj.{leaf}"] for n in "qkv"]
            out[f"{block}attn.in_proj_{leaf}"] = torch.cat(fused) if isinstance(fused[0], torch.Tensor) else np.concatenate(fused)
    return out


def to_single_file(theirs, arch, seed=0):
    rng = np.random.default_rng(seed)
    config = lambda m: dict(m.config)  # noqa: E731
    te_config = theirs.text_encoder.config.to_dict()
    sd = {**unet_to_ldm(theirs.unet.state_dict(), config(theirs.unet)),
          **vae_to_ldm(theirs.vae.state_dict(), config(theirs.vae))}
    te = theirs.text_encoder.state_dict()
    sd.update(openclip_to_ldm(te, te_config, rng) if arch == "sd2" else clip_to_ldm(te, te_config))
    return {k: v.contiguous() for k, v in sd.items()}


def assert_same_params(ours, expected):
    flat_ours, flat_expected = traverse_util.flatten_dict(ours), traverse_util.flatten_dict(expected)
    assert flat_ours.keys() == flat_expected.keys()
    for path, value in flat_expected.items():
        assert flat_ours[path].dtype == value.dtype, path
        np.testing.assert_array_equal(flat_ours[path], value, err_msg="/".join(path))


# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["sd1", "sd2"])
def checkpoint(request, tmp_path_factory):
    """(arch, torch pipeline, diffusers folder, .safetensors file, .ckpt file)."""
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    theirs = torch_pipeline(arch, "ddim", prediction_type="v_prediction" if arch == "sd2" else "epsilon")
    theirs.save_pretrained(tmp / "diffusers")
    state = to_single_file(theirs, arch)
    save_file(state, tmp / "model.safetensors")
    # A Lightning .ckpt as the CompVis repos write it: the weights under "state_dict", beside training state.
    torch.save({"state_dict": state, "global_step": 1000, "epoch": 3}, tmp / "model.ckpt")
    return arch, theirs, tmp / "diffusers", tmp / "model.safetensors", tmp / "model.ckpt"


def test_diffusers_reads_the_test_file_to_the_pipeline_weights(checkpoint):
    """The file is genuine: diffusers' own single-file loader recovers every weight of the pipeline."""
    from diffusers import StableDiffusionPipeline

    arch, theirs, folder, path, _ = checkpoint
    loaded = StableDiffusionPipeline.from_single_file(str(path), config=str(folder), local_files_only=True,
                                                      safety_checker=None, requires_safety_checker=False)
    for name in ("unet", "vae", "text_encoder"):
        expected, got = getattr(theirs, name).state_dict(), getattr(loaded, name).state_dict()
        assert expected.keys() == got.keys()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{name}.{key}")


@pytest.mark.parametrize("suffix", ["safetensors", "ckpt"])
def test_params_equal_from_pretrained(checkpoint, suffix):
    arch, _, folder, safetensors_path, ckpt_path = checkpoint
    path = safetensors_path if suffix == "safetensors" else ckpt_path
    pipe, params = StableDiffusion.from_single_file(path, config=folder)
    expected_pipe, expected = StableDiffusion.from_pretrained(folder)
    assert_same_params(params, expected)
    assert pipe.unet.config == expected_pipe.unet.config and pipe.vae.config == expected_pipe.vae.config
    assert pipe.text_encoder.config == expected_pipe.text_encoder.config
    assert pipe.scheduler.config == expected_pipe.scheduler.config
    prompts = ["a photo of an astronaut", ""]
    np.testing.assert_array_equal(pipe.prepare_inputs(prompts), expected_pipe.prepare_inputs(prompts))


def test_one_load_takes_a_folder_or_a_single_file(checkpoint):
    """`sdflax.loading.pipelines.load(family, source)` is the one way in under both entry points: a folder and a
    file (told apart by the path) give the same params and scheduler config as from_pretrained; options for the
    other kind of source are refused in one line."""
    from sdflax.loading.pipelines import load

    arch, _, folder, path, _ = checkpoint
    _, expected = StableDiffusion.from_pretrained(folder)
    for source, options in ((folder, {}), (path, {"config": folder}), (str(path), {"config": folder})):
        components, params, scheduler_config = load(StableDiffusion.family, source, **options)
        assert_same_params(params, expected)
        assert set(components) >= {"unet", "vae", "text_encoder", "tokenizer", "scheduler"}
        assert scheduler_config["prediction_type"] == ("v_prediction" if arch == "sd2" else "epsilon")
    import sdflax

    pipe, params = sdflax.from_pretrained(path, config=folder)  # the family told by the file's tensor names
    assert type(pipe) is StableDiffusion
    assert_same_params(params, expected)
    with pytest.raises(ValueError, match=r"config=.* applies to single files; .* is a diffusers folder"):
        load(StableDiffusion.family, folder, config=folder)
    with pytest.raises(ValueError, match=r"variant='fp16' names a diffusers folder's weight files"):
        load(StableDiffusion.family, path, variant="fp16")


def test_bundled_configs_path(checkpoint, monkeypatch):
    """Without `config`: the bundled tokenizer and configs; the tiny test models stand in for the bundled SD
    configs (the full-size configs are checked against diffusers below)."""
    arch, _, folder, path, _ = checkpoint
    bundled = folder.parent / "bundled" / arch
    if not bundled.exists():
        for part in ("unet", "vae", "text_encoder", "scheduler"):
            shutil.copytree(folder / part, bundled / part, ignore=shutil.ignore_patterns("*.safetensors"))
    real_configs = single_file.bundled_config_folder
    monkeypatch.setattr(single_file, "bundled_config_folder", lambda version: str(folder.parent / "bundled" / version))
    pipe, params = StableDiffusion.from_single_file(path, prediction_type="epsilon")
    _, expected = StableDiffusion.from_pretrained(folder)
    assert_same_params(params, expected)
    assert pipe.scheduler.config.prediction_type == "epsilon"
    # SD 2.x pads prompts with "!" (id 0), SD 1.x with <|endoftext|> (49407)
    assert pipe.prepare_inputs(["a cat"])[0, -1] == (0 if arch == "sd2" else 49407)
    monkeypatch.setattr(single_file, "bundled_config_folder", real_configs)
    with pytest.raises(single_file.SingleFileError, match="bundled stable-diffusion.*pass config="):
        StableDiffusion.from_single_file(path)  # the real SD configs do not fit the tiny models, and it says so


def test_known_extras_warn_and_unknown_tensors_fail(checkpoint, tmp_path):
    arch, theirs, folder, _, _ = checkpoint
    state = to_single_file(theirs, arch)
    extras = {"model_ema.decay": torch.tensor(0.9999), "model_ema.diffusion_modelinput_blocks00weight": torch.zeros(3),
              "first_stage_model.loss.logvar": torch.zeros(())}
    unused = {"alphas_cumprod": torch.ones(1000), "betas": torch.ones(1000)}  # in every file: skipped silently
    if arch == "sd2":  # the last OpenCLIP layer, after the penultimate one SD 2.x uses
        last = theirs.text_encoder.config.num_hidden_layers
        unused[f"cond_stage_model.model.transformer.resblocks.{last}.ln_1.weight"] = torch.ones(4)
    save_file({**state, **extras, **unused}, tmp_path / "extras.safetensors")
    params, messages = load_warning(lambda: StableDiffusion.from_single_file(tmp_path / "extras.safetensors",
                                                                             config=folder)[1])
    assert len(messages) == 1 and messages[0].startswith(f"ignoring {len(extras)} tensors")
    assert all(key in messages[0] for key in extras)
    assert_same_params(params, StableDiffusion.from_pretrained(folder)[1])

    bad = {"model.diffusion_model.input_blocks.99.0.in_layers.0.weight": torch.zeros(2),
           "first_stage_model.encoder.down.0.attn.0.q.weight": torch.zeros(2), "mystery.tensor": torch.zeros(2)}
    save_file({**state, **bad}, tmp_path / "bad.safetensors")
    with pytest.raises(single_file.SingleFileError) as error:
        StableDiffusion.from_single_file(tmp_path / "bad.safetensors", config=folder)
    for key in bad:
        assert key in str(error.value)


def load_warning(load):
    """(what `load()` returns, the messages of its warnings about tensors the pipeline does not use)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load()
    return result, [str(w.message) for w in caught if "tensors the pipeline does not use" in str(w.message)]


def test_not_sd_checkpoints_are_refused(tmp_path):
    save_file({"conditioner.embedders.0.transformer.text_model.embeddings.position_embedding.weight": torch.zeros(2),
               "model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2)}, tmp_path / "sdxl.safetensors")
    with pytest.raises(single_file.SingleFileError, match="SDXL"):
        StableDiffusion.from_single_file(tmp_path / "sdxl.safetensors")
    save_file({"down_blocks.0.resnets.0.conv1.weight": torch.zeros(2)}, tmp_path / "unet.safetensors")
    with pytest.raises(single_file.SingleFileError, match="from_pretrained"):
        StableDiffusion.from_single_file(tmp_path / "unet.safetensors")


# --------------------------------------------------------------------------------------------------------------
# The bundled full-size configs and the tables, against diffusers' own models built on the meta device


def _meta_state(module):
    return {k: np.broadcast_to(np.zeros((), np.float16), tuple(v.shape)) for k, v in module.state_dict().items()}


@pytest.mark.parametrize("version", ["sd1", "sd2"])
def test_bundled_configs_map_a_full_size_checkpoint(version):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig as TorchCLIPConfig
    from transformers import CLIPTextModel as TorchCLIP

    folder = single_file.bundled_config_folder(version)
    configs = {c: json.load(open(f"{folder}/{c}/config.json")) for c in ("unet", "vae", "text_encoder")}
    with torch.device("meta"):
        models = {"unet": UNet2DConditionModel(**{k: v for k, v in configs["unet"].items() if k != "_class_name"}),
                  "vae": AutoencoderKL(**{k: v for k, v in configs["vae"].items() if k != "_class_name"}),
                  "text_encoder": TorchCLIP(TorchCLIPConfig(**configs["text_encoder"]))}
    states = {c: _meta_state(m) for c, m in models.items()}
    te = configs["text_encoder"]
    file_state = {**unet_to_ldm(states["unet"], configs["unet"]), **vae_to_ldm(states["vae"], configs["vae"])}
    if version == "sd2":
        file_state.update(openclip_to_ldm(states["text_encoder"], te, np.random.default_rng(0)))
        # The real SD 2.x file has a 24th OpenCLIP layer that the 23-layer text encoder leaves out.
        for key in [k for k in file_state if ".resblocks.22." in k]:
            file_state[key.replace(".resblocks.22.", ".resblocks.23.")] = file_state[key]
    else:
        file_state.update(clip_to_ldm(states["text_encoder"], te))
    assert single_file.detect_version(file_state) == version

    sdflax_configs = {"unet": UNetConfig.from_dict(configs["unet"]), "vae": VAEConfig.from_dict(configs["vae"]),
                      "text_encoder": CLIPTextConfig.from_dict(te)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mapped = single_file.split_components(file_state, sdflax_configs, version)
    assert not caught  # layer 23 and the contrastive head of SD 2.x are expected: no warning
    for component, state in states.items():
        # The VAE's attention stays a 1x1 conv here; weights.py takes it as the linear layer it is.
        squeeze = lambda k, s: s[:2] if ".mid_block.attentions." in k and s[2:] == (1, 1) else s  # noqa: E731
        got = {k.removeprefix("text_model."): squeeze(k, v.shape) for k, v in mapped[component].items()}
        assert got == {k: v.shape for k, v in state.items()}, component
    # And sdflax builds the same sizes from the bundled configs (shapes only: nothing is computed).
    from sdflax.models import AutoencoderKL as FlaxVAE
    from sdflax.models import CLIPTextModel as FlaxCLIP
    from sdflax.models import UNet2DConditionModel as FlaxUNet

    for component, cls in (("unet", FlaxUNet), ("vae", FlaxVAE), ("text_encoder", FlaxCLIP)):
        shapes = cls.from_config(configs[component]).param_shapes()
        assert sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes)) == \
            sum(int(np.prod(v.shape)) for v in states[component].values()), component
