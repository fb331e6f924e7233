"""The command line's smaller features, each the library's image: `--eta` (the scheduler's eta) and `--vae` (another
VAE than the checkpoint's); each recorded in the PNG, its bad input one line and status 2 before anything loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from test_cli import TINY, one_error_line
from test_cli_controlnet import as_the_cli, assert_close_to, run_cli_here

from sdflax.cli import main


def test_eta_makes_the_librarys_image_and_the_png_records_it(tmp_path, capsys, monkeypatch):
    """--eta is the scheduler's eta, as `scheduler_config={"eta": ...}` gives it in the library; a sampler without
    one refuses it in one line."""
    from sdflax import StableDiffusion

    result = run_cli_here(["generate", "a house", "--model", TINY, "--steps", "3", "--seed", "7", "--height", "32",
                           "--width", "32", "--scheduler", "ddim", "--eta", "1", "--no-progress", "--out",
                           str(tmp_path / "out")], tmp_path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    path = result.stdout.split()[0]
    keys = as_the_cli(7)
    made = {}
    for eta in (1.0, 0.0):
        pipe, params = StableDiffusion.from_pretrained(TINY, scheduler="ddim", scheduler_config={"eta": eta})
        ids, neg = pipe.prepare_inputs(["a house"] * len(keys)), pipe.prepare_inputs([""] * len(keys))
        made[eta] = pipe.generate_sharded(ids, params, keys, 3, neg_prompt_ids=neg, height=32, width=32)[0]
    assert_close_to(path, made[1.0])
    assert np.abs(made[1.0] - made[0.0]).max() > 0.02  # the noise eta adds made the image
    text = Image.open(path).text
    assert text["eta"] == "1.0" and text["parameters"].endswith(", Eta: 1.0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "a house", "--model", TINY, "--scheduler", "euler", "--eta", "1", "--out",
                 str(tmp_path / "other")]) == 2
    assert "--eta applies to the samplers that add noise by an eta (DDIM, DPM++ 3M SDE, TCD), and --scheduler euler " \
        "(EulerScheduler) has none: drop --eta, or add --scheduler ddim" in one_error_line(capsys)


def test_vae_makes_the_librarys_image_with_that_vae(tmp_path, capsys, monkeypatch):
    """--vae FOLDER: the pipeline with that VAE (its params in place of the checkpoint's); one of other latents is
    refused before anything loads."""
    import json

    from builders import torch_vae

    from sdflax import AutoencoderKL, StableDiffusion

    config = {k: v for k, v in json.loads((Path(TINY) / "vae" / "config.json").read_text()).items()
              if not k.startswith("_")}
    torch_vae(config, seed=5).save_pretrained(tmp_path / "other-vae")
    torch_vae({**config, "latent_channels": 8}, seed=5).save_pretrained(tmp_path / "wide-vae")
    result = run_cli_here(["generate", "a house", "--model", TINY, "--steps", "2", "--seed", "7", "--height", "32",
                           "--width", "32", "--vae", str(tmp_path / "other-vae"), "--no-progress", "--out",
                           str(tmp_path / "out")], tmp_path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    path = result.stdout.split()[0]
    pipe, params = StableDiffusion.from_pretrained(TINY)
    vae, vae_params = AutoencoderKL.from_pretrained(tmp_path / "other-vae")
    keys = as_the_cli(7)
    ids, neg = pipe.prepare_inputs(["a house"] * len(keys)), pipe.prepare_inputs([""] * len(keys))
    made = {name: p.generate_sharded(ids, ps, keys, 2, neg_prompt_ids=neg, height=32, width=32)[0]
            for name, p, ps in (("other", pipe.replace(vae=vae), {**params, "vae": vae_params}),
                                ("own", pipe, params))}
    assert_close_to(path, made["other"])
    assert np.abs(made["other"] - made["own"]).max() > 0.02  # the VAE made the picture
    text = Image.open(path).text
    assert text["vae"] == str(tmp_path / "other-vae") and f", VAE: {tmp_path / 'other-vae'}" in text["parameters"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()  # diffusers' words while the VAEs were made
    assert main(["generate", "a house", "--model", TINY, "--vae", str(tmp_path / "wide-vae"), "--out",
                 str(tmp_path / "other")]) == 2
    assert f"--vae {tmp_path / 'wide-vae'} takes latents of 8 channels at 1/4 of the picture, {TINY}'s are 4 at " \
        "1/4: give a VAE made for this base model" in one_error_line(capsys)
