"""The tiny stand-ins the documentation's examples run on (tests/test_docs.py), declared in one place.

STANDINS maps every hub id the pages name to a small random-weight checkpoint of the same family, written by
`sdflax demo` (`sdflax.demo`: SD 1.5, SDXL and its refiner, SD 3.5, their ControlNets, the IP-Adapter, the
T2I-Adapter) or, for what it has no stand-in of, made by the tests' builders and saved with diffusers'
save_pretrained, into a Hugging Face cache laid out as the hub lays it out (models--org--name/snapshots/<commit>/...,
refs/main), so `from_pretrained("stable-diffusion-v1-5/...")` and `sdflax generate --model ...` take the real
loading path offline. FILES are the files the pages read (a picture, a mask, LoRAs, embeddings, a single-file
checkpoint, an original-layout ControlNet file, prompt files), made into each page's working folder.

The stand-ins keep the builders' small sizes (32 px images: latents of 16 x 16 and a VAE of scale factor 2), not the
real models' 512 / 1024 px, so that a page's fifty steps cost little: the pages state no pixel size that depends on
it.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

from builders import REPO, SD1, SDXL

from sdflax import demo

COMMIT = "0123456789abcdef0123456789abcdef01234567"


# SD 1.5's family as the builders' (two UNet blocks, cross-attention in the outer one, down and up, and in the middle
# block: what ControlNet, FreeU, PAG, DeepCache and the attention hooks address; one layer each).
SD15 = SD1


@functools.cache
def torch_sd15():
    """The SD 1.5 stand-in as a diffusers pipeline (its LoRAs, embeddings and single file are made from it)."""
    from diffusers import StableDiffusionPipeline, PNDMScheduler
    from transformers import CLIPTokenizer

    from builders import SD14_SCHEDULER, TOKENIZER, torch_text_encoder, torch_unet, torch_vae

    return StableDiffusionPipeline(
        vae=torch_vae(SD15["vae"]), text_encoder=torch_text_encoder(SD15["text_encoder"]),
        tokenizer=CLIPTokenizer.from_pretrained(TOKENIZER), unet=torch_unet(SD15["unet"]),
        scheduler=PNDMScheduler.from_config(SD14_SCHEDULER), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)


sd15 = demo.sd15  # the builders' SD1 shapes: the LoRAs, embeddings and files below, made from torch_sd15, fit it


def sd15_inpainting(folder):
    """The SD 1.5 stand-in with a 9-channel UNet (latents, mask, masked image latents), as SD 1.5's inpainting
    checkpoint."""
    from diffusers import StableDiffusionInpaintPipeline

    from builders import torch_unet

    components = {**torch_sd15().components, "unet": torch_unet({**SD15["unet"], "in_channels": 9}, seed=3)}
    StableDiffusionInpaintPipeline(**components).save_pretrained(folder)


# SDXL's family as the builders' (two blocks, cross-attention in the inner one), one layer a block and one
# transformer layer each.
SDXL_UNET = {**SDXL["unet"], "layers_per_block": 1, "transformer_layers_per_block": (1, 1)}


@functools.cache
def torch_sdxl():
    """The SDXL base stand-in as a diffusers pipeline (its refiner, inpainting model, ControlNet and LoRA are made
    from it)."""
    from diffusers import StableDiffusionXLPipeline

    from builders import torch_unet, torch_xl_pipeline

    return StableDiffusionXLPipeline(**{**torch_xl_pipeline().components, "unet": torch_unet(SDXL_UNET)},
                                     add_watermarker=False)


sdxl_base, sdxl_refiner = demo.sdxl, demo.sdxl_refiner  # torch_sdxl's shapes: its LoRA and embedding fit them


def sdxl_inpainting(folder):
    """With a 9-channel UNet (latents, mask, masked image latents), as SDXL's inpainting checkpoint."""
    from diffusers import StableDiffusionXLInpaintPipeline

    from builders import torch_unet

    components = {**torch_sdxl().components, "unet": torch_unet({**SDXL_UNET, "in_channels": 9}, seed=1)}
    StableDiffusionXLInpaintPipeline(**components, add_watermarker=False).save_pretrained(folder)


@functools.cache
def torch_sd15_controlnet():
    from builders import torch_controlnet

    return torch_controlnet(torch_sd15().unet)


sd15_controlnet, sdxl_controlnet, sd15_t2i_adapter = demo.sd15_controlnet, demo.sdxl_controlnet, demo.t2i_adapter


def h94_ip_adapter(folder):
    """h94/IP-Adapter's layout for the SD 1.5 stand-in: `sdflax demo`'s models/ip-adapter_sd15.safetensors and
    models/image_encoder (the builders' VISION), and the Plus adapter beside them."""
    from builders import h94_file

    demo.ip_adapter(folder)
    unet = torch_sd15().unet
    widths = [unet.get_submodule(name[: -len(".processor")]).to_k.out_features
              for name in unet.attn_processors if name.endswith("attn2.processor")]  # attn_processors order
    h94_file(folder / "models" / "ip-adapter-plus_sd15.safetensors", "plus", unet.config.cross_attention_dim, widths,
             3)


def sd15_lora(folder):
    """A LoRA for the SD 1.5 stand-in in diffusers' layout, under the file name the LCM-LoRA repository uses."""
    from test_lora import peft_file

    folder.mkdir(parents=True)
    peft_file(folder / "pytorch_lora_weights.safetensors", torch_sd15(), seed=5)


sd35 = demo.sd35  # SD 3.5 Medium's traits: ten blocks (skip-layer guidance skips 7, 8 and 9), dual attention


def sd35_controlnet(folder):
    """A ControlNet of Stability's SD 3.5 Large kind for `sd35`: single-stream blocks on the transformer's patch
    embedding, the prompt's pooled embedding."""
    import torch
    from diffusers import SD3ControlNetModel

    torch.manual_seed(11)
    SD3ControlNetModel(sample_size=8, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8,
                       num_attention_heads=4, joint_attention_dim=None, caption_projection_dim=32,
                       pooled_projection_dim=72, pos_embed_max_size=None, pos_embed_type=None, use_pos_embed=False,
                       force_zeros_for_pooled_projection=False).save_pretrained(folder)


def flux(folder, guidance_embeds=True, in_channels=64):
    """Flux.1's family: CLIP-L (its pooled output), T5 (the builders' small vocabulary), a transformer of two double-
    and two single-stream blocks (dev: a guidance embedder; schnell none; Fill 384 input features), a 16-channel
    VAE, the flow-matching scheduler with FLUX.1-dev's dynamic shift."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel
    from transformers import T5TokenizerFast

    from builders import T5_PIECES, TOKENIZER, randomize_norms, t5_tokenizer_folder

    torch.manual_seed(11)
    clip = randomize_norms(CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=49406, eos_token_id=49407,
        pad_token_id=49407)), 11).eval()
    t5 = T5EncoderModel(T5Config(vocab_size=len(T5_PIECES), d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
                                 feed_forward_proj="gated-gelu")).eval()
    transformer = randomize_norms(FluxTransformer2DModel(
        patch_size=1, in_channels=in_channels, out_channels=64, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6)), 12).eval()
    vae = randomize_norms(AutoencoderKL(  # Flux's scale factor 8: its default 1024 px are 4096 tokens
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[4, 4, 8, 8], layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=32,
        shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False, use_post_quant_conv=False), 13).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    with tempfile.TemporaryDirectory() as t5_folder:
        tokenizer_2 = T5TokenizerFast(tokenizer_file=str(t5_tokenizer_folder(t5_folder) / "tokenizer.json"))
        FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=clip, text_encoder_2=t5,
                     tokenizer=CLIPTokenizer.from_pretrained(TOKENIZER), tokenizer_2=tokenizer_2).save_pretrained(folder)
    if in_channels != 64:  # the Fill model's own pipeline class, as its model_index.json names it
        index = Path(folder) / "model_index.json"
        index.write_text(index.read_text().replace('"FluxPipeline"', '"FluxFillPipeline"'))


def clip_model(folder):
    """A transformers CLIPModel (the CLIP score's), small and random (tests/test_metrics.py's)."""
    from test_metrics import save_random_clip

    save_random_clip(folder)


# hub id -> how its stand-in is made.
STANDINS = {
    "stable-diffusion-v1-5/stable-diffusion-v1-5": sd15,
    "runwayml/stable-diffusion-v1-5": sd15,
    "stabilityai/sd-turbo": sd15,
    "stable-diffusion-v1-5/stable-diffusion-inpainting": sd15_inpainting,
    "stabilityai/stable-diffusion-xl-base-1.0": sdxl_base,
    "stabilityai/sdxl-turbo": sdxl_base,
    "stabilityai/stable-diffusion-xl-refiner-1.0": sdxl_refiner,
    "diffusers/stable-diffusion-xl-1.0-inpainting-0.1": sdxl_inpainting,
    "lllyasviel/sd-controlnet-canny": sd15_controlnet,
    "lllyasviel/control_v11p_sd15_canny": sd15_controlnet,
    "lllyasviel/control_v11e_sd15_shuffle": sd15_controlnet,
    "diffusers/controlnet-canny-sdxl-1.0": sdxl_controlnet,
    "latent-consistency/lcm-lora-sdv1-5": sd15_lora,
    "h94/IP-Adapter": h94_ip_adapter,
    "TencentARC/t2iadapter_canny_sd15v2": sd15_t2i_adapter,
    "stabilityai/stable-diffusion-3.5-medium": sd35,
    "stabilityai/stable-diffusion-3.5-large": sd35,
    "stabilityai/stable-diffusion-3.5-large-turbo": sd35,
    "stabilityai/stable-diffusion-3.5-large-controlnet-depth": sd35_controlnet,
    "black-forest-labs/FLUX.1-dev": flux,
    "black-forest-labs/FLUX.1-Kontext-dev": flux,
    "black-forest-labs/FLUX.1-Fill-dev": functools.partial(flux, in_channels=384),
    "openai/clip-vit-large-patch14": clip_model,
}


def pictures(folder, size=32):
    """photo.png (a colour gradient), mask.png (white square: repainted) and edges.png (a canny-like drawing), of
    the stand-ins' default size (a picture's size is the image's: a larger one costs every step of its page)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size] / size
    photo = np.stack([x, y, 1 - x], -1)
    Image.fromarray((photo * 255).astype(np.uint8)).save(folder / "photo.png")
    mask = np.zeros((size, size), np.uint8)
    mask[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 255
    Image.fromarray(mask).save(folder / "mask.png")
    edges = np.zeros((size, size, 3), np.uint8)
    edges[size // 2, :] = edges[:, size // 3] = 255
    Image.fromarray(edges).save(folder / "edges.png")


def files(folder):
    """Everything the pages read from their working folder."""
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    from test_controlnet_model import controlnet_to_ldm
    from test_lora import kohya_file
    from test_single_file import to_single_file
    from test_textual_inversion import write
    from test_textual_inversion_xl import write as write_xl

    folder.mkdir(parents=True)
    pictures(folder)
    (folder / "pictures").mkdir()  # a folder of pictures to train on (docs/training.md)
    for i, angle in enumerate((0, 90, 180, 270)):
        Image.open(folder / "photo.png").rotate(angle).save(folder / "pictures" / f"{i}.png")
    tiny = torch_sd15()
    for sub in ("loras", "embeddings", "models"):
        (folder / sub).mkdir()
    kohya_file(folder / "loras" / "add_detail.safetensors", tiny, seed=1)
    kohya_file(folder / "loras" / "film-grain.safetensors", tiny, seed=2,
               keep=lambda component, name: component == "unet")
    kohya_file(folder / "style.safetensors", tiny, seed=3)
    torch.manual_seed(0)
    write(folder / "embeddings" / "charturner.pt", "a1111.pt", torch.randn(2, 32), "ignored")
    shutil.copy(folder / "embeddings" / "charturner.pt", folder / "charturner.pt")
    save_file(to_single_file(tiny, "sd1"), folder / "models" / "dreamshaper_8.safetensors")
    net = torch_sd15_controlnet()  # an original-layout ControlNet file (its config: --controlnet-config)
    save_file(controlnet_to_ldm(net.state_dict(), dict(net.config)), folder / "control_v11e_sd15_shuffle.safetensors")
    kohya_file(folder / "sdxl-style.safetensors", torch_sdxl(), seed=4)
    write_xl(folder / "sdxl-emb.safetensors", 2)
    (folder / "prompts.txt").write_text("a red fox, watercolor\na lighthouse at dusk\n")
    (folder / "prompts.jsonl").write_text(
        '{"prompt": "a red fox, watercolor", "negative_prompt": "blurry", "seed": 7, "guidance": 5.0}\n'
        '{"prompt": "a lighthouse at dusk", "steps": 3, "width": 96, "height": 64}\n')
    shutil.copy(REPO / "scripts" / "example_scheduler.py", folder / "example_scheduler.py")


def large_files(folder):
    """The files too large to copy into every page's folder (linked there instead): FID's network, random, in
    pytorch-fid's file (docs/research.md)."""
    from test_metrics import save_random_inception

    folder.mkdir(parents=True)
    save_random_inception(folder / "pt_inception-2015-12-05-6726825d.pth")


def build(root: Path):
    """root/hub: the Hugging Face cache of STANDINS; root/files: FILES, root/large: `large_files`. Built in a temporary folder and renamed
    into place, so a reader never sees half of it."""
    staging = root.with_name(f"{root.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    made = {}
    for hub_id, make in STANDINS.items():
        repo = staging / "hub" / ("models--" + hub_id.replace("/", "--"))
        snapshot = repo / "snapshots" / COMMIT
        if make in made:  # an alias: the same stand-in under another id
            shutil.copytree(made[make], snapshot)
        else:
            make(snapshot)
            made[make] = snapshot
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(COMMIT)
    files(staging / "files")
    large_files(staging / "large")
    os.rename(staging, root)
    return root


def standins(root: Path):
    """The stand-ins under `root`, built once for every pytest-xdist worker that asks (a file lock)."""
    from filelock import FileLock

    with FileLock(str(root) + ".lock"):
        if not root.exists():
            build(root)
    return root
