"""`sdflax demo`'s stand-ins are genuine hub checkpoints: diffusers and transformers read every folder sdflax writes,
and each model computes on them what sdflax's computes (which proves the names and layouts of the writer, the
loader's inverse); `sdflax demo all` runs with torch not importable, and `sdflax generate` runs the docs pages'
command-line forms on what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from builders import REPO
from compile_flags import xla_flags

RTOL = 1e-4  # float32 models
PROMPT = "a photo of a red fox, watercolor"


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    from sdflax import write_demo

    out = tmp_path_factory.mktemp("demo")
    write_demo("all", out)
    return out


def inputs(config, rng):
    """Fixed inputs for a model of `config` (its config.json): (args for sdflax's apply, for torch's call)."""
    import torch

    name = config.get("_class_name") or config["architectures"][0]
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    if name in ("UNet2DConditionModel", "ControlNetModel"):
        x = dict(sample=normal(1, config["in_channels"], 16, 16), timesteps=np.array([500]),
                 encoder_hidden_states=normal(1, 7, config["cross_attention_dim"]))
        if name == "ControlNetModel":
            x["controlnet_cond"] = rng.uniform(0, 1, (1, 3, 32, 32)).astype(np.float32)
        added = {}
        if config.get("addition_embed_type") == "text_time":  # the pooled width is the second encoder's, 32
            time_ids = (config["projection_class_embeddings_input_dim"] - 32) // config["addition_time_embed_dim"]
            added = dict(text_embeds=normal(1, 32), time_ids=np.array([[32, 32, 0, 0, 32, 32][:time_ids]], np.float32))
        theirs = {{"timesteps": "timestep"}.get(k, k): torch.from_numpy(v) for k, v in x.items()}
        return ({**x, **added}, {**theirs, "added_cond_kwargs": {k: torch.from_numpy(v) for k, v in added.items()},
                                 "return_dict": False})
    if name == "AutoencoderKL":
        z = normal(1, config["latent_channels"], 8, 8)
        return dict(latents=z), dict(z=torch.from_numpy(z), return_dict=False)
    if name.startswith("CLIPText"):  # a prompt's shape: start, words, end, padding
        ids = np.array([[49406, *rng.integers(0, 49405, 7), *[49407] * 8]])
        return dict(input_ids=ids), dict(input_ids=torch.from_numpy(ids))
    if name == "T5EncoderModel":
        ids = rng.integers(0, config["vocab_size"], (1, 9))
        return dict(input_ids=ids), dict(input_ids=torch.from_numpy(ids))
    if name == "SD3Transformer2DModel":
        x = (normal(1, 16, 16, 16), normal(1, 7, config["joint_attention_dim"]),
             normal(1, config["pooled_projection_dim"]), np.array([999.0], np.float32))
        return x, dict(zip(("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
                           map(torch.from_numpy, x)), return_dict=False)
    if name == "T2IAdapter":
        image = rng.uniform(0, 1, (1, config["in_channels"], 32, 32)).astype(np.float32)
        return (image,), dict(x=torch.from_numpy(image))
    assert name == "CLIPVisionModelWithProjection"
    pixels = normal(1, 3, config["image_size"], config["image_size"])
    return (pixels,), dict(pixel_values=torch.from_numpy(pixels))


def outputs(result) -> list[np.ndarray]:
    """The arrays a model returned (a tensor, a tuple of them, or a model output), flattened, as numpy."""
    import jax

    for field in ("sample", "last_hidden_state", "image_embeds"):
        if hasattr(result, field) and not isinstance(result, tuple):
            result = [getattr(result, field), *([result.text_embeds] if getattr(result, "text_embeds", None)
                                                is not None else [])]
    return [np.asarray(x.detach() if hasattr(x, "detach") else x, np.float32)
            for x in jax.tree.leaves(result, is_leaf=lambda x: hasattr(x, "detach"))]


# (folder, model): one of each kind of model the stand-ins hold (the others share a kind and a config's fields).
MODELS = [("tiny-sd15", "unet"), ("tiny-sd15", "vae"), ("tiny-sd15", "text_encoder"), ("tiny-sdxl", "unet"),
          ("tiny-sdxl", "text_encoder_2"), ("tiny-sdxl-refiner", "unet"), ("tiny-sd35", "transformer"),
          ("tiny-sd35", "vae"), ("tiny-sd35", "text_encoder_2"), ("tiny-sd35", "text_encoder_3"),
          ("tiny-sd15-controlnet", ""), ("tiny-sdxl-controlnet", ""), ("tiny-t2i-adapter", ""),
          ("tiny-ip-adapter", "models/image_encoder")]


@pytest.mark.parametrize("folder, model", MODELS, ids=["/".join(filter(None, m)) for m in MODELS])
def test_models_match_diffusers_and_transformers(stand_ins, folder, model):
    import diffusers
    import torch
    import transformers

    import sdflax.models
    from sdflax.models.config import read_config_file

    path = stand_ins / folder / model
    config = read_config_file(path / "config.json")
    name = config.get("_class_name") or config["architectures"][0]
    theirs = getattr(diffusers if "_class_name" in config else transformers, name).from_pretrained(path).eval()
    ours, params = getattr(sdflax.models, name).from_pretrained(path)
    ours_x, theirs_x = inputs(config, np.random.default_rng(0))
    if name == "AutoencoderKL":
        with torch.no_grad():
            expected = outputs(theirs.decode(**theirs_x))
        got = outputs(ours.apply(params, ours_x["latents"], method="decode"))
    else:
        with torch.no_grad():
            expected = outputs(theirs(**theirs_x))
        got = outputs(ours.apply(params, *ours_x) if isinstance(ours_x, tuple) else ours.apply(params, **ours_x))
    assert len(got) == len(expected) > 0
    for i, (a, b) in enumerate(zip(got, expected)):
        assert b.std() > 1e-2, f"output {i} is ~constant: the comparison would prove nothing"
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * np.abs(b).max(), err_msg=f"output {i}")


PIPELINES = {"tiny-sd15": "StableDiffusionPipeline", "tiny-sdxl": "StableDiffusionXLPipeline",
             "tiny-sdxl-refiner": "StableDiffusionXLImg2ImgPipeline", "tiny-sd35": "StableDiffusion3Pipeline"}


@pytest.mark.parametrize("folder", sorted(PIPELINES))
def test_diffusers_reads_the_pipelines(stand_ins, folder):
    """model_index.json, the tokenizers (the same ids as sdflax's) and the scheduler, as diffusers reads them."""
    from diffusers import DiffusionPipeline

    from sdflax.loading.tokenizers import CLIPTokenizer, T5Tokenizer

    theirs = DiffusionPipeline.from_pretrained(stand_ins / folder)
    assert type(theirs).__name__ == PIPELINES[folder]
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        tokenizer = getattr(theirs, name, None)
        if tokenizer is None:
            continue
        expected = tokenizer(PROMPT, padding="max_length", max_length=16, truncation=True).input_ids
        if name == "tokenizer_3":
            ids = T5Tokenizer.from_folder(stand_ins / folder / name)(PROMPT, max_length=16)[0]
            assert tokenizer.convert_ids_to_tokens(expected)[:3] == ["▁a", "▁photo", "▁of"]
        else:
            ids = CLIPTokenizer.from_folder(stand_ins / folder / name)(PROMPT, padding="max_length", max_length=16,
                                                                     truncation=True).input_ids
        assert list(ids) == list(expected), name


def test_ip_adapter_reads_as_diffusers_reads_it(stand_ins):
    """h94's file: diffusers' image projection computes what sdflax's does, and its to_k_ip / to_v_ip are sdflax's,
    layer by layer, in diffusers' order."""
    import torch
    from diffusers import StableDiffusionPipeline

    from sdflax.loading.ip_adapter import read_ip_adapter

    theirs = StableDiffusionPipeline.from_pretrained(stand_ins / "tiny-sd15")
    theirs.load_ip_adapter(stand_ins / "tiny-ip-adapter", subfolder="models", weight_name="ip-adapter_sd15.safetensors")
    ours = read_ip_adapter(stand_ins / "tiny-ip-adapter" / "models" / "ip-adapter_sd15.safetensors")
    embeds = np.random.default_rng(0).standard_normal((1, 24), dtype=np.float32)
    with torch.no_grad():
        expected = theirs.unet.encoder_hid_proj.image_projection_layers[0](torch.from_numpy(embeds)).numpy()
    got = np.asarray(ours.projection.apply({"params": ours.projection_params}, embeds))
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())
    layers = [p for p in theirs.unet.attn_processors.values() if hasattr(p, "to_k_ip")]
    assert len(layers) == len(ours.to_k_ip) == 4
    for layer, k, v in zip(layers, ours.to_k_ip, ours.to_v_ip):
        np.testing.assert_array_equal(np.asarray(k).T, layer.to_k_ip[0].weight.detach().numpy())
        np.testing.assert_array_equal(np.asarray(v).T, layer.to_v_ip[0].weight.detach().numpy())


def test_an_existing_folder_or_an_unwritable_out_is_refused_in_one_line(stand_ins, capsys):
    from sdflax.cli.commands import main

    before = sorted(p.name for p in (stand_ins / "tiny-sd35").iterdir())
    assert main(["demo", "all", "--out", str(stand_ins)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists" in err
    assert sorted(p.name for p in (stand_ins / "tiny-sd35").iterdir()) == before
    assert main(["demo", "t2i-adapter", "--out", str(stand_ins / "tiny-sd15" / "model_index.json" / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sdflax: error: --out ")


NO_TORCH = """import sys
class NoTestExtras:  # as in an install of sdflax's runtime dependencies only
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "diffusers", "transformers", "safetensors", "peft"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoTestExtras())
"""


def test_demo_and_the_docs_commands_run_offline_without_torch(tmp_path):
    """With torch, diffusers, transformers, safetensors and peft not importable: `sdflax demo all`, then the docs
    pages' `sdflax generate` forms for SDXL (with its refiner), SD 3.5 (with skip-layer guidance), ControlNet,
    IP-Adapter and T2I-Adapter on what it wrote, each writing a PNG."""
    from PIL import Image

    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(NO_TORCH)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path / "hide"), str(REPO)])}
    env["XLA_FLAGS"] = xla_flags(1)  # one CPU device, as a user's; compiled with the suite's options (the docs' too)

    def sdflax(*args):
        done = subprocess.run([sys.executable, "-m", "sdflax", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr[-2000:]

    for name in ("torch", "diffusers"):
        done = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert f"No module named '{name}'" in done.stderr
    sdflax("demo", "all", "--out", "w")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), np.uint8)).save(tmp_path / "photo.png")
    edges = np.zeros((32, 32, 3), np.uint8)
    edges[16], edges[:, 10] = 255, 255
    Image.fromarray(edges).save(tmp_path / "edges.png")
    runs = {"sdxl": ["--model", "w/tiny-sdxl", "--refiner", "w/tiny-sdxl-refiner", "--high-noise-frac", "0.8",
                     "--steps", "4"],
            "sd35": ["--model", "w/tiny-sd35", "--slg-layers", "7,8,9", "--steps", "6"],
            "controlnet": ["--model", "w/tiny-sd15", "--controlnet", "w/tiny-sd15-controlnet", "--control-image",
                           "edges.png", "--steps", "2"],
            "ip-adapter": ["--model", "w/tiny-sd15", "--ip-adapter", "w/tiny-ip-adapter/models/ip-adapter_sd15"
                           ".safetensors", "--ip-image", "photo.png", "--steps", "2"],
            "t2i-adapter": ["--model", "w/tiny-sd15", "--t2i-adapter", "w/tiny-t2i-adapter", "--adapter-image",
                            "edges.png", "--steps", "2"]}
    for name, args in runs.items():
        sdflax("generate", "a house by a lake", *args, "--seed", "0", "--out", f"{name}.png")
        assert Image.open(tmp_path / f"{name}.png").size == (32, 32), name


def test_stand_ins_are_small(stand_ins):
    for folder in stand_ins.iterdir():
        size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
        assert size < 25e6, f"{folder.name} is {size / 1e6:.1f} MB"
