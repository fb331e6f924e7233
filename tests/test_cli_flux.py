"""Flux.1 on the command line: `generate`, `img2img` and `inpaint --model <a Flux folder or a transformer file in
Black Forest Labs' layout with --config>`, `--guidance` (the distilled guidance), `--true-cfg` with a negative
prompt, `--prompt-2` (T5's), `--max-sequence-length`, a perturbed guider, and Fill under `inpaint`, in process on a
small random FLUX.1-dev-shaped checkpoint written here by diffusers (and its transformer, and a Fill transformer, as
BFL files): each PNG equals the library's image for the same inputs and keys and records what made it (A1111's CFG
scale the true CFG's, Forge's Distilled CFG Scale); the defaults are the Flux pipelines' (schnell's 4 steps); the
flags and features Flux.1 does not take, and its flags with other models, are one line and status 2."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from test_cli import TINY, assert_help_lists, close_to, one_error_line, pixels, rows
from test_cli_controlnet import as_the_cli

from sdflax.cli import main

SIZE = 32  # pixels; latents 4x4 (VAE scale factor 8), 2x2 tokens
STEPS = 4
T5_LENGTH = 16
SEED = 7
PROMPT, PROMPT_2, NEGATIVE = "a lighthouse at dusk", "an oil painting, dramatic light", "blurry"
COMMON = ["--height", str(SIZE), "--width", str(SIZE), "--steps", str(STEPS), "--seed", str(SEED),
          "--max-sequence-length", str(T5_LENGTH), "--no-progress", "--num-images", "1"]
PAG = ["--guider", "pag", "--guider-arg", "config=transformer_blocks:1", "--guider-arg", "perturbed_guidance_stop=1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small FLUX.1-dev checkpoint (diffusers' FluxPipeline.save_pretrained), its transformer and a Fill
    transformer as BFL files, schnell's configs (no weights: the checks read configs alone), an input picture and
    mask, and the files the refusals name."""
    import json
    import shutil

    from safetensors.torch import save_file
    from test_flux_model import to_bfl
    from test_flux_pipeline import TRANSFORMER, torch_flux_pipeline, torch_flux_transformer

    tmp = tmp_path_factory.mktemp("cli-flux")
    theirs = torch_flux_pipeline(tmp)
    theirs.save_pretrained(tmp / "flux", safe_serialization=True)
    save_file(to_bfl(theirs.transformer.state_dict(), TRANSFORMER), tmp / "flux1-dev.safetensors")
    # Fill's transformer: latents, masked image latents and the 8x8-folded mask, each 2x2 patch packed
    fill = torch_flux_transformer(5, guidance_embeds=True, in_channels=4 * (16 + 16 + 64), out_channels=64)
    save_file(to_bfl(fill.state_dict(), TRANSFORMER), tmp / "flux1-fill-dev.safetensors")
    shutil.copytree(tmp / "flux", tmp / "schnell", ignore=shutil.ignore_patterns("*.safetensors"))
    config = tmp / "schnell" / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "guidance_embeds": False}))
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(tmp / "in.png")
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[6:24, 4:26] = 255
    Image.fromarray(mask).save(tmp / "mask.png")
    for name in ("lora.safetensors", "token.pt", "ip/ip.safetensors", "ip/image_encoder/config.json"):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text("{}")
    return tmp


def cli(files, name, *args, model="flux"):
    """The command in process (on this session's devices: a row per device, seeds SEED, SEED + 1, ...); the PNG."""
    assert main([*args, "--model", str(files / model), *COMMON, "--out", str(files / name)]) == 0
    return files / name


def library(pipe, params, *pictures, negative="", prompt_2=None, **kwargs):
    """The library's image of the CLI's call: its rows and keys, and the negative prompt's ids it always passes."""
    keys = as_the_cli(SEED)
    inputs = pipe.prepare_inputs([PROMPT], *pictures, prompts_2=prompt_2 and [prompt_2],
                                 max_sequence_length=T5_LENGTH)
    arrays = rows(inputs if pictures else [inputs], keys)
    neg = rows([pipe.prepare_inputs([negative], max_sequence_length=T5_LENGTH)], keys)[0]
    size = {} if pictures else dict(height=SIZE, width=SIZE)
    return pipe.generate_sharded(*arrays, params, keys, num_inference_steps=STEPS, neg_prompt_ids=neg, **size,
                                 **kwargs)[0]


@pytest.fixture(scope="module")
def dev(files):
    from sdflax import Flux

    return Flux.from_pretrained(files / "flux")


@pytest.fixture(scope="module")
def generated(files):
    """The CLI's text-to-image PNGs: dev's distilled guidance with T5's own prompt; true CFG."""
    return {"plain": cli(files, "plain.png", "generate", PROMPT, "--prompt-2", PROMPT_2, "--guidance", "5"),
            "true_cfg": cli(files, "true-cfg.png", "generate", PROMPT, "--true-cfg", "4", "--negative-prompt",
                            NEGATIVE)}


def test_generate_equals_the_library_and_records_its_settings(dev, generated):
    """--guidance is the call's guidance_scale (the distilled one), --true-cfg its true_cfg_scale, run against the
    negative prompt; A1111's CFG scale is the true CFG's, Forge's Distilled CFG Scale the distilled one's."""
    close_to(generated["plain"], library(*dev, prompt_2=PROMPT_2, guidance_scale=5.0))
    expected = library(*dev, negative=NEGATIVE, guidance_scale=3.5, true_cfg_scale=4.0)
    close_to(generated["true_cfg"], expected)
    assert np.abs(expected - library(*dev, negative=NEGATIVE, guidance_scale=3.5)).max() > 0.02  # true CFG ran
    text = Image.open(generated["plain"]).text
    assert {k: text[k] for k in ("prompt", "prompt_2", "steps", "guidance_scale", "true_cfg_scale", "scheduler",
                                 "sampler", "max_sequence_length", "width", "height")} == {
        "prompt": PROMPT, "prompt_2": PROMPT_2, "steps": str(STEPS), "guidance_scale": "5.0", "true_cfg_scale": "1.0",
        "scheduler": "flow_match_euler", "sampler": "Euler", "max_sequence_length": str(T5_LENGTH),
        "width": str(SIZE), "height": str(SIZE)}
    assert text["parameters"] == (f"{PROMPT}\nSteps: {STEPS}, Sampler: Euler, Schedule type: Uniform, CFG scale: 1.0, "
                                  f"Distilled CFG Scale: 5.0, Seed: {SEED}, Size: {SIZE}x{SIZE}, Model: "
                                  f"{generated['plain'].parent / 'flux'}")
    text = Image.open(generated["true_cfg"]).text
    assert (text["negative_prompt"], text["guidance_scale"], text["true_cfg_scale"]) == (NEGATIVE, "3.5", "4.0")
    assert f"\nNegative prompt: {NEGATIVE}\n" in text["parameters"]
    assert ", CFG scale: 4.0, Distilled CFG Scale: 3.5, " in text["parameters"]


def test_a_single_file_with_config_makes_the_folders_image(files, generated):
    """A transformer in BFL's layout, the other models, tokenizers and scheduler from --config."""
    png = cli(files, "file.png", "generate", PROMPT, "--true-cfg", "4", "--negative-prompt", NEGATIVE, "--config",
              str(files / "flux"), model="flux1-dev.safetensors")
    np.testing.assert_array_equal(pixels(png), pixels(generated["true_cfg"]))
    text = Image.open(png).text
    assert (text["model"], text["config"]) == (str(files / "flux1-dev.safetensors"), str(files / "flux"))


def test_a_lora_is_merged_as_the_librarys(files, dev, tmp_path):
    """--lora PATH:SCALE on Flux: the library's load_lora at that scale (a PEFT file of the transformer and CLIP)."""
    from test_flux_lora import peft_file
    from test_flux_pipeline import torch_flux_pipeline

    pipe, params = dev
    peft_file(tmp_path / "style.safetensors", torch_flux_pipeline(tmp_path), seed=3)
    png = cli(files, "lora.png", "generate", PROMPT, "--lora", f"{tmp_path / 'style.safetensors'}:0.7")
    expected = library(pipe, pipe.load_lora(params, tmp_path / "style.safetensors", 0.7), guidance_scale=3.5)
    close_to(png, expected)
    assert np.abs(expected - library(pipe, params, guidance_scale=3.5)).max() > 0.02
    assert "<lora:style:0.7>" in Image.open(png).text["parameters"]


def test_a_guider_perturbing_the_transformers_attention_equals_the_library(files, dev):
    """PAG on a double-stream block, its scale --true-cfg's (no negative prompt: the empty prompt's prediction is
    the unconditional one), --guidance still the distilled guidance."""
    from sdflax.guiders import guider_from_name

    png = cli(files, "pag.png", "generate", PROMPT, *PAG, "--true-cfg", "2")

    def pag(scale):
        return guider_from_name("pag", guidance_scale=2.0, perturbed_guidance_scale=scale,
                                perturbed_guidance_stop=1.0,
                                perturbed_guidance_config={"fqn": "transformer_blocks", "indices": [1]})

    pipe, params = dev
    expected = library(pipe.with_guider(pag(2.8)), params, guidance_scale=3.5)
    close_to(png, expected)
    assert np.abs(expected - library(pipe.with_guider(pag(0.0)), params, guidance_scale=3.5)).max() > 0.02
    text = Image.open(png).text
    assert (text["guider"], text["true_cfg_scale"]) == ("PerturbedAttentionGuidance", "2.0")
    assert ", CFG scale: 2.0, Distilled CFG Scale: 3.5, " in text["parameters"]


def test_a_reference_runs_kontext_as_the_library(files):
    """--reference IMG: FluxKontext with that picture, the output at its size; the PNG records it."""
    from sdflax import FluxKontext

    png = cli(files, "kontext.png", "generate", PROMPT, "--reference", str(files / "in.png"))
    pipe, params = FluxKontext.from_pretrained(files / "flux")
    close_to(png, library(pipe, params, [Image.open(files / "in.png")], guidance_scale=3.5))
    assert Image.open(png).text["reference"] == str(files / "in.png")


@pytest.mark.parametrize("command", ["img2img", "inpaint"])
def test_img2img_and_inpaint_equal_the_library(files, command):
    from sdflax import FluxImg2Img, FluxInpaint

    mask = ["--mask", str(files / "mask.png")] if command == "inpaint" else []
    png = cli(files, f"{command}.png", command, PROMPT, "--image", str(files / "in.png"), *mask)
    pipe, params = (FluxInpaint if mask else FluxImg2Img).from_pretrained(files / "flux")
    pictures = [[Image.open(files / "in.png")]] + ([[Image.open(files / "mask.png")]] if mask else [])
    # diffusers' Flux img2img and inpaint defaults: strength 0.6, guidance 7.0
    close_to(png, library(pipe, params, *pictures))
    text = Image.open(png).text
    assert (text["strength"], text["guidance_scale"], text["true_cfg_scale"]) == ("0.6", "7.0", "1.0")
    assert text["parameters"].endswith(", Denoising strength: 0.6")


def test_a_fill_transformer_inpaints_with_flux_fill(files):
    """A Fill transformer file (384 input features) runs FluxFill under inpaint: its defaults, strength 1 and
    guidance 30."""
    from sdflax import FluxFill

    png = cli(files, "fill.png", "inpaint", PROMPT, "--image", str(files / "in.png"), "--mask",
              str(files / "mask.png"), "--config", str(files / "flux"), model="flux1-fill-dev.safetensors")
    pipe, params = FluxFill.from_single_file(files / "flux1-fill-dev.safetensors", config=files / "flux")
    close_to(png, library(pipe, params, [Image.open(files / "in.png")], [Image.open(files / "mask.png")]))
    text = Image.open(png).text
    assert (text["strength"], text["guidance_scale"]) == ("1.0", "30.0")


@pytest.mark.parametrize("model, command, expected", [
    ("flux", "generate", ("Flux", 28, 3.5, None, 1024)),  # diffusers' FluxPipeline; 128 latents a side
    ("flux", "img2img", ("FluxImg2Img", 28, 7.0, 0.6, SIZE)),
    ("flux", "inpaint", ("FluxInpaint", 28, 7.0, 0.6, SIZE)),
    ("flux1-fill-dev.safetensors", "inpaint", ("FluxFill", 50, 30.0, 1.0, SIZE)),
    ("schnell", "generate", ("Flux", 4, 0.0, None, 1024)),  # no guidance input: BFL's 4 steps
])
def test_defaults_are_the_flux_pipelines(files, model, command, expected, monkeypatch):
    from sdflax.cli import Request, build_parser
    from sdflax.cli.preflight import check_checkpoint
    from sdflax.schedulers import FlowMatchEulerScheduler

    monkeypatch.chdir(files)
    pictures = {} if command == "generate" else {"image": Image.open("in.png").convert("RGB")}
    extra = {"generate": [], "img2img": ["--image", "in.png"], "inpaint": ["--image", "in.png", "--mask", "mask.png"]}
    config = ["--config", "flux"] if model.endswith(".safetensors") else []
    request = Request.from_args(build_parser().parse_args([command, "a fox", "--model", model, *extra[command],
                                                           *config]))
    checkpoint = check_checkpoint(request, pictures)[0]
    assert (checkpoint.pipeline.__name__, checkpoint.steps, checkpoint.guidance, checkpoint.strength,
            checkpoint.height) == expected
    assert type(checkpoint.scheduler) is FlowMatchEulerScheduler


@pytest.mark.parametrize("args, expected", [
    (["--true-cfg", "4"], "--true-cfg runs classifier-free guidance against a negative prompt, as diffusers' "
     "true_cfg_scale (without one it does nothing): add --negative-prompt TEXT, or drop --true-cfg"),
    (["--controlnet", "net", "--control-image", "in.png"], "--controlnet net: net is not in the Hugging Face cache"),
    (["--t2i-adapter", "adapter", "--adapter-image", "in.png"], "--t2i-adapter is not supported with Flux.1"),
    (["--embedding", "token.pt"], "--embedding is not supported with Flux.1 checkpoints yet"),
    (["--refiner", "flux"], "--refiner is not supported with Flux.1 checkpoints yet"),
    (["--vae", "flux/vae"], "--vae is not supported with Flux.1 checkpoints yet"),
    (["--prompt-3", "x"], "--prompt-3 is for SD 3.x checkpoints, but flux is a Flux.1 checkpoint: drop --prompt-3"),
    (["--height", "40"], "--height 40 is not a multiple of 16, the VAE scale factor times the patch size of flux: "
     "use 32 or 48"),
    (["--scheduler", "DPM++ 2M"], "--scheduler DPM++ 2M: Flux.1's transformer samples with flow-matching Euler"),
    (["--guider", "pag"], "add --guider-arg config=FQN:INDICES, the list of modules and the indices of those "
     "perturbed, e.g. config=transformer_blocks:1"),
    (["--guider", "cfg", "--guider-arg", "guidance_scale=3"], "--guider-arg guidance_scale=...: give the scale as "
     "--true-cfg"),
    (["--model", "schnell", "--guidance", "3.5"], "--guidance is the guidance Flux.1 dev was distilled to take, and "
     "schnell's transformer has no guidance input (as FLUX.1-schnell's): drop --guidance"),
    (["--model", "flux1-dev.safetensors"], "--model flux1-dev.safetensors holds a FLUX.1 transformer alone (Black "
     "Forest Labs' layout): pass --config <a diffusers FLUX.1 folder or hub id"),
    (["--model", "flux1-dev.safetensors", "--config", TINY], f"--config {TINY} is a StableDiffusionPipeline "
     "checkpoint, but --model flux1-dev.safetensors is a FLUX.1 transformer file"),
    (["--model", "flux1-fill-dev.safetensors", "--config", "flux"], "flux1-fill-dev.safetensors is a Flux.1 Fill "
     "checkpoint (its transformer takes the masked image and the mask beside the latents): use sdflax inpaint"),
])
def test_bad_flux_input_is_one_line_and_status_2(args, expected, files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(files)
    model = [] if "--model" in args else ["--model", "flux"]
    assert main(["generate", "a fox", *model, "--width", "32", *args, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


@pytest.mark.parametrize("args, expected", [
    (["--true-cfg", "4", "--negative-prompt", "x"], f"--true-cfg is for Flux.1 checkpoints, but {TINY} is an SD 1.x "
     "/ 2.x checkpoint: drop --true-cfg"),
    (["--max-sequence-length", "10"], f"--max-sequence-length is for SD 3.x and Flux.1 checkpoints, but {TINY} is an "
     "SD 1.x / 2.x checkpoint: drop --max-sequence-length"),
])
def test_flux_flags_are_refused_for_other_models(args, expected, tmp_path, capsys):
    assert main(["generate", "a fox", "--model", TINY, *args, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


def test_batch_lines_without_a_negative_prompt_refuse_true_cfg(files, tmp_path, capsys):
    """In a prompt file each line may give its negative prompt: one without, under --true-cfg, is named."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a fox", "negative_prompt": "blurry"}\n{"prompt": "a cat"}\n')
    assert main(["batch", str(prompts), "--model", str(files / "flux"), "--true-cfg", "4", "--out",
                 str(tmp_path / "out"), "--num-processes", "1"]) == 2
    assert f"PROMPTS {prompts} line 2: --true-cfg runs classifier-free guidance against a negative prompt" in \
        one_error_line(capsys)


def test_help_lists_the_flux_options(capsys):
    assert_help_lists(capsys, "--true-cfg SCALE", "--max-sequence-length N")
