"""A1111's options on the command line, each the library calls it stands for: the prompt syntax (by default;
--plain-prompt off), --clip-skip N (diffusers' clip_skip=N-1), --vae FILE (an A1111 VAE file in LDM names),
--vae-tiling (diffusers' tiled decode) and --hires (latents upscaled, then img2img); the PNG text as A1111 writes it.
The VAE's tiled decode against diffusers' `enable_tiling()`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from builders import SD1, torch_vae
from test_cli import TINY, one_error_line
from test_cli_controlnet import as_the_cli, assert_close_to, run_cli_here

import jax

from sdflax.cli import main

PROMPT = "a (red:1.4) house, [blue] sky BREAK a hill"
NEGATIVE = "(ugly:1.3)"


def tiny_vae_config():
    return {k: v for k, v in json.loads((Path(TINY) / "vae" / "config.json").read_text()).items()
            if not k.startswith("_")}


def ldm_vae_file(vae, path):
    """A diffusers VAE's weights saved as an A1111 VAE file: LDM names, the attention's linear layers as 1x1 convs."""
    from safetensors.torch import save_file

    from sdflax.loading.ldm_names import vae_table
    from sdflax.models import VAEConfig

    inverse = {}
    for ldm, entry in vae_table(VAEConfig.from_dict(dict(vae.config))).items():
        target, leaves = entry if isinstance(entry, tuple) else (entry, {})
        inverse[target] = (ldm, {v: k for k, v in leaves.items()})
    tensors = {}
    for key, value in vae.state_dict().items():
        prefix = max((p for p in inverse if key.startswith(p + ".")), key=len)
        ldm, leaves = inverse[prefix]
        rest = key[len(prefix) + 1:]
        leaf = next((leaf for leaf in leaves if rest.startswith(leaf + ".")), None)
        attention = leaf in ("to_q", "to_k", "to_v", "to_out.0") and rest.endswith("weight")
        name = f"{ldm}.{leaves[leaf]}{rest[len(leaf):]}" if leaf else f"{ldm}.{rest}"
        tensors[name] = (value[..., None, None] if attention else value).contiguous()
    save_file(tensors, str(path))


def test_tiled_decode_is_diffusers(tmp_path):
    """A VAE with `tiling=True` decodes as diffusers' `enable_tiling()` at 1e-3, on latents of 2x2 tiles; diffusers'
    whole decode differs from both (the tiles' seams and borders show)."""
    from sdflax import AutoencoderKL
    from sdflax.pipeline.vae import VAE

    theirs = torch_vae({**SD1["vae"], "sample_size": 16}, seed=3)  # tiles of 16 pixels, 8 latents, stride 6
    theirs.save_pretrained(tmp_path)
    vae, params = AutoencoderKL.from_pretrained(tmp_path)
    latents = np.random.default_rng(0).standard_normal((1, 4, 12, 12), np.float32)
    tiled = jax.jit(VAE(vae.clone(tiling=True)).decode)({"vae": params}, latents)
    with torch.no_grad():
        whole = theirs.decode(torch.from_numpy(latents) / vae.config.scaling_factor).sample
        theirs.enable_tiling()
        expected = theirs.decode(torch.from_numpy(latents) / vae.config.scaling_factor).sample
    expected, whole = (np.clip(x.numpy().transpose(0, 2, 3, 1) / 2 + 0.5, 0, 1) for x in (expected, whole))
    np.testing.assert_allclose(tiled, expected, atol=1e-3)
    assert np.abs(expected - whole).max() > 1e-2


@pytest.fixture(scope="module")
def vae_file(tmp_path_factory):
    """A VAE of the checkpoint's architecture as a folder and as an A1111 file."""
    folder = tmp_path_factory.mktemp("vae")
    theirs = torch_vae(tiny_vae_config(), seed=5)
    theirs.save_pretrained(folder / "folder")
    ldm_vae_file(theirs, folder / "vae-ft-tiny.safetensors")
    return folder


def test_vae_file_is_its_folder(vae_file):
    """--vae FILE's params are those of the same VAE as a diffusers folder, and not the checkpoint's."""
    from sdflax import AutoencoderKL, StableDiffusion
    from sdflax.loading.vae_file import vae_file_params

    pipe, params = StableDiffusion.from_pretrained(TINY)
    _, folder_params = AutoencoderKL.from_pretrained(vae_file / "folder")
    file_params = vae_file_params(pipe.vae, vae_file / "vae-ft-tiny.safetensors", np.float32)
    jax.tree.map(np.testing.assert_array_equal, file_params, folder_params)
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), file_params,
                                            params["vae"]))) > 1e-2


def test_a1111_options_are_the_library_calls(vae_file, tmp_path, capsys, monkeypatch):
    """One run with every option: the prompt syntax, --clip-skip 2, --vae FILE, --vae-tiling and --hires 2 =
    prepare_inputs(weighting="a1111"), clip_skip=1, the folder's VAE tiled, output_type="latent", the latents
    upscaled bilinearly and StableDiffusionImg2Img at --hires-strength; the PNG text A1111's."""
    from sdflax import AutoencoderKL, StableDiffusion, StableDiffusionImg2Img

    vae = str(vae_file / "vae-ft-tiny.safetensors")
    result = run_cli_here(["generate", PROMPT, "--negative-prompt", NEGATIVE, "--model", TINY, "--steps", "2",
                           "--seed", "7", "--height", "24", "--width", "32", "--clip-skip", "2", "--vae", vae,
                           "--vae-tiling", "--hires", "2", "--hires-strength", "0.5", "--hires-steps", "3",
                           "--no-progress", "--out", str(tmp_path / "out")], tmp_path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    path = result.stdout.split()[0]
    keys = as_the_cli(7)
    n = len(keys)
    pipe, params = StableDiffusion.from_pretrained(TINY)
    _, params["vae"] = AutoencoderKL.from_pretrained(vae_file / "folder")
    pipe = pipe.replace(vae=pipe.vae.clone(tiling=True))  # pictures smaller than its tiles: decoded whole
    ids, weights = pipe.prepare_inputs([PROMPT] * n, weighting="a1111")
    neg, neg_weights = pipe.prepare_inputs([NEGATIVE] * n, weighting="a1111")
    text = dict(neg_prompt_ids=neg, prompt_weights=weights, neg_prompt_weights=neg_weights, clip_skip=1)
    latents = pipe.generate_sharded(ids, params, keys, 2, height=24, width=32, output_type="latent", **text)
    upscaled = np.asarray(jax.image.resize(latents, (n, 4, 12, 16), "bilinear"))  # 48x64 pictures
    img2img = StableDiffusionImg2Img(**pipe.components())
    made = img2img.generate_sharded(ids, upscaled, params, keys, 0.5, 3, **text)
    assert made.shape == (n, 48, 64, 3)
    assert_close_to(path, made[0])
    png = Image.open(path).text
    assert png["prompt"] == PROMPT and png["parameters"] == (
        f"{PROMPT}\nNegative prompt: {NEGATIVE}\nSteps: 2, Sampler: PLMS, CFG scale: 7.5, Seed: 7, Size: 32x24, "
        f"Model: {TINY}, VAE: {vae}, Clip skip: 2, Denoising strength: 0.5, Hires upscale: 2, Hires steps: 3, "
        "Hires upscaler: Latent")
    # what each option changes: the weights and clip_skip the text states and the image (test_prompt_weighting.py),
    # the VAE file its params and the tiles the decode (the tests above)


def test_bad_flags_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = ["--out", str(tmp_path / "out")]
    assert main(["generate", "a", "--model", TINY, "--hires-strength", "0.5", *out]) == 2
    assert "--hires-strength applies with --hires: add --hires SCALE, or drop --hires-strength" in \
        one_error_line(capsys)
    assert main(["generate", "a", "--model", TINY, "--hires", "0.5", *out]) == 2
    assert "--hires: must be in [1, 8], got 0.5" in one_error_line(capsys)
    assert main(["generate", "a", "--model", TINY, "--clip-skip", "0", *out]) == 2
    assert "--clip-skip: must be at least 1, got 0" in one_error_line(capsys)
    bad = tmp_path / "not-a-vae.safetensors"
    from safetensors.numpy import save_file

    save_file({"encoder.conv_in.weight": np.zeros((2, 2), np.float32), "something.else": np.zeros(1, np.float32)},
              str(bad))
    assert main(["generate", "a", "--model", TINY, "--vae", str(bad), "--steps", "1", "--no-progress", *out]) == 2
    assert f"--vae {bad}: {bad}: 1 tensors that are not a VAE's in LDM names (something.else)" in \
        one_error_line(capsys)


def test_prompts_without_syntax_keep_the_plain_program():
    """A prompt A1111 reads as diffusers does passes plain ids (the library's plain program); brackets, BREAK or
    more than 75 tokens pass A1111's ids and weights; --plain-prompt never does, and the PNG says Emphasis: None."""
    from sdflax import StableDiffusion
    from sdflax.cli.features import prompt_syntax
    from sdflax.cli.request import Request

    pipe, _ = StableDiffusion.from_pretrained(TINY)
    syntax, plain = Request("generate", "x"), Request("generate", "x", plain_prompt=True)
    ids, weights = prompt_syntax.prepared(pipe, syntax, ["a house, on a hill"], {})
    assert weights is None and ids.shape == (1, 77)
    for prompt in ("a (house)", "a BREAK house", "house " * 80):
        ids, weights = prompt_syntax.prepared(pipe, syntax, [prompt], {})
        assert weights is not None and ids.shape == weights.shape
        assert prompt_syntax.prepared(pipe, plain, [prompt], {})[1] is None
    assert prompt_syntax.parameters({"plain_prompt": True, "prompt": "a (house)"}) == ", Emphasis: None"
