"""SD 3.x on the command line: `generate`, `img2img` and `inpaint --model <an SD 3 folder or single file>`,
`--prompt-3`, `--no-t5`, `--max-sequence-length`, skip-layer guidance (`--slg-layers`, `--slg-scale`), `batch`, in
process on a small random SD 3.5 Medium-shaped checkpoint written here by diffusers (and as one file in Stability's
layout): each PNG equals the library's image for the same inputs and keys and records what made it; the defaults
are the SD 3 pipelines'; the flags SD 3.x does not take, and the SD 3.x flags other models do not, are one line and
status 2."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from test_cli import TINY, assert_help_lists, close_to, one_error_line, pixels, rows
from test_cli_controlnet import as_the_cli

from sdflax.cli import main

SIZE = 16  # pixels; latents 8x8 (VAE scale factor 2), 4x4 patches
STEPS = 6  # skip-layer guidance's default window (0.01 .. 0.2 of the steps) holds step 1 from 6 steps on
T5_LENGTH = 16
SEED = 7
PROMPT, PROMPT_3, NEGATIVE = "a lighthouse at dusk", "an oil painting, dramatic light", "blurry"
SETTINGS = ["--height", str(SIZE), "--width", str(SIZE), "--steps", str(STEPS), "--seed", str(SEED),
            "--max-sequence-length", str(T5_LENGTH), "--no-progress"]  # generate's and batch's
COMMON = [*SETTINGS, "--num-images", "1"]
TRANSFORMER = dict(sample_size=8, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=8,
                   num_attention_heads=4, joint_attention_dim=96, caption_projection_dim=32,
                   pooled_projection_dim=72, out_channels=16, pos_embed_max_size=16, qk_norm="rms_norm",
                   dual_attention_layers=(0,))
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 16), layers_per_block=1,
           down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
           sample_size=SIZE, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
           use_post_quant_conv=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small SD 3 checkpoint (diffusers' StableDiffusion3Pipeline.save_pretrained), an input picture and mask,
    and the files the refusals name."""
    import torch
    from builders import TOKENIZER, randomize_norms, t5_tokenizer_folder, torch_vae
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from safetensors.numpy import save_file
    from safetensors.torch import save_file as save_torch_file
    from test_mmdit import torch_transformer
    from test_sd3_single_file import to_single_file
    from test_sd3_text import CLIP, CLIP_G, T5
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    tmp = tmp_path_factory.mktemp("cli-sd3")
    torch.manual_seed(0)
    encoders = [randomize_norms(CLIPTextModelWithProjection(CLIPTextConfig(**config)), seed).eval()
                for seed, config in ((0, CLIP), (1, CLIP_G))]
    with torch.no_grad():  # SD 3 pools CLIP-L unprojected: a single file's CLIP-L reads with an identity projection
        projection = encoders[0].text_projection.weight
        projection.copy_(torch.eye(*projection.shape))
    tokenizer_3 = t5_tokenizer_folder(tmp / "t5_tokenizer")
    theirs = StableDiffusion3Pipeline(
        transformer=torch_transformer(TRANSFORMER, seed=2), vae=torch_vae(VAE, seed=3),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=encoders[0], text_encoder_2=encoders[1],
        text_encoder_3=T5EncoderModel(T5Config(**T5)).eval(), tokenizer=CLIPTokenizer.from_pretrained(TOKENIZER),
        tokenizer_2=CLIPTokenizer.from_pretrained(TOKENIZER, pad_token="!"),
        tokenizer_3=T5TokenizerFast(tokenizer_file=str(tokenizer_3 / "tokenizer.json")))
    theirs.save_pretrained(tmp / "sd3")
    save_torch_file(to_single_file(theirs), tmp / "sd3.safetensors")  # MMDiT, VAE, CLIP-L, CLIP-G and T5
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(tmp / "in.png")
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[3:12, 2:13] = 255
    Image.fromarray(mask).save(tmp / "mask.png")
    for name in ("lora.safetensors", "token.pt", "ip/ip.safetensors", "ip/image_encoder/config.json"):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text("{}")
    save_file({"model.diffusion_model.joint_blocks.0.x": np.zeros(1, np.float32)}, tmp / "sd3.5.safetensors")
    return tmp


def cli(files, name, *args, model="sd3"):
    """The command in process (on this session's devices: a row per device, seeds SEED, SEED + 1, ...); the PNG."""
    assert main([*args, "--model", str(files / model), *COMMON, "--out", str(files / name)]) == 0
    return files / name


def library_text_to_image(files, guider=None, lora=None, **load):
    """`lora`: (path, scale) merged by the library."""
    from sdflax import StableDiffusion3

    pipe, params = StableDiffusion3.from_pretrained(files / "sd3", **load)
    params = params if lora is None else pipe.load_lora(params, *lora)
    pipe = pipe if guider is None else pipe.with_guider(guider)
    keys = as_the_cli(SEED)
    ids, neg = rows([pipe.prepare_inputs([PROMPT], prompts_3=[PROMPT_3], max_sequence_length=T5_LENGTH),
                     pipe.prepare_inputs([NEGATIVE], max_sequence_length=T5_LENGTH)], keys)
    return lambda **kwargs: pipe.generate_sharded(ids, params, keys, num_inference_steps=STEPS, height=SIZE,
                                                  width=SIZE, neg_prompt_ids=neg, **kwargs)[0]


@pytest.fixture(scope="module")
def generated(files):
    """The CLI's text-to-image PNGs: plain, without T5, with skip-layer guidance."""
    args = ["generate", PROMPT, "--prompt-3", PROMPT_3, "--negative-prompt", NEGATIVE]
    # without T5 its prompt has no encoder: --prompt-3 with --no-t5 is refused (the library ignores prompts_3)
    return {"plain": cli(files, "plain.png", *args),
            "no_t5": cli(files, "no-t5.png", "generate", PROMPT, "--negative-prompt", NEGATIVE, "--no-t5"),
            "slg": cli(files, "slg.png", *args, "--slg-layers", "1,2", "--slg-scale", "10")}


def test_generate_equals_the_library_and_records_its_settings(files, generated):
    make = library_text_to_image(files)
    expected = make()  # the SD 3 pipeline's defaults: guidance 7.0, flow-matching Euler
    close_to(generated["plain"], expected)
    slg = make(skip_guidance_layers=(1, 2), skip_layer_guidance_scale=10.0)
    close_to(generated["slg"], slg)
    assert np.abs(slg - expected).max() > 0.02  # skip-layer guidance reaches the image
    text = Image.open(generated["plain"]).text
    assert {k: text[k] for k in ("prompt", "prompt_3", "negative_prompt", "steps", "guidance_scale", "scheduler",
                                 "sampler", "max_sequence_length", "width", "height")} == {
        "prompt": PROMPT, "prompt_3": PROMPT_3, "negative_prompt": NEGATIVE, "steps": str(STEPS),
        "guidance_scale": "7.0", "scheduler": "flow_match_euler", "sampler": "Euler",
        "max_sequence_length": str(T5_LENGTH), "width": str(SIZE), "height": str(SIZE)}
    assert "t5" not in text and "slg_layers" not in text
    assert text["parameters"] == (f"{PROMPT}\nNegative prompt: {NEGATIVE}\nSteps: {STEPS}, Sampler: Euler, Schedule "
                                  f"type: Uniform, CFG scale: 7.0, Seed: {SEED}, Size: {SIZE}x{SIZE}, Model: "
                                  f"{files / 'sd3'}")
    text = Image.open(generated["slg"]).text
    assert (text["slg_layers"], text["slg_scale"]) == ("[1, 2]", "10.0")
    assert text["parameters"].endswith(', SLG layers: "1,2", SLG scale: 10.0')


def test_no_t5_equals_the_library_without_t5(files, generated):
    expected = library_text_to_image(files, text_encoder_3=None)()
    close_to(generated["no_t5"], expected)
    assert np.abs(pixels(generated["no_t5"]).astype(int) - pixels(generated["plain"])).max() > 5  # T5 mattered
    text = Image.open(generated["no_t5"]).text
    assert text["t5"] == "off" and text["parameters"].endswith(f"Model: {files / 'sd3'}, T5: off")


def test_a_guider_perturbing_the_transformers_attention_equals_the_library(files, generated):
    """PAG on SD 3's joint attention from the command line: the library's guider on the block named."""
    from sdflax.guiders import guider_from_name

    png = cli(files, "pag.png", "generate", PROMPT, "--prompt-3", PROMPT_3, "--negative-prompt", NEGATIVE, "--guider",
              "pag", "--guider-arg", "config=transformer_blocks:1", "--guider-arg", "perturbed_guidance_stop=1")
    guider = guider_from_name("pag", guidance_scale=7.0, perturbed_guidance_stop=1.0,
                              perturbed_guidance_config={"fqn": "transformer_blocks", "indices": [1]})
    close_to(png, library_text_to_image(files, guider)())
    assert np.abs(pixels(png).astype(int) - pixels(generated["plain"])).max() > 5  # the perturbation mattered
    assert Image.open(png).text["guider"] == "PerturbedAttentionGuidance"


def test_a_lora_is_merged_as_the_librarys(files, generated):
    """--lora PATH:SCALE on SD 3: the library's load_lora at that scale (kohya's names: the MMDiT in Stability's)."""
    from diffusers import SD3Transformer2DModel
    from test_sd3_lora import kohya_file, stability_layers

    path = files / "style.safetensors"
    kohya_file(path, {"transformer": stability_layers(SD3Transformer2DModel.from_pretrained(
        files / "sd3", subfolder="transformer"), seed=3)})
    png = cli(files, "lora.png", "generate", PROMPT, "--prompt-3", PROMPT_3, "--negative-prompt", NEGATIVE, "--lora",
              f"{path}:0.7")
    close_to(png, library_text_to_image(files, lora=(path, 0.7))())
    assert np.abs(pixels(png).astype(int) - pixels(generated["plain"])).max() > 5  # the LoRA mattered
    assert "<lora:style:0.7>" in Image.open(png).text["parameters"]


def test_batch_makes_the_image_generate_makes(files, generated):
    """A prompt file's line n is `generate` with seed S + n - 1, the SD 3 flags as given (a second run: all done)."""
    (files / "prompts.txt").write_text(f"{PROMPT}\n")
    args = ["batch", str(files / "prompts.txt"), "--model", str(files / "sd3"), "--prompt-3", PROMPT_3,
            "--negative-prompt", NEGATIVE, *SETTINGS, "--out",
            str(files / "batch"), "--num-processes", "1"]
    assert main(args) == 0
    png = files / "batch" / "000001-a-lighthouse-at-dusk.png"
    np.testing.assert_array_equal(pixels(png), pixels(generated["plain"]))
    assert Image.open(png).text["prompt_3"] == PROMPT_3
    assert main(args) == 0


@pytest.mark.parametrize("command", ["img2img", "inpaint"])
def test_img2img_and_inpaint_equal_the_library(files, command):
    from sdflax import StableDiffusion3Img2Img, StableDiffusion3Inpaint

    mask = ["--mask", "mask.png"] if command == "inpaint" else []
    args = [command, PROMPT, "--image", str(files / "in.png"), *(["--mask", str(files / "mask.png")] if mask else [])]
    png = cli(files, f"{command}.png", *args)
    kind = StableDiffusion3Inpaint if mask else StableDiffusion3Img2Img
    pipe, params = kind.from_pretrained(files / "sd3")
    keys = as_the_cli(SEED)
    pictures = [[Image.open(files / "in.png")]] + ([[Image.open(files / "mask.png")]] if mask else [])
    arrays = rows(pipe.prepare_inputs([PROMPT], *pictures, max_sequence_length=T5_LENGTH), keys)
    # diffusers' SD 3 defaults: strength 0.6, guidance 7.0; no negative prompt: the empty prompt's
    close_to(png, pipe.generate_sharded(*arrays, params, keys, num_inference_steps=STEPS)[0])
    text = Image.open(png).text
    assert (text["strength"], text["guidance_scale"], text["sampler"]) == ("0.6", "7.0", "Euler")
    assert text["parameters"].endswith(", Denoising strength: 0.6")


@pytest.mark.parametrize("command, steps, strength", [("generate", 28, None), ("img2img", 50, 0.6),
                                                     ("inpaint", 50, 0.6)])
def test_defaults_are_the_sd3_pipelines(files, command, steps, strength, monkeypatch):
    """The SD 3 pipelines' (diffusers'): 28 steps for text-to-image, 50 for the others, guidance 7.0, strength 0.6,
    flow-matching Euler, A1111's "Euler" too (from the configs)."""
    from sdflax.cli import Request, build_parser
    from sdflax.cli.batch import add_command
    from sdflax.cli.preflight import check_checkpoint
    from sdflax.schedulers import FlowMatchEulerScheduler

    monkeypatch.chdir(files)
    pictures = {} if strength is None else {"image": Image.open("in.png").convert("RGB")}
    extra = {"generate": [], "img2img": ["--image", "in.png"], "inpaint": ["--image", "in.png", "--mask", "mask.png"]}
    for scheduler, karras in ((None, False), ("Euler", False), ("Euler Karras", True)):
        args = [command, "a fox", "--model", "sd3", *extra[command]] + (["--scheduler", scheduler] if scheduler else [])
        request = Request.from_args(build_parser(add_command).parse_args(args))
        checkpoint = check_checkpoint(request, pictures)[0]
        assert (checkpoint.steps, checkpoint.guidance, checkpoint.strength) == (steps, 7.0, strength)
        assert type(checkpoint.scheduler) is FlowMatchEulerScheduler
        assert checkpoint.scheduler.config.use_karras_sigmas is karras and checkpoint.scheduler.config.shift == 3.0
        assert (checkpoint.height, checkpoint.width) == (SIZE, SIZE)  # the picture's, or the transformer's 8 x 2


SD3_FLAGS = [["--no-t5"], ["--prompt-3", "x"], ["--negative-prompt-3", "x"], ["--slg-layers", "1"],
             ["--slg-scale", "2"]]  # --max-sequence-length, which Flux.1 takes too: test_cli_flux.py


@pytest.mark.parametrize("args", SD3_FLAGS, ids=lambda args: args[0])
def test_sd3_flags_are_refused_for_other_models(args, tmp_path, capsys):
    assert main(["generate", "a fox", "--model", TINY, *args, "--out", str(tmp_path / "out")]) == 2
    assert f"{args[0]} is for SD 3.x checkpoints, but {TINY} is an SD 1.x / 2.x checkpoint: drop {args[0]}" in \
        one_error_line(capsys)


@pytest.mark.parametrize("args, expected", [
    (["--t2i-adapter", "adapter", "--adapter-image", "in.png"], "--t2i-adapter is not supported with SD 3.x"),
    (["--lora", "missing.safetensors"], "--lora missing.safetensors: no such file"),  # SD 3 takes LoRAs
    (["--embedding", "token.pt"], "--embedding is not supported with SD 3.x checkpoints yet"),
    (["--refiner", "sd3"], "--refiner is not supported with SD 3.x checkpoints yet"),
    (["--slg-layers", "3"], "--slg-layers 3: sd3's transformer has blocks 0 .. 2: give blocks among them"),
    (["--slg-layers", "1,x"], "argument --slg-layers: expected block indices separated by commas"),
    (["--slg-scale", "2"], "--slg-scale applies with --slg-layers"),
    (["--slg-layers", "1", "--guider", "apg"], "--slg-layers runs with the pipeline's classifier-free guidance"),
    (["--guider", "pag"], "--guider pag perturbs the layers you name: add --guider-arg config=FQN:INDICES, the list "
     "of modules and the indices of those perturbed, e.g. config=transformer_blocks:7"),  # the family's example
    (["--max-sequence-length", "513"], "argument --max-sequence-length: must be at most 512 (T5's longest)"),
    (["--no-t5", "--prompt-3", "x"], "--prompt-3 is T5's prompt, but --no-t5 loads no T5: drop one of them"),
    (["--scheduler", "DPM++ 2M"], "--scheduler DPM++ 2M: SD 3.x's transformer samples with flow-matching Euler"),
    (["--scheduler", "EulerDiscreteScheduler"], "--scheduler EulerDiscreteScheduler: SD 3.x's transformer samples "
     "with flow-matching Euler"),
    (["--height", "18"], "--height 18 is not a multiple of 4, the VAE scale factor times the patch size of sd3"),
    (["--height", "128"], "16x128 is larger than sd3 makes: its position table covers 64 pixels a side"),
    (["--steps", "1"], "--strength 0.6 with --steps 1 runs no denoising step"),
])
def test_bad_sd3_input_is_one_line_and_status_2(args, expected, files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(files)
    command = ["img2img", "a fox", "--image", "in.png"] if args[0] == "--steps" else ["generate", "a fox"]
    width = [] if args[0] == "--steps" else ["--width", "16"]
    assert main([*command, "--model", "sd3", *width, *args, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


def test_generate_with_a_controlnet_equals_the_library(files, capsys):
    """An SD 3 ControlNet (InstantX's kind) from a diffusers folder at scale 0.7: the PNG is the library's image for
    the same inputs and keys, and records the net; a net made for another transformer is refused in one line."""
    from test_sd3_controlnet import torch_controlnet

    from sdflax import SD3ControlNetModel, StableDiffusion3ControlNet

    net_config = dict(TRANSFORMER, num_layers=2, qk_norm=None, dual_attention_layers=())
    torch_controlnet(net_config, seed=3).save_pretrained(files / "sd3-net")
    torch_controlnet(dict(net_config, pooled_projection_dim=16), seed=3).save_pretrained(files / "sd3-other-net")
    png = cli(files, "controlnet.png", "generate", PROMPT, "--negative-prompt", NEGATIVE, "--controlnet",
              str(files / "sd3-net"), "--control-image", str(files / "in.png"), "--control-scale", "0.7")
    net, net_params = SD3ControlNetModel.from_pretrained(files / "sd3-net")
    pipe, params = StableDiffusion3ControlNet.from_pretrained(files / "sd3", controlnet=[net])
    params["controlnet"] = [net_params]
    keys = as_the_cli(SEED)
    ids, neg, control = rows([pipe.prepare_inputs([PROMPT], max_sequence_length=T5_LENGTH),
                              pipe.prepare_inputs([NEGATIVE], max_sequence_length=T5_LENGTH),
                              pipe.prepare_image_inputs(Image.open(files / "in.png"))], keys)
    expected = pipe.generate_sharded(ids, [control], params, keys, num_inference_steps=STEPS, height=SIZE,
                                     width=SIZE, neg_prompt_ids=neg, controlnet_conditioning_scale=[0.7])[0]
    close_to(png, expected)
    text = Image.open(png).text
    assert (text["controlnet"], text["control_scale"]) == (f'["{files / "sd3-net"}"]', "[0.7]")
    capsys.readouterr()  # the run's timing line
    assert main(["generate", "a fox", "--model", str(files / "sd3"), "--controlnet", str(files / "sd3-other-net"),
                 "--control-image", str(files / "in.png"), *COMMON, "--out", str(files / "refused")]) == 2
    assert "sd3-other-net (token width, patch, pooled width, text width (32, 2, 16, 96)) was made for another " \
        "transformer than the checkpoint's (32, 2, 72, 96)" in one_error_line(capsys)


def test_inpaint_with_an_inpainting_controlnet_equals_the_library(files, capsys):
    """Alimama's kind of net (17 control channels) reads --image and --mask: the PNG is the library's
    StableDiffusion3ControlNetInpaint image for the same inputs and keys (the net moves it: scale 0 is another
    image), records no strength (it starts from noise); --control-image and --strength are refused in one line."""
    from test_sd3_controlnet import torch_controlnet

    from sdflax import SD3ControlNetModel, StableDiffusion3ControlNetInpaint

    net_config = dict(TRANSFORMER, num_layers=2, qk_norm=None, dual_attention_layers=(), extra_conditioning_channels=1)
    torch_controlnet(net_config, seed=4).save_pretrained(files / "sd3-inpaint-net")
    pictures = ["--image", str(files / "in.png"), "--mask", str(files / "mask.png")]
    png = cli(files, "controlnet-inpaint.png", "inpaint", PROMPT, *pictures, "--negative-prompt", NEGATIVE,
              "--controlnet", str(files / "sd3-inpaint-net"))
    net, net_params = SD3ControlNetModel.from_pretrained(files / "sd3-inpaint-net")
    pipe, params = StableDiffusion3ControlNetInpaint.from_pretrained(files / "sd3", controlnet=[net])
    params["controlnet"] = [net_params]
    keys = as_the_cli(SEED)
    ids, image, mask = rows(pipe.prepare_inputs([PROMPT], [Image.open(files / "in.png")],
                                                [Image.open(files / "mask.png")], max_sequence_length=T5_LENGTH), keys)
    neg, = rows([pipe.prepare_inputs([NEGATIVE], max_sequence_length=T5_LENGTH)], keys)

    def library(scale):
        return pipe.generate_sharded(ids, image, mask, params, keys, num_inference_steps=STEPS, neg_prompt_ids=neg,
                                     controlnet_conditioning_scale=[scale])[0]

    expected = library(1.0)  # diffusers' default scale
    close_to(png, expected)
    assert np.abs(library(0.0) - expected).max() > 0.05
    text = Image.open(png).text
    assert (text["controlnet"], text["control_scale"]) == (f'["{files / "sd3-inpaint-net"}"]', "[1.0]")
    assert "strength" not in text and "Denoising strength" not in text["parameters"]
    capsys.readouterr()  # the run's timing line
    for extra, expected_line in ((["--control-image", str(files / "in.png")], "--control-image with SD 3.x inpainting: "
                                  "its inpainting ControlNet reads --image and --mask: drop --control-image"),
                                 (["--strength", "0.5"], "--strength with SD 3.x ControlNet inpainting: sampling "
                                  "starts from pure noise and pastes nothing back, as diffusers': drop --strength")):
        assert main(["inpaint", "a fox", *pictures, "--model", str(files / "sd3"), "--controlnet",
                     str(files / "sd3-inpaint-net"), *extra, *COMMON, "--out", str(files / "refused")]) == 2
        assert expected_line in one_error_line(capsys)


def test_controlnet_img2img_is_refused(files, tmp_path, capsys, monkeypatch):
    """diffusers 0.39 has SD 3 ControlNets for text-to-image and alimama's inpainting net, no image-to-image."""
    monkeypatch.chdir(files)
    assert main(["img2img", "a fox", "--image", "in.png", "--model", "sd3", "--controlnet", "net", "--control-image",
                 "in.png", "--out", str(tmp_path / "out")]) == 2
    assert ("--controlnet with SD 3.x checkpoints is for sdflax generate and sdflax inpaint: sdflax has no SD 3.x "
            "ControlNet image-to-image pipeline, as diffusers 0.39 has none") in one_error_line(capsys)


def test_a_single_file_makes_the_folders_image(files, generated):
    """One file in Stability's layout (its tokenizers and configs from --config) holds the folder's weights."""
    png = cli(files, "file.png", "generate", PROMPT, "--prompt-3", PROMPT_3, "--negative-prompt", NEGATIVE,
              "--config", str(files / "sd3"), model="sd3.safetensors")
    np.testing.assert_array_equal(pixels(png), pixels(generated["plain"]))
    text = Image.open(png).text
    assert (text["model"], text["config"]) == (str(files / "sd3.safetensors"), str(files / "sd3"))


@pytest.mark.parametrize("args, expected", [
    (["--model", "sd3.safetensors"], "--model sd3.safetensors: an MMDiT of a size sdflax bundles no configs for "
     "(SD 3 Medium, SD 3.5 Medium and Large): pass --config <a diffusers folder or hub id of the same model>"),
    (["--model", "sd3.5.safetensors"], "--model sd3.5.safetensors: an MMDiT of a size sdflax bundles no configs"),
    (["--model", "sd3.safetensors", "--config", TINY], f"--config {TINY} is a StableDiffusionPipeline checkpoint, "
     "but --model sd3.safetensors is an SD 3.x file: give the diffusers folder or hub id of the same model"),
])
def test_bad_single_file_input_is_one_line(args, expected, files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(files)
    assert main(["generate", "a fox", *args, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


def test_flow_schedulers_for_unets_are_refused(tmp_path, capsys):
    assert main(["generate", "a fox", "--model", TINY, "--scheduler", "flow_match_euler", "--out",
                 str(tmp_path / "out")]) == 2
    assert "--scheduler flow_match_euler is flow-matching Euler, for SD 3.x" in one_error_line(capsys)


def test_help_lists_the_sd3_options(capsys):
    assert_help_lists(capsys, "--prompt-3 TEXT", "--negative-prompt-3 TEXT", "--no-t5", "--max-sequence-length N",
                      "--slg-layers I,J,...", "--slg-scale S")
