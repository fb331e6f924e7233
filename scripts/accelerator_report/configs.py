"""Each family's models as config dicts: the published checkpoints' (sdflax's bundled configs) at full size, and
the same block structure with few channels and layers (tiny) for the CPU run."""

from __future__ import annotations

import copy
from pathlib import Path

from benchmark import SD15, SD35_MEDIUM, read_bundled_configs  # one reading of the configs for both scripts

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "weights" / "tiny-sd" / "tokenizer"  # the real CLIP BPE vocabulary
PROMPT = "a photo of an astronaut riding a horse on mars"
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")


def with_size(configs) -> dict:
    """The configs and the family's image size ("size"), its VAE's sample size: the checkpoint's own."""
    return {**configs, "size": configs["vae"]["sample_size"]}


# stable-diffusion-v1-5, stable-diffusion-xl-base-1.0 and stable-diffusion-3.5-medium (MMDiT-X: dual attention in
# its first 13 blocks; CLIP-L, CLIP-G and T5-XXL)
FULL = {"sd15": with_size(SD15),
        "sdxl": with_size(read_bundled_configs("sdxl", ("unet", "vae", "text_encoder", "text_encoder_2"))),
        "sd35": with_size(SD35_MEDIUM)}
# The values of each model's config that the tiny models change.
TINY_CLIP = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
             "projection_dim": 32}
TINY_VAE = {"block_out_channels": [8, 8, 16, 16], "layers_per_block": 1, "norm_num_groups": 4, "sample_size": 64}
TINY_CHANGES = {
    "sd15": {"unet": {"block_out_channels": [16, 16, 32, 32], "cross_attention_dim": 32, "layers_per_block": 1,
                      "norm_num_groups": 8, "sample_size": 8},
             "vae": TINY_VAE, "text_encoder": TINY_CLIP},
    "sdxl": {"unet": {"block_out_channels": [16, 32, 32], "attention_head_dim": [1, 2, 4],
                      "transformer_layers_per_block": [1, 1, 2], "cross_attention_dim": 64,
                      "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 32 + 6 * 8,
                      "norm_num_groups": 8, "layers_per_block": 1, "sample_size": 8},
             "vae": TINY_VAE, "text_encoder": TINY_CLIP, "text_encoder_2": TINY_CLIP},
    "sd35": {"transformer": {"attention_head_dim": 8, "caption_projection_dim": 32, "dual_attention_layers": [0],
                             "joint_attention_dim": 64, "num_attention_heads": 4, "num_layers": 2,
                             "pooled_projection_dim": 32 + 32, "pos_embed_max_size": 16, "sample_size": 8},
             "vae": TINY_VAE, "text_encoder": TINY_CLIP, "text_encoder_2": TINY_CLIP,
             "text_encoder_3": {"d_ff": 48, "d_kv": 8, "d_model": 64, "num_heads": 4, "num_layers": 2,
                                "vocab_size": 64}},
}
TINY = {family: with_size({**FULL[family], **{name: {**FULL[family][name], **change}
                                              for name, change in changes.items()}})
        for family, changes in TINY_CHANGES.items()}
SIZES = {"full": FULL, "tiny": TINY}


def configs_for(family, size):
    return copy.deepcopy(SIZES[size][family])
