"""`--guider NAME --guider-arg KEY=VALUE`: the image the library makes with that guider, recorded in the PNG; bad
guider input is one line and status 2, before anything loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from test_cli import TINY, assert_help_lists, one_error_line
from test_cli_controlnet import as_the_cli, assert_close_to, run_cli_here

from sdflax.cli import main


def test_a_guider_makes_the_librarys_image_and_the_png_records_it(tmp_path):
    from sdflax import StableDiffusion
    from sdflax.guiders import AdaptiveProjectedGuidance

    result = run_cli_here(["generate", "a house", "--model", TINY, "--steps", "2", "--seed", "7", "--height", "32",
                           "--width", "32", "--guidance", "10", "--guider", "apg", "--guider-arg", "momentum=-0.5",
                           "--guider-arg", "eta=0", "--guider-arg", "norm_dim=-2,-1", "--no-progress", "--out",
                           str(tmp_path / "out")], tmp_path, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    path = result.stdout.split()[0]
    pipe, params = StableDiffusion.from_pretrained(TINY)
    keys = as_the_cli(7)
    ids, neg = pipe.prepare_inputs(["a house"] * len(keys)), pipe.prepare_inputs([""] * len(keys))
    guider = AdaptiveProjectedGuidance(guidance_scale=10.0, adaptive_projected_guidance_momentum=-0.5, eta=0.0,
                                       adaptive_projected_guidance_norm_dim=(-2, -1))
    expected = pipe.with_guider(guider).generate_sharded(ids, params, keys, 2, neg_prompt_ids=neg, height=32,
                                                         width=32)
    assert_close_to(path, expected[0])
    plain = pipe.generate_sharded(ids, params, keys, 2, guidance_scale=10.0, neg_prompt_ids=neg, height=32, width=32)
    assert np.abs(plain[0] - expected[0]).max() > 0.02  # the guider made the image
    text = Image.open(path).text
    assert text["guider"] == "AdaptiveProjectedGuidance" and text["guidance_scale"] == "10.0"
    assert json.loads(text["guider_args"]) == {
        "adaptive_projected_guidance_momentum": -0.5, "adaptive_projected_guidance_rescale": 15.0,
        "adaptive_projected_guidance_norm_dim": [-2, -1], "eta": 0, "guidance_rescale": 0.0,
        "use_original_formulation": False, "start": 0.0, "stop": 1.0, "enabled": True}


@pytest.mark.parametrize("args, expected", [
    (["--guider", "nope"], "argument --guider: unknown guider 'nope': one of cfg, apg"),
    (["--guider", "apg", "--guider-arg", "momentum"], "argument --guider-arg: expected KEY=VALUE (e.g. "
     "momentum=-0.5), got 'momentum'"),
    (["--guider", "apg", "--guider-arg", "eta=x"], "--guider apg: AdaptiveProjectedGuidance: eta='x': expected a "
     "number, true, false"),
    (["--guider", "pag", "--guider-arg", "config=mid_block:x"], "--guider pag: PerturbedAttentionGuidance: "
     "perturbed_guidance_config='mid_block:x': expected a layer list and its indices, e.g. "
     "mid_block.attentions.0.transformer_blocks:0"),
    (["--guider", "pag"], "--guider pag perturbs the layers you name: add --guider-arg config=FQN:INDICES, the list "
     "of modules and the indices of those perturbed, e.g. config=mid_block.attentions.0.transformer_blocks:0"),
    (["--guider", "seg", "--guider-arg", "config=down_blocks.9.attentions.0.transformer_blocks:0"],
     "sdflax: error: seg_guidance_config: 'down_blocks.9.attentions.0.transformer_blocks.0' is no module of this "
     "UNet with attention layers in it"),
    (["--guider", "apg", "--guider-arg", "eta=1e39"], "eta='1e39': must be finite as float32"),
    (["--guider", "apg", "--guider-arg", "rescale=1"], "--guider apg: AdaptiveProjectedGuidance: 'rescale' matches "
     "several of its arguments: adaptive_projected_guidance_rescale, guidance_rescale"),
    (["--guider", "cfg", "--guider-arg", "momentum=1"], "--guider cfg: ClassifierFreeGuidance: 'momentum' is not "
     "one of its arguments"),
    (["--guider", "cfg", "--guider-arg", "start=1.5"], "--guider cfg: ClassifierFreeGuidance: start=1.5 must be in "
     "[0, 1)"),
    (["--guider", "cfg", "--guider-arg", "guidance_scale=3"], "--guider-arg guidance_scale=...: give the scale as "
     "--guidance"),
    (["--guider-arg", "eta=0"], "--guider-arg applies with --guider: add --guider NAME, or drop it"),
    (["--guider", "cfg", "--guider-arg", "start=0.1,0.2"], "--guider cfg: ClassifierFreeGuidance: start=(0.1, 0.2) "
     "must be a number, a fraction of the steps"),  # was a TypeError's words
    # a traceback from the trace: CFG++ re-noises with the unconditional prediction a guider replaces
    (["--guider", "apg", "--scheduler", "Euler CFG++"], "--guider apg with --scheduler 'Euler CFG++': a CFG++ "
     "scheduler re-noises with classifier-free guidance's unconditional prediction, which the guider replaces"),
    (["--guider", "fdg", "--guidance", "7"], "--guider fdg has a guidance scale per frequency level: give them as "
     "--guider-arg guidance_scales=10,5 instead of --guidance"),
    (["--guider", "fdg", "--guider-arg", "guidance_scales=10,5", "--guider-arg", "guidance_rescale=0,0,0"],
     "--guider fdg: FrequencyDecoupledGuidance"),
])
def test_bad_guider_input_is_one_line_and_status_2(args, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "a house", "--model", TINY, *args, "--no-progress", "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


def test_help_lists_the_guider_options(capsys):
    assert_help_lists(capsys, "--guider NAME", "--guider-arg KEY=VALUE")


def test_a_layer_config_in_words_is_the_guiders_config():
    from sdflax.cli.features.guider import guider_argument
    from sdflax.guiders import LayerSkipConfig, PerturbedAttentionGuidance, guider_from_name

    key, value = guider_argument("config=mid_block.attentions.0.transformer_blocks:0,1")
    assert guider_from_name("pag", **{key: value}, perturbed_guidance_scale=3.0) == PerturbedAttentionGuidance(
        perturbed_guidance_scale=3.0, perturbed_guidance_config=LayerSkipConfig(
            indices=[0, 1], fqn="mid_block.attentions.0.transformer_blocks", skip_attention=False,
            skip_attention_scores=True, skip_ff=False))
