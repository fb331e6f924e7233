"""`sdflax demo FAMILY`: tiny random-weight stand-ins of the hub's checkpoints, written by sdflax itself (no torch)
in the hub's diffusers layout, so that every page of the docs runs offline, and diffusers reads them as sdflax does.

Each model is sdflax's own module for the real model's config.json (the bundled ones, sdflax/configs) made small,
its params drawn from a fixed seed in the shapes the module declares (`drawn`), and written in PyTorch's names and
layouts (`loading.torch_names`). The weights
are random: the stand-ins draw noise, not pictures; they prove the machinery. A UNet's default image is 32 px (a
VAE of scale factor 2 under a UNet of sample_size 16), so a page's fifty steps cost little.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

CONFIGS = Path(__file__).parent / "configs"
MODEL_FILES = {"diffusers": "diffusion_pytorch_model.safetensors", "transformers": "model.safetensors"}
# Where a transformers model keeps its tower, as the hub's checkpoints name it; the names left at the top.
PREFIXES = {"CLIPTextModel": ("text_model.", ()),
            "CLIPTextModelWithProjection": ("text_model.", ("text_projection",)),
            "CLIPVisionModelWithProjection": ("vision_model.", ("visual_projection",))}

# The small sizes, over the real configs: two levels everywhere, one layer a block, the real CLIP vocabulary.
VAE = dict(block_out_channels=[16, 32], down_block_types=["DownEncoderBlock2D"] * 2,
           up_block_types=["UpDecoderBlock2D"] * 2, layers_per_block=1, norm_num_groups=8, sample_size=32)
CLIP = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4, projection_dim=32)
SD15_UNET = dict(block_out_channels=[32, 64], down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                 up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], layers_per_block=1, cross_attention_dim=32,
                 attention_head_dim=8, norm_num_groups=8, sample_size=16)
SDXL_UNET = dict(block_out_channels=[32, 64], down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
                 up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], layers_per_block=1, attention_head_dim=[2, 4],
                 transformer_layers_per_block=[1, 1], addition_time_embed_dim=8, norm_num_groups=8, sample_size=16,
                 cross_attention_dim=64, projection_class_embeddings_input_dim=32 + 6 * 8)  # pooled + 6 time ids
SDXL_REFINER_UNET = dict(SDXL_UNET, cross_attention_dim=32, projection_class_embeddings_input_dim=32 + 5 * 8)
# SD 3.5 Medium's traits: ten blocks (its skip-layer guidance skips 7, 8 and 9), dual attention, QK RMSNorm.
SD35_TRANSFORMER = dict(sample_size=16, num_layers=10, attention_head_dim=8, num_attention_heads=4,
                        joint_attention_dim=96, caption_projection_dim=32, pooled_projection_dim=32 + 40,
                        pos_embed_max_size=16, dual_attention_layers=[0, 1, 2])
SD35_VAE = dict(VAE, block_out_channels=[8, 16], norm_num_groups=4)
CLIP_2 = dict(CLIP, intermediate_size=48)
CLIP_G = dict(CLIP, hidden_size=48, intermediate_size=64, projection_dim=40)
# A small SentencePiece (Unigram) vocabulary for T5: a few words, the letters, and T5's special pieces.
T5_WORDS = "a the photo of cat dog fox on mars astronaut riding horse red blue lighthouse watercolor".split()
T5_PIECES = ["<pad>", "</s>", "<unk>", "▁", *(f"▁{w}" for w in T5_WORDS), *"abcdefghijklmnopqrstuvwxyz", "ing", "er",
             ","]
T5 = dict(vocab_size=len(T5_PIECES), d_model=96, d_kv=8, num_heads=4, d_ff=48, num_layers=2, num_decoder_layers=2)
VISION = dict(architectures=["CLIPVisionModelWithProjection"], model_type="clip_vision_model", hidden_size=32,
              intermediate_size=37, num_hidden_layers=3, num_attention_heads=4, image_size=28, patch_size=14,
              projection_dim=24, hidden_act="gelu", num_channels=3, layer_norm_eps=1e-5)
CONDITION_CHANNELS = [8, 16]  # a ControlNet's condition encoder: one stride-2 level, the VAE's scale factor


def bundled(name: str, **small) -> dict:
    """A real model's config.json (sdflax/configs/`name`) with `small` over it; no dtype, so both readers load the
    weights as they are stored (float32)."""
    config = json.loads((CONFIGS / name / "config.json").read_text())
    return {key: value for key, value in {**config, **small}.items() if key not in ("torch_dtype", "dtype")}


def drawn(shapes, seed: int) -> dict:
    """Random params of the shapes `shapes` (a module's `param_shapes()`), from `seed`: kernels of variance
    1 / fan-in (LeCun's, Flax's default), norm scales around 1 and biases around 0 (not Flax's exact 1 and 0, so a
    mix-up of two would show; zero convolutions too), embeddings and tables of unit variance. Drawn by numpy over
    the traced shapes: compiling each model's `init` would cost more than all the rest."""
    from flax import traverse_util

    rng = np.random.default_rng(seed)
    params = {}
    for path, leaf in traverse_util.flatten_dict(shapes).items():
        x = rng.standard_normal(leaf.shape, np.float32)
        if path[-1] == "kernel":
            x /= np.sqrt(np.prod(leaf.shape[:-1]))
        elif path[-1] in ("scale", "bias"):
            x = 0.2 * x + (path[-1] == "scale")
        params[path] = x
    return traverse_util.unflatten_dict(params)


def model_class(config: dict) -> tuple[str, str]:
    """(library, class) of a config.json, as model_index.json names them."""
    if "_class_name" in config:
        return "diffusers", config["_class_name"]
    return "transformers", config["architectures"][0]


def write_model(folder: Path, config: dict, seed: int):
    """A model folder: config.json, and the weights of sdflax's module for `config`, drawn from `seed`."""
    from . import models
    from .loading.torch_names import torch_state_dict
    from .train.files import write_safetensors

    library, name = model_class(config)
    # sdflax's models are named as diffusers' and transformers' classes
    params = drawn(getattr(models, name).from_config(config).param_shapes(), seed)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_safetensors(folder / MODEL_FILES[library], torch_state_dict(params, *PREFIXES.get(name, ("", ()))),
                      {"format": "pt"})


def clip_tokenizer(folder: Path, pad_token=None):
    """CLIP's BPE tokenizer (the bundled vocabulary: prompts get the real models' ids); SDXL's and SD 3's second pads
    with "!"."""
    shutil.copytree(CONFIGS / "tokenizer", folder)
    if pad_token:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": pad_token}, indent=2) + "\n")


def t5_tokenizer(folder: Path):
    """tokenizer.json as transformers' SentencePiece converter writes T5's (its Precompiled normalizer aside)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import Unigram

    folder.mkdir(parents=True)
    backend = Tokenizer(Unigram([(p, 0.0 if i < 3 else -1.0 - 0.1 * i) for i, p in enumerate(T5_PIECES)], unk_id=2))
    backend.normalizer = normalizers.Replace(Regex(" {2,}"), " ")
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in T5_PIECES[:3]])
    backend.save(str(folder / "tokenizer.json"))
    config = dict(eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0, model_max_length=512,
                  tokenizer_class="T5Tokenizer")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


TOKENIZERS = {"clip": ("CLIPTokenizer", clip_tokenizer), "t5": ("T5TokenizerFast", t5_tokenizer),
              "clip_pad": ("CLIPTokenizer", lambda folder: clip_tokenizer(folder, "!"))}


def write_pipeline(folder: Path, pipeline: str, models: dict, tokenizers: dict, scheduler: str, absent=(), **options):
    """A diffusers pipeline folder: `models` {name: (config, seed)}, `tokenizers` {name: TOKENIZERS key}, the
    bundled `scheduler` config, model_index.json naming them (`absent`: the components listed as null)."""
    index = {"_class_name": pipeline, "_diffusers_version": "0.39.0", **options,
             **{name: [None, None] for name in absent}}
    for name, (config, seed) in models.items():
        write_model(folder / name, config, seed)
        index[name] = list(model_class(config))
    for name, kind in tokenizers.items():
        class_name, write = TOKENIZERS[kind]
        write(folder / name)
        index[name] = ["transformers", class_name]
    (folder / "scheduler").mkdir()
    shutil.copy(CONFIGS / scheduler / "scheduler" / "scheduler_config.json", folder / "scheduler")
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    index["scheduler"] = ["diffusers", config["_class_name"]]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


SD_ABSENT = ("safety_checker", "feature_extractor", "image_encoder")


def sd15(folder):
    write_pipeline(folder, "StableDiffusionPipeline", {
        "unet": (bundled("sd1/unet", **SD15_UNET), 0), "vae": (bundled("sd1/vae", **VAE), 1),
        "text_encoder": (bundled("sd1/text_encoder", **CLIP), 2)}, {"tokenizer": "clip"}, "sd1", SD_ABSENT,
        requires_safety_checker=False)


def sdxl(folder):
    write_pipeline(folder, "StableDiffusionXLPipeline", {
        "unet": (bundled("sdxl/unet", **SDXL_UNET), 3), "vae": (bundled("sdxl/vae", **VAE), 4),
        "text_encoder": (bundled("sdxl/text_encoder", **CLIP), 5),
        "text_encoder_2": (bundled("sdxl/text_encoder_2", **CLIP_2), 6)},
        {"tokenizer": "clip", "tokenizer_2": "clip_pad"}, "sdxl", SD_ABSENT[1:], force_zeros_for_empty_prompt=True)


def sdxl_refiner(folder):
    """The refiner's shape: no first text encoder; the base's VAE and second encoder (their seeds), a UNet of its
    own."""
    write_pipeline(folder, "StableDiffusionXLImg2ImgPipeline", {
        "unet": (bundled("sdxl_refiner/unet", **SDXL_REFINER_UNET), 7), "vae": (bundled("sdxl/vae", **VAE), 4),
        "text_encoder_2": (bundled("sdxl/text_encoder_2", **CLIP_2), 6)},
        {"tokenizer_2": "clip_pad"}, "sdxl_refiner", ("text_encoder", "tokenizer", *SD_ABSENT[1:]),
        force_zeros_for_empty_prompt=False, requires_aesthetics_score=True)


def sd35(folder):
    write_pipeline(folder, "StableDiffusion3Pipeline", {
        "transformer": (bundled("sd35_medium/transformer", **SD35_TRANSFORMER), 8),
        "vae": (bundled("sd35_medium/vae", **SD35_VAE), 9),
        "text_encoder": (bundled("sd35_medium/text_encoder", **CLIP), 10),
        "text_encoder_2": (bundled("sd35_medium/text_encoder_2", **CLIP_G), 11),
        "text_encoder_3": (bundled("sd35_medium/text_encoder_3", **T5), 12)},
        {"tokenizer": "clip", "tokenizer_2": "clip_pad", "tokenizer_3": "t5"}, "sd35_medium",
        ("image_encoder", "feature_extractor"))


def controlnet_config(unet: dict) -> dict:
    """diffusers' ControlNetModel.from_unet's config: the UNet's encoder half, a small condition encoder."""
    left = ("_class_name", "up_block_types", "out_channels", "center_input_sample", "sample_size")
    return {"_class_name": "ControlNetModel", **{k: v for k, v in unet.items() if k not in left},
            "conditioning_embedding_out_channels": CONDITION_CHANNELS}


def sd15_controlnet(folder):
    write_model(folder, controlnet_config(bundled("sd1/unet", **SD15_UNET)), 13)


def sdxl_controlnet(folder):
    write_model(folder, controlnet_config(bundled("sdxl/unet", **SDXL_UNET)), 14)


def t2i_adapter(folder):
    """A canny T2I-Adapter (one grey channel) whose features fit the SD 1.5 stand-in's down blocks."""
    write_model(folder, {"_class_name": "T2IAdapter", "in_channels": 1, "channels": SD15_UNET["block_out_channels"],
                         "num_res_blocks": 1, "downscale_factor": 2, "adapter_type": "full_adapter"}, 15)


def ip_adapter(folder):
    """h94/IP-Adapter's layout for the SD 1.5 stand-in: models/ip-adapter_sd15.safetensors (the image projection under
    h94's names, `image_proj.*`, and each cross-attention layer's to_k_ip / to_v_ip, `ip_adapter.{1,3,...}` in
    diffusers' order) and models/image_encoder, a CLIP vision tower."""
    import jax
    from flax import traverse_util

    from .models import UNet2DConditionModel
    from .models.ip_adapter import ImageProjection
    from .pipeline.ip_adapter import diffusers_order
    from .loading.torch_names import torch_module_name, torch_state_dict
    from .train.files import write_safetensors

    models = folder / "models"
    write_model(models / "image_encoder", VISION, 16)
    unet = bundled("sd1/unet", **SD15_UNET)
    shapes = UNet2DConditionModel.from_config(unet).param_shapes()
    widths = {torch_module_name("_".join(path[:-2])): leaf.shape[1]
              for path, leaf in traverse_util.flatten_dict(shapes).items() if path[-3:] == ("attn2", "to_k", "kernel")}
    width = unet["cross_attention_dim"]
    projection = ImageProjection(VISION["projection_dim"], width)
    shapes = jax.eval_shape(projection.init, jax.random.key(0), np.zeros((1, VISION["projection_dim"])))["params"]
    params = drawn({"proj": shapes["image_embeds"], "norm": shapes["norm"]}, 17)  # h94's names
    state = {f"image_proj.{k}": v for k, v in torch_state_dict(params).items()}
    rng = np.random.default_rng(18)
    for i, layer in enumerate(sorted(widths, key=diffusers_order)):
        for name in ("to_k_ip", "to_v_ip"):
            state[f"ip_adapter.{2 * i + 1}.{name}.weight"] = 0.2 * rng.standard_normal((widths[layer], width),
                                                                                     np.float32)
    write_safetensors(models / "ip-adapter_sd15.safetensors", state)


# family -> {folder under --out: its writer}
FAMILIES = {
    "sd15": {"tiny-sd15": sd15},
    "sdxl": {"tiny-sdxl": sdxl, "tiny-sdxl-refiner": sdxl_refiner},
    "sd35": {"tiny-sd35": sd35},
    "sd15-controlnet": {"tiny-sd15-controlnet": sd15_controlnet},
    "sdxl-controlnet": {"tiny-sdxl-controlnet": sdxl_controlnet},
    "ip-adapter": {"tiny-ip-adapter": ip_adapter},
    "t2i-adapter": {"tiny-t2i-adapter": t2i_adapter},
}


def write_demo(family: str, out="weights") -> list[Path]:
    """The stand-ins of `family` (a FAMILIES key, or "all") as new folders under `out`; their paths. An existing
    folder is never overwritten: FileExistsError before anything is written."""
    if family != "all" and family not in FAMILIES:
        raise ValueError(f"unknown demo family {family!r}: choose one of {', '.join(FAMILIES)} or all")
    writers = {Path(out) / name: write for key in (FAMILIES if family == "all" else [family])
               for name, write in FAMILIES[key].items()}
    if taken := [str(path) for path in writers if os.path.lexists(path)]:
        raise FileExistsError(f"{', '.join(taken)} exists: sdflax demo never overwrites a folder; remove it or "
                              "choose another --out")
    Path(out).mkdir(parents=True, exist_ok=True)
    for path, write in writers.items():
        staging = path.with_name(f"{path.name}.partial-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            write(staging)
            os.rename(staging, path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return list(writers)
