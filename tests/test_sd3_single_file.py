"""SD 3 / 3.5 single files (Stability's layout) load to exactly the params StableDiffusion3.from_pretrained gives.

The files are made here from small diffusers SD 3 pipelines by the reverse of diffusers' single-file conversion
(an MMDiT-X with qk RMSNorm and dual attention, and a plain SD 3 one), and diffusers' own
StableDiffusion3Pipeline.from_single_file confirms each file holds the pipeline's weights.
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_mmdit import torch_transformer
from test_sd3_pipeline import TRANSFORMER, torch_sd3_pipeline
from test_single_file import assert_same_params, vae_to_ldm

from sdflax import StableDiffusion, StableDiffusion3, StableDiffusion3Img2Img
from sdflax.loading import ldm_names, single_file
from sdflax.models import SD3TransformerConfig, VAEConfig

VARIANTS = {"sd35_medium": TRANSFORMER,  # MMDiT-X: qk RMSNorm, dual attention in block 0
            "sd3": {**TRANSFORMER, "qk_norm": None, "dual_attention_layers": ()}}

# ---------------------------------------------------------------------------------------------------------------
# diffusers names -> Stability's, written independently of sdflax/loading/ldm_names.py's tables


def swap(value):
    """(scale, shift) rows <-> (shift, scale): Stability's order of the final and pre-only modulations."""
    first, second = value.chunk(2) if isinstance(value, torch.Tensor) else np.split(value, 2)
    return torch.cat([second, first]) if isinstance(value, torch.Tensor) else np.concatenate([second, first])


def cat(values):
    return torch.cat(values) if isinstance(values[0], torch.Tensor) else np.concatenate(values)


def mmdit_to_stability(state, config, p="model.diffusion_model."):
    """The MMDiT's state dict in Stability's names; every tensor is used exactly once."""
    used = set()

    def take(key):
        used.add(key)
        return state[key]

    fixed = {"pos_embed.pos_embed": "pos_embed", "pos_embed.proj": "x_embedder.proj",
             "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
             "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
             "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
             "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
             "context_embedder": "context_embedder", "proj_out": "final_layer.linear"}
    out = {}
    for ours, theirs in fixed.items():
        for leaf in ("", ".weight", ".bias"):
            if ours + leaf in state and (leaf or ours == "pos_embed.pos_embed"):
                out[p + theirs + leaf] = take(ours + leaf)
    last = config["num_layers"] - 1
    for leaf in ("weight", "bias"):
        out[f"{p}final_layer.adaLN_modulation.1.{leaf}"] = swap(take(f"norm_out.linear.{leaf}"))
    for i in range(config["num_layers"]):
        b, x, c = f"transformer_blocks.{i}.", f"{p}joint_blocks.{i}.x_block.", f"{p}joint_blocks.{i}.context_block."
        for leaf in ("weight", "bias"):
            out[f"{x}attn.qkv.{leaf}"] = cat([take(f"{b}attn.to_{n}.{leaf}") for n in "qkv"])
            out[f"{c}attn.qkv.{leaf}"] = cat([take(f"{b}attn.add_{n}_proj.{leaf}") for n in "qkv"])
            out[f"{x}attn.proj.{leaf}"] = take(f"{b}attn.to_out.0.{leaf}")
            out[f"{x}adaLN_modulation.1.{leaf}"] = take(f"{b}norm1.linear.{leaf}")
            context_modulation = take(f"{b}norm1_context.linear.{leaf}")
            out[f"{c}adaLN_modulation.1.{leaf}"] = swap(context_modulation) if i == last else context_modulation
            out[f"{x}mlp.fc1.{leaf}"] = take(f"{b}ff.net.0.proj.{leaf}")
            out[f"{x}mlp.fc2.{leaf}"] = take(f"{b}ff.net.2.{leaf}")
            if i != last:  # the last context block is pre-only: no output projection, no MLP
                out[f"{c}attn.proj.{leaf}"] = take(f"{b}attn.to_add_out.{leaf}")
                out[f"{c}mlp.fc1.{leaf}"] = take(f"{b}ff_context.net.0.proj.{leaf}")
                out[f"{c}mlp.fc2.{leaf}"] = take(f"{b}ff_context.net.2.{leaf}")
            if f"{b}attn2.to_q.{leaf}" in state:
                out[f"{x}attn2.qkv.{leaf}"] = cat([take(f"{b}attn2.to_{n}.{leaf}") for n in "qkv"])
                out[f"{x}attn2.proj.{leaf}"] = take(f"{b}attn2.to_out.0.{leaf}")
        norms = {"attn.norm_q": f"{x}attn.ln_q", "attn.norm_k": f"{x}attn.ln_k", "attn.norm_added_q": f"{c}attn.ln_q",
                 "attn.norm_added_k": f"{c}attn.ln_k", "attn2.norm_q": f"{x}attn2.ln_q",
                 "attn2.norm_k": f"{x}attn2.ln_k"}
        for ours, theirs in norms.items():
            if f"{b}{ours}.weight" in state:
                out[f"{theirs}.weight"] = take(f"{b}{ours}.weight")
    assert used == set(state), sorted(set(state) - used)[:5]
    return out


def to_single_file(theirs, text_encoders=True, t5=True):
    """The pipeline's weights as one Stability file: MMDiT, VAE, and (as some files) CLIP-L, CLIP-G and T5."""
    sd = {**mmdit_to_stability(theirs.transformer.state_dict(), dict(theirs.transformer.config)),
          **vae_to_ldm(theirs.vae.state_dict(), dict(theirs.vae.config))}
    if text_encoders:
        for name, part in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
            sd.update({f"text_encoders.{part}.transformer.{k}": v
                       for k, v in getattr(theirs, name).state_dict().items()})
            sd[f"text_encoders.{part}.logit_scale"] = torch.tensor(4.6)  # as ComfyUI saves them: unused
    if t5 and theirs.text_encoder_3 is not None:
        # Stability's files hold T5's tied embedding twice, as shared.weight and encoder.embed_tokens.weight
        sd.update({f"text_encoders.t5xxl.transformer.{k}": v.clone()
                   for k, v in theirs.text_encoder_3.state_dict().items()})
    return {k: v.contiguous() for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    """(variant, diffusers pipeline, diffusers folder, single file, folder params from sdflax's from_pretrained)."""
    from diffusers import StableDiffusion3Pipeline

    tmp = tmp_path_factory.mktemp(request.param)
    theirs = torch_sd3_pipeline(tmp)
    theirs = StableDiffusion3Pipeline(**{**theirs.components,
                                         "transformer": torch_transformer(VARIANTS[request.param], seed=2)})
    with torch.no_grad():  # SD 3 pools CLIP-L unprojected: a file's CLIP-L reads with an identity projection
        projection = theirs.text_encoder.text_projection.weight
        projection.copy_(torch.eye(*projection.shape))
    theirs.save_pretrained(tmp / "diffusers", safe_serialization=True)
    save_file(to_single_file(theirs), tmp / "model.safetensors")
    return request.param, theirs, tmp / "diffusers", tmp / "model.safetensors", \
        StableDiffusion3.from_pretrained(tmp / "diffusers")


def test_diffusers_reads_the_test_file_to_the_pipeline_weights(checkpoint):
    """The file is genuine: diffusers' own single-file loader recovers every weight of the pipeline."""
    from diffusers import StableDiffusion3Pipeline

    _, theirs, folder, path, _ = checkpoint
    loaded = StableDiffusion3Pipeline.from_single_file(str(path), config=str(folder), local_files_only=True)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        expected, got = getattr(theirs, name).state_dict(), getattr(loaded, name).state_dict()
        assert expected.keys() == got.keys(), name
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{name}.{key}")


def test_params_equal_from_pretrained(checkpoint):
    variant, _, folder, path, (expected_pipe, expected) = checkpoint
    parts, params = single_file.load_sd3_single_file(path, config=folder)
    pipe = StableDiffusion3(**parts)
    assert_same_params(params, expected)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        assert getattr(pipe, name).config == getattr(expected_pipe, name).config, name
    assert pipe.transformer.config.qk_norm == VARIANTS[variant]["qk_norm"]
    assert pipe.scheduler.config == expected_pipe.scheduler.config
    prompts = ["a photo of an astronaut", ""]
    np.testing.assert_array_equal(pipe.prepare_inputs(prompts, max_sequence_length=24),
                                  expected_pipe.prepare_inputs(prompts, max_sequence_length=24))


def test_text_encoders_from_config(checkpoint, tmp_path):
    """A file of the MMDiT and VAE alone takes its text encoders from `config`, one of the MMDiT alone its VAE too;
    T5 may be left out."""
    variant, theirs, folder, _, (_, expected) = checkpoint
    save_file(to_single_file(theirs, text_encoders=False, t5=False), tmp_path / "bare.safetensors")
    _, params = single_file.load_sd3_single_file(tmp_path / "bare.safetensors", config=folder)
    assert_same_params(params, expected)
    parts, params = single_file.load_sd3_single_file(tmp_path / "bare.safetensors", config=folder,
                                                     left_out=("text_encoder_3",))
    assert parts["text_encoder_3"] is None and parts["tokenizer_3"] is None and "text_encoder_3" not in params
    assert_same_params(params, {k: v for k, v in expected.items() if k != "text_encoder_3"})
    StableDiffusion3(**parts)
    with pytest.raises(single_file.SingleFileError, match=r"holds no CLIP-L .*CLIP-G .*pass config="):
        single_file.load_sd3_single_file(tmp_path / "bare.safetensors")
    # A folder without T5 gives none
    no_t5 = tmp_path / "no_t5"
    shutil.copytree(folder, no_t5, ignore=shutil.ignore_patterns("text_encoder_3", "tokenizer_3"))
    index = json.loads((no_t5 / "model_index.json").read_text())
    (no_t5 / "model_index.json").write_text(json.dumps({**index, "text_encoder_3": [None, None],
                                                        "tokenizer_3": [None, None]}))
    for left_out in ((), ("text_encoder_3",)):
        parts, params = single_file.load_sd3_single_file(tmp_path / "bare.safetensors", config=no_t5,
                                                         left_out=left_out)
        assert parts["text_encoder_3"] is None and parts["tokenizer_3"] is None and "text_encoder_3" not in params
    # The MMDiT alone, without its prefix (as diffusers' SD3Transformer2DModel.from_single_file reads it too)
    alone = mmdit_to_stability(theirs.transformer.state_dict(), dict(theirs.transformer.config), p="")
    save_file({k: v.contiguous() for k, v in alone.items()}, tmp_path / "mmdit.safetensors")
    _, params = single_file.load_sd3_single_file(tmp_path / "mmdit.safetensors", config=folder)
    assert_same_params(params, expected)


def test_bundled_configs_path(checkpoint, monkeypatch):
    """Without `config`: the bundled CLIP tokenizer and configs (the tiny models' configs stand in for the bundled
    SD 3.5 ones, which are checked against diffusers below); T5 needs `config` for its tokenizer."""
    variant, theirs, folder, path, (expected_pipe, expected) = checkpoint
    bundled = folder.parent / "bundled"
    if not bundled.exists():
        for part in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "scheduler"):
            shutil.copytree(folder / part, bundled / part, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(single_file.SingleFileError, match="bundles no configs.*pass config="):
        single_file.load_sd3_single_file(path)  # the tiny MMDiT is no published size
    monkeypatch.setattr(single_file, "sd3_model_type", lambda state_dict: "sd35_medium")
    with pytest.raises(single_file.SingleFileError, match=r"holds T5 .*tokenizer_3/tokenizer.json.*=None"):
        single_file.load_sd3_single_file(path)
    monkeypatch.setattr(single_file, "bundled_config_folder", lambda version: str(bundled))
    parts, params = single_file.load_sd3_single_file(path, left_out=("text_encoder_3",))
    assert_same_params(params, {k: v for k, v in expected.items() if k != "text_encoder_3"})
    pipe = StableDiffusion3(**parts)
    prompts = ["a photo of an astronaut", ""]  # CLIP-L pads with <|endoftext|>, CLIP-G with "!"
    np.testing.assert_array_equal(pipe.prepare_inputs(prompts)[:, :154], expected_pipe.prepare_inputs(prompts)[:, :154])
    monkeypatch.undo()
    monkeypatch.setattr(single_file, "sd3_model_type", lambda state_dict: "sd35_medium")
    with pytest.raises(single_file.SingleFileError, match="bundled stable-diffusion-3.5-medium configs.*pass config="):
        single_file.load_sd3_single_file(path, left_out=("text_encoder_3",))  # the real configs do not fit


def test_unknown_tensors_fail(checkpoint, tmp_path):
    _, theirs, folder, _, _ = checkpoint
    bad = {"model.diffusion_model.joint_blocks.99.x_block.attn.qkv.weight": torch.zeros(2),
           "first_stage_model.encoder.down.0.attn.0.q.weight": torch.zeros(2), "mystery.tensor": torch.zeros(2)}
    save_file({**to_single_file(theirs), **bad}, tmp_path / "bad.safetensors")
    with pytest.raises(single_file.SingleFileError) as error:
        single_file.load_sd3_single_file(tmp_path / "bad.safetensors", config=folder)
    assert all(key in str(error.value) for key in bad) and "\n" not in str(error.value)


def test_a_fused_tensor_of_the_wrong_shape_is_named_in_one_line(checkpoint, tmp_path):
    """An attention's qkv whose rows do not split in three: numpy's "array split does not result in an equal
    division" before."""
    _, theirs, folder, _, _ = checkpoint
    state = to_single_file(theirs)
    key = next(k for k in state if k.endswith("x_block.attn.qkv.weight"))
    save_file({**state, key: state[key][:-1]}, tmp_path / "cut.safetensors")
    with pytest.raises(single_file.SingleFileError) as error:
        single_file.load_sd3_single_file(tmp_path / "cut.safetensors", config=folder)
    message = str(error.value)
    assert f"{key} has shape {tuple(state[key][:-1].shape)}: its rows do not split into the 3 tensors it holds " \
        "(transformer_blocks.0.attn.to_q.weight, " in message and "\n" not in message


def test_other_files_are_refused_in_one_line(checkpoint, tmp_path):
    _, _, folder, path, _ = checkpoint
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2),
               "cond_stage_model.transformer.text_model.final_layer_norm.weight": torch.zeros(2)},
              tmp_path / "sd1.safetensors")
    save_file({"transformer_blocks.0.attn.to_q.weight": torch.zeros(2)}, tmp_path / "diffusers.safetensors")
    for name, advice in (("sd1", "StableDiffusion\\(XL\\).from_single_file"),
                         ("diffusers", "StableDiffusion3.from_pretrained")):
        with pytest.raises(single_file.SingleFileError, match=f"not an SD 3 / 3.5 checkpoint.*{advice}") as error:
            single_file.load_sd3_single_file(tmp_path / f"{name}.safetensors", config=folder)
        assert "\n" not in str(error.value)
    with pytest.raises(single_file.SingleFileError, match="StableDiffusion3.from_single_file"):
        StableDiffusion.from_single_file(path)  # an SD 3 file given to the UNet pipelines
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        single_file.load_sd3_single_file(tmp_path / "missing.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# The bundled full-size configs and the tables, against diffusers' own models built on the meta device


def _meta_shapes(module):
    return {k: np.broadcast_to(np.zeros((), np.float16), tuple(v.shape)) for k, v in module.state_dict().items()}


@pytest.mark.parametrize("version", ["sd3", "sd35_medium", "sd35_large"])
def test_bundled_configs_map_a_full_size_checkpoint(version):
    from diffusers import AutoencoderKL
    from diffusers import SD3Transformer2DModel as TorchMMDiT

    from sdflax.models import AutoencoderKL as FlaxVAE
    from sdflax.models import SD3Transformer2DModel

    folder = single_file.bundled_config_folder(ldm_names.SD3_BUNDLED[version])
    configs = {c: json.load(open(f"{folder}/{c}/config.json")) for c in ("transformer", "vae")}
    configs["transformer"].update(ldm_names.SD3_TRANSFORMER_CHANGES.get(version, {}))
    drop = ("_class_name", "_diffusers_version")
    with torch.device("meta"):
        models = {"transformer": TorchMMDiT(**{k: v for k, v in configs["transformer"].items() if k not in drop}),
                  "vae": AutoencoderKL(**{k: v for k, v in configs["vae"].items() if k not in drop})}
    states = {c: _meta_shapes(m) for c, m in models.items()}
    file_state = {**mmdit_to_stability(states["transformer"], configs["transformer"]),
                  **vae_to_ldm(states["vae"], configs["vae"])}
    assert ldm_names.sd3_model_type(file_state) == version
    sdflax_configs = {"transformer": SD3TransformerConfig.from_dict(configs["transformer"]),
                      "vae": VAEConfig.from_dict(configs["vae"])}
    mapped, unknown = ldm_names.split_sd3(file_state, sdflax_configs, {"transformer", "vae"})
    assert not unknown
    for component, state in states.items():
        # The VAE's attention stays a 1x1 conv here; weights.py takes it as the linear layer it is.
        squeeze = lambda k, s: s[:2] if ".mid_block.attentions." in k and s[2:] == (1, 1) else s  # noqa: E731
        assert {k: squeeze(k, v.shape) for k, v in mapped[component].items()} == \
            {k: v.shape for k, v in state.items()}, component
    # And sdflax builds the same sizes from the bundled configs (shapes only: nothing is computed).
    for component, cls in (("transformer", SD3Transformer2DModel), ("vae", FlaxVAE)):
        shapes = cls.from_config(configs[component]).param_shapes()
        assert sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes)) == \
            sum(int(np.prod(v.shape)) for v in states[component].values()), component


def test_bundled_text_encoder_configs():
    """CLIP-L, CLIP-G and T5 XXL as transformers builds them from the bundled configs (the same in both folders),
    and sdflax to the same sizes."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from sdflax.models import CLIPTextModelWithProjection as FlaxCLIP
    from sdflax.models import T5EncoderModel as FlaxT5

    medium, large = (single_file.bundled_config_folder(v) for v in ("sd35_medium", "sd35_large"))
    for part in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae", "scheduler/scheduler_config.json"):
        path = part if part.endswith(".json") else f"{part}/config.json"
        assert json.load(open(f"{medium}/{path}")) == json.load(open(f"{large}/{path}")), part
    classes = {"text_encoder": (CLIPTextConfig, CLIPTextModelWithProjection, FlaxCLIP),
               "text_encoder_2": (CLIPTextConfig, CLIPTextModelWithProjection, FlaxCLIP),
               "text_encoder_3": (T5Config, T5EncoderModel, FlaxT5)}
    widths = {}
    for part, (config_class, torch_class, flax_class) in classes.items():
        config = json.load(open(f"{medium}/{part}/config.json"))
        with torch.device("meta"):
            theirs = torch_class(config_class(**config))
        sizes = {k: int(np.prod(v.shape)) for k, v in theirs.state_dict().items() if "embed_tokens" not in k}
        ours = flax_class.from_config(config).param_shapes()
        assert sum(int(np.prod(s.shape)) for s in jax.tree.leaves(ours)) == sum(sizes.values()), part
        widths[part] = config.get("projection_dim", config.get("d_model"))
    transformer = json.load(open(f"{medium}/transformer/config.json"))
    assert widths["text_encoder"] + widths["text_encoder_2"] == transformer["pooled_projection_dim"]
    assert widths["text_encoder_3"] == transformer["joint_attention_dim"]


def test_pipelines_from_single_file(checkpoint):
    """StableDiffusion3.from_single_file (and its image-to-image sibling) routes an SD 3 file to
    load_sd3_single_file: the params and images of from_pretrained; text_encoder_3=None leaves T5 out."""
    _, _, folder, path, (expected_pipe, expected) = checkpoint
    pipe, params = StableDiffusion3.from_single_file(path, config=folder)
    assert_same_params(params, expected)
    assert pipe.scheduler_base_config == expected_pipe.scheduler_base_config
    ids = pipe.prepare_inputs(["a red cat"], max_sequence_length=24)
    kwargs = dict(num_inference_steps=2, height=64, width=64, latents=np.ones((1, 16, 8, 8), np.float32))
    np.testing.assert_array_equal(pipe(ids, params, jax.random.PRNGKey(0), **kwargs).images,
                                  expected_pipe(ids, expected, jax.random.PRNGKey(0), **kwargs).images)
    pipe, params = StableDiffusion3Img2Img.from_single_file(path, config=folder, text_encoder_3=None)
    assert pipe.text_encoder_3 is None and "text_encoder_3" not in params
    with pytest.raises(ValueError, match="prediction_type"):
        StableDiffusion3.from_single_file(path, config=folder, prediction_type="epsilon")
