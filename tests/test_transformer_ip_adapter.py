"""Flux.1's XLabs IP-Adapter against diffusers' `FluxPipeline.load_ip_adapter` (PyTorch) on the tiny random Flux dev
checkpoint of test_flux_pipeline, an adapter file in XLabs' layout the test writes and a small random CLIP image
encoder: images at two scales (a new scale runs the same program), per-block scales, true CFG with the default
black negative image and with a negative image prompt, and embeddings in place of pictures."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from builders import randomize_norms
from PIL import Image
from safetensors.torch import save_file
from test_flux_pipeline import (JOINT, NEGATIVE, PROMPTS, SIZE, T5_LENGTH, TRANSFORMER, check_images, latents_for,
                                moves, packed, torch_flux_pipeline)

from sdflax import Flux

ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
               patch_size=14, projection_dim=24, hidden_act="quick_gelu")
INNER = TRANSFORMER["num_attention_heads"] * TRANSFORMER["attention_head_dim"]
STEPS = 2


def xlabs_file(path, seed=0):
    """An IP-Adapter in XLabs' layout: ip_adapter_proj_model (4 tokens of T5's width from the CLIP image embedding)
    and each double block's biased k / v projections."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, scale=1.0: torch.randn(*shape, generator=g) * scale  # noqa: E731
    tensors = {"ip_adapter_proj_model.proj.weight": rand(4 * JOINT, ENCODER["projection_dim"], scale=0.3),
               "ip_adapter_proj_model.proj.bias": rand(4 * JOINT, scale=0.1),
               "ip_adapter_proj_model.norm.weight": 1 + rand(JOINT, scale=0.2),
               "ip_adapter_proj_model.norm.bias": rand(JOINT, scale=0.2)}
    for i in range(TRANSFORMER["num_layers"]):
        for kv in "kv":
            name = f"double_blocks.{i}.processor.ip_adapter_double_stream_{kv}_proj"
            tensors[f"{name}.weight"] = rand(INNER, JOINT, scale=JOINT ** -0.5 * 2)
            tensors[f"{name}.bias"] = rand(INNER, scale=0.1)
    save_file(tensors, path)


def pictures():
    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, (40, 36, 3), dtype=np.uint8)) for _ in range(2)]


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(diffusers' Flux dev with the adapter, ours, params): the adapter folder holds ip_adapter.safetensors and
    image_encoder/."""
    from diffusers import FluxPipeline
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModelWithProjection

    tmp = tmp_path_factory.mktemp("flux_ip")
    theirs = torch_flux_pipeline(tmp)
    theirs.save_pretrained(tmp / "dev", safe_serialization=True)
    torch.manual_seed(0)
    encoder = randomize_norms(CLIPVisionModelWithProjection(CLIPVisionConfig(**ENCODER)), seed=4).eval()
    encoder.save_pretrained(tmp / "adapter" / "image_encoder")
    xlabs_file(tmp / "adapter" / "ip_adapter.safetensors")
    side = ENCODER["image_size"]
    theirs = FluxPipeline(**{**theirs.components, "image_encoder": encoder,
                             "feature_extractor": CLIPImageProcessorPil(size={"shortest_edge": side},
                                                                        crop_size=side)})
    theirs.load_ip_adapter(str(tmp / "adapter"), weight_name="ip_adapter.safetensors",
                           image_encoder_pretrained_model_name_or_path=None)
    pipe, params = Flux.from_pretrained(tmp / "dev")
    ip_pipe, ip_params = pipe.load_ip_adapter(params, tmp / "adapter", weight_name="ip_adapter.safetensors")
    return theirs, ip_pipe, ip_params, pipe, params, tmp


def theirs_images(theirs, scale, **kwargs):
    theirs.set_ip_adapter_scale(scale)
    with torch.no_grad():
        return theirs(PROMPTS, num_inference_steps=STEPS, height=SIZE, width=SIZE, max_sequence_length=T5_LENGTH,
                      latents=packed(latents_for()), guidance_scale=3.5, output_type="np", **kwargs).images


def ours_images(pipe, params, **kwargs):
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    return pipe(ids, params, jax.random.PRNGKey(0), num_inference_steps=STEPS, height=SIZE, width=SIZE,
                latents=latents_for(), guidance_scale=3.5, **kwargs).images


def test_image_prompt_matches_diffusers_at_two_scales_without_recompiling(adapted):
    theirs, pipe, params, *_ = adapted
    image = pictures()[0]
    pixels = pipe.prepare_ip_adapter_image(image)
    expected = theirs_images(theirs, 1.0, ip_adapter_image=image)
    half = theirs_images(theirs, 0.5, ip_adapter_image=image)
    assert moves(expected, half)
    check_images(ours_images(pipe, params, ip_adapter_image=pixels), expected)
    compiles = pipe._jitted._cache_size()
    check_images(ours_images(pipe, params, ip_adapter_image=pixels, ip_adapter_scale=0.5), half)
    blocks = [0.0, 1.5]  # a scale per double-stream block, as diffusers' set_ip_adapter_scale takes it
    per_block = theirs_images(theirs, blocks, ip_adapter_image=image)
    assert moves(per_block, expected)
    check_images(ours_images(pipe, params, ip_adapter_image=pixels, ip_adapter_scale=blocks), per_block)
    assert pipe._jitted._cache_size() == compiles


def test_true_cfg_with_negative_image_prompts_matches_diffusers(adapted):
    """true_cfg_scale 4 with a negative prompt: the negative rows see a black image's tokens by default, or those
    of negative_ip_adapter_image, as diffusers."""
    theirs, pipe, params, *_ = adapted
    image, negative = pictures()
    neg = pipe.prepare_inputs(NEGATIVE, max_sequence_length=T5_LENGTH)
    cfg = dict(true_cfg_scale=4.0)
    expected = theirs_images(theirs, 1.0, ip_adapter_image=image, negative_prompt=NEGATIVE, **cfg)
    with_negative = theirs_images(theirs, 1.0, ip_adapter_image=image, negative_ip_adapter_image=negative,
                                  negative_prompt=NEGATIVE, **cfg)
    assert moves(expected, with_negative)
    pixels = pipe.prepare_ip_adapter_image(image)
    check_images(ours_images(pipe, params, ip_adapter_image=pixels, neg_prompt_ids=neg, **cfg), expected)
    check_images(ours_images(pipe, params, ip_adapter_image=pixels, neg_prompt_ids=neg, **cfg,
                             negative_ip_adapter_image=pipe.prepare_ip_adapter_image(negative)), with_negative)


def test_embeddings_in_place_of_pictures(adapted):
    """ip_adapter_image_embeds (diffusers' (1, n, E) per adapter: the CLIP image embedding) make the pictures'
    image."""
    _, pipe, params, *_ = adapted
    pixels = pipe.prepare_ip_adapter_image(pictures()[0])
    embeds = pipe.ip_adapter.image_encoder.apply(params["image_encoder"], pixels).image_embeds[None]
    from_pixels = ours_images(pipe, params, ip_adapter_image=pixels)
    np.testing.assert_allclose(ours_images(pipe, params, ip_adapter_image_embeds=np.asarray(embeds)), from_pixels,
                               rtol=0, atol=1e-5)


def test_bad_input_is_one_line(adapted, tmp_path):
    _, pipe, params, plain, plain_params, _ = adapted
    pixels = pipe.prepare_ip_adapter_image(pictures()[0])
    cases = {"give ip_adapter_image or ip_adapter_image_embeds, not both":
             dict(ip_adapter_image=pixels, ip_adapter_image_embeds=np.zeros((1, 1, 24))),
             r"ip_adapter_scale=\[1.0, 2.0, 3.0\]: give a number, one per adapter \(1\), or a list of one per "
             r"double-stream block \(2\)": dict(ip_adapter_image=pixels, ip_adapter_scale=[1.0, 2.0, 3.0]),
             "its adapter takes 24 wide ones": dict(ip_adapter_image_embeds=np.zeros((1, 1, 7))),
             "this pipeline has an IP-Adapter: give ip_adapter_image": {}}
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=message):
            ours_images(pipe, params, **kwargs)
    with pytest.raises(ValueError, match="negative_ip_adapter_image needs an IP-Adapter"):
        ours_images(plain, plain_params, negative_ip_adapter_image=pixels)
    bad = tmp_path / "bad.safetensors"
    save_file({"ip_adapter_proj_model.proj.weight": torch.zeros(4 * JOINT, 24)}, bad)
    with pytest.raises(ValueError, match="is not a Flux IP-Adapter: expected ip_adapter_proj_model"):
        plain.load_ip_adapter(plain_params, tmp_path, weight_name="bad.safetensors", image_encoder_folder=None)


def test_the_command_line_equals_the_library(adapted, capsys):
    """sdflax generate --ip-adapter FILE:SCALE --ip-image PNG on a Flux.1 folder (the encoder in image_encoder/
    beside the file): the library's image for the CLI's rows and keys, and the PNG records the adapter."""
    from test_cli import close_to, rows
    from test_cli_controlnet import as_the_cli

    from sdflax.cli import main

    _, pipe, params, _, _, tmp = adapted
    pictures()[1].save(tmp / "prompt.png")
    adapter = tmp / "adapter" / "ip_adapter.safetensors"
    flags = ["--height", "32", "--width", "32", "--steps", "2", "--seed", "7", "--max-sequence-length",
             str(T5_LENGTH), "--no-progress", "--num-images", "1"]
    assert main(["generate", "a red cat", "--model", str(tmp / "dev"), *flags, "--ip-adapter", f"{adapter}:0.7",
                 "--ip-image", str(tmp / "prompt.png"), "--out", str(tmp / "cli.png")]) == 0, capsys.readouterr().err
    keys = as_the_cli(7)
    ids, neg = (rows([pipe.prepare_inputs([p], max_sequence_length=T5_LENGTH)], keys)[0] for p in ("a red cat", ""))
    pixels = rows([pipe.prepare_ip_adapter_image(Image.open(tmp / "prompt.png"))], keys)
    expected = pipe.generate_sharded(ids, params, keys, num_inference_steps=2, neg_prompt_ids=neg, height=32,
                                     width=32, ip_adapter_image=pixels, ip_adapter_scale=[0.7])
    close_to(tmp / "cli.png", expected[0])
    assert f"IP-Adapter: {adapter} (0.7)" in Image.open(tmp / "cli.png").text["parameters"]


# ---- SD 3.5 Large's IP-Adapter (InstantX) -------------------------------------------------------------------------
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=28,
              patch_size=7)
# diffusers' resampler -> InstantX's names (its to_kv fused, as both write it)
INSTANTX = (("ln0", "0.norm1"), ("ln1", "0.norm2"), ("attn.to_q", "0.to_q"), ("attn.to_kv", "0.to_kv"),
            ("attn.to_out.0", "0.to_out"), ("adaln_norm", "1.0"), ("ff.net.0.proj", "1.1"), ("ff.net.2", "1.3"),
            ("adaln_proj", "2.1"))


def instantx_file(path, blocks, inner, head_dim, seed=0):
    """An SD 3.5 IP-Adapter in InstantX's layout: a time-modulated resampler of SigLIP's 32-wide states to
    8 tokens of the transformer's width (4 layers: diffusers reads no depth), and each block's norm_ip, to_k_ip, to_v_ip and RMSNorm scales."""
    from diffusers.models.attention_processor import SD3IPAdapterJointAttnProcessor2_0
    from diffusers.models.embeddings import IPAdapterTimeImageProjection

    torch.manual_seed(seed)
    resampler = IPAdapterTimeImageProjection(embed_dim=SIGLIP["hidden_size"], output_dim=inner, hidden_dim=32,
                                             depth=4, heads=1, num_queries=8, timestep_in_dim=16)
    tensors = {}
    for key, value in randomize_norms(resampler, seed).state_dict().items():
        for theirs, instantx in INSTANTX:
            key = key.replace(f".{theirs}.", f".{instantx}.")
        tensors[f"image_proj.{key}"] = value.contiguous()
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(blocks):
        block = SD3IPAdapterJointAttnProcessor2_0(inner, inner, head_dim, timesteps_emb_dim=32)
        for name, value in block.state_dict().items():
            noise = torch.randn(value.shape, generator=g)
            tensors[f"ip_adapter.{i}.{name}"] = 1 + 0.2 * noise if name.startswith("norm_") and "ip.linear" not in \
                name else value + 0.1 * noise
    save_file(tensors, path)


@pytest.fixture(scope="module")
def sd3_adapted(tmp_path_factory):
    """(diffusers' SD 3.5 Large-shaped pipeline with the adapter, ours with it): no second attentions."""
    from diffusers import StableDiffusion3Pipeline
    from test_mmdit import torch_transformer
    from test_sd3_pipeline import TRANSFORMER as SD3_TRANSFORMER
    from test_sd3_pipeline import torch_sd3_pipeline
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    from sdflax import StableDiffusion3

    tmp = tmp_path_factory.mktemp("sd3_ip")
    config = {**SD3_TRANSFORMER, "dual_attention_layers": ()}
    torch.manual_seed(0)
    encoder = randomize_norms(SiglipVisionModel(SiglipVisionConfig(**SIGLIP)), seed=5).eval()
    encoder.save_pretrained(tmp / "adapter" / "image_encoder")
    side = SIGLIP["image_size"]
    theirs = StableDiffusion3Pipeline(**{**torch_sd3_pipeline(tmp).components,
                                         "transformer": torch_transformer(config, seed=2), "image_encoder": encoder,
                                         "feature_extractor": SiglipImageProcessorPil(size={"height": side,
                                                                                            "width": side})})
    theirs.save_pretrained(tmp / "sd3", safe_serialization=True)
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    instantx_file(tmp / "adapter" / "ip-adapter.safetensors", config["num_layers"], inner,
                  config["attention_head_dim"])
    theirs.load_ip_adapter(str(tmp / "adapter"), weight_name="ip-adapter.safetensors", image_encoder_folder=None,
                           low_cpu_mem_usage=False)
    pipe, params = StableDiffusion3.from_pretrained(tmp / "sd3")
    return (theirs, *pipe.load_ip_adapter(params, tmp / "adapter", weight_name="ip-adapter.safetensors"), tmp)


def test_sd35_image_prompt_matches_diffusers_at_two_scales_without_recompiling(sd3_adapted):
    """Classifier-free guidance 7: the unconditional rows see zero states' tokens; the resampler runs at every
    step's timestep; scale 0.6 then 1.2, one program."""
    from test_sd3_pipeline import PROMPTS as SD3_PROMPTS
    from test_sd3_pipeline import SIZE as SD3_SIZE
    from test_sd3_pipeline import check_images as check_sd3_images
    from test_sd3_pipeline import latents_for as sd3_latents

    theirs, pipe, params, _ = sd3_adapted
    image = pictures()[0]

    def theirs_image(scale):
        theirs.set_ip_adapter_scale(scale)
        with torch.no_grad():
            return theirs(SD3_PROMPTS, num_inference_steps=3, height=SD3_SIZE, width=SD3_SIZE,
                          max_sequence_length=T5_LENGTH, latents=torch.from_numpy(sd3_latents()), guidance_scale=7.0,
                          ip_adapter_image=image, output_type="np").images

    def ours_image(scale):
        ids = pipe.prepare_inputs(SD3_PROMPTS, max_sequence_length=T5_LENGTH)
        return pipe(ids, params, jax.random.PRNGKey(0), num_inference_steps=3, height=SD3_SIZE, width=SD3_SIZE,
                    latents=sd3_latents(), guidance_scale=7.0, ip_adapter_image=pipe.prepare_ip_adapter_image(image),
                    ip_adapter_scale=scale).images

    expected, stronger = theirs_image(0.6), theirs_image(1.2)
    assert moves(expected, stronger)
    check_sd3_images(ours_image(0.6), expected)
    compiles = pipe._jitted._cache_size()
    check_sd3_images(ours_image(1.2), stronger)
    assert pipe._jitted._cache_size() == compiles


def test_sd35_on_the_command_line_equals_the_library(sd3_adapted, capsys, tmp_path):
    """sdflax generate --ip-adapter FILE:SCALE --ip-image PNG on an SD 3.5 folder (SigLIP in image_encoder/ beside
    the file), classifier-free guidance with the empty negative prompt: the library's image."""
    from test_cli import close_to, rows
    from test_cli_controlnet import as_the_cli

    from sdflax.cli import main

    _, pipe, params, tmp = sd3_adapted
    pictures()[1].save(tmp_path / "prompt.png")
    adapter = tmp / "adapter" / "ip-adapter.safetensors"
    flags = ["--height", "32", "--width", "32", "--steps", "2", "--seed", "7", "--max-sequence-length",
             str(T5_LENGTH), "--no-progress", "--num-images", "1"]
    assert main(["generate", "a red cat", "--model", str(tmp / "sd3"), *flags, "--ip-adapter",
                 f"{adapter}:0.7", "--ip-image", str(tmp_path / "prompt.png"), "--out",
                 str(tmp_path / "cli.png")]) == 0, capsys.readouterr().err
    keys = as_the_cli(7)
    ids, neg = (rows([pipe.prepare_inputs([p], max_sequence_length=T5_LENGTH)], keys)[0] for p in ("a red cat", ""))
    pixels = rows([pipe.prepare_ip_adapter_image(Image.open(tmp_path / "prompt.png"))], keys)
    expected = pipe.generate_sharded(ids, params, keys, num_inference_steps=2, neg_prompt_ids=neg, height=32,
                                     width=32, ip_adapter_image=pixels, ip_adapter_scale=[0.7])
    close_to(tmp_path / "cli.png", expected[0])
