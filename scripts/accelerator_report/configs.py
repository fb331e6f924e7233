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


# FLUX.1-dev's config.json values (sdflax bundles no Flux configs): 19 double- and 38 single-stream blocks of 24
# heads x 128, T5 states 4096 wide, CLIP-L's pooled 768, the guidance embedder; its CLIP-L is SD 1.5's text encoder,
# its T5-XXL SD 3.5's, its VAE SD 3.5's with its own latent scale and shift; the flow-matching scheduler shifting
# by the image's token count.
FLUX_DEV = {
    "transformer": {"_class_name": "FluxTransformer2DModel", "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56],
                    "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096, "num_attention_heads": 24,
                    "num_layers": 19, "num_single_layers": 38, "patch_size": 1, "pooled_projection_dim": 768},
    "vae": {**SD35_MEDIUM["vae"], "scaling_factor": 0.3611, "shift_factor": 0.1159},
    "text_encoder": SD15["text_encoder"],
    "text_encoder_2": SD35_MEDIUM["text_encoder_3"],
    "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "base_image_seq_len": 256, "base_shift": 0.5,
                  "max_image_seq_len": 4096, "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
                  "use_dynamic_shifting": True},
}
# stable-diffusion-v1-5, stable-diffusion-xl-base-1.0, stable-diffusion-3.5-medium (MMDiT-X: dual attention in its
# first 13 blocks; CLIP-L, CLIP-G and T5-XXL) and FLUX.1-dev
FULL = {"sd15": with_size(SD15),
        "sdxl": with_size(read_bundled_configs("sdxl", ("unet", "vae", "text_encoder", "text_encoder_2"))),
        "sd35": with_size(SD35_MEDIUM), "flux": with_size(FLUX_DEV)}
# The values of each model's config that the tiny models change.
TINY_CLIP = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
             "projection_dim": 32}
TINY_VAE = {"block_out_channels": [8, 8, 16, 16], "layers_per_block": 1, "norm_num_groups": 4, "sample_size": 64}
TINY_T5 = {"d_ff": 48, "d_kv": 8, "d_model": 64, "num_heads": 4, "num_layers": 2, "vocab_size": 64}
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
             "text_encoder_3": TINY_T5},
    "flux": {"transformer": {"attention_head_dim": 16, "axes_dims_rope": [4, 6, 6], "joint_attention_dim": 64,
                             "num_attention_heads": 2, "num_layers": 2, "num_single_layers": 2,
                             "pooled_projection_dim": 32},
             "vae": TINY_VAE, "text_encoder": TINY_CLIP, "text_encoder_2": TINY_T5},
}
TINY = {family: with_size({**FULL[family], **{name: {**FULL[family][name], **change}
                                              for name, change in changes.items()}})
        for family, changes in TINY_CHANGES.items()}
SIZES = {"full": FULL, "tiny": TINY}
# Flux's parity runs whole pipelines in float32 on small models: at full size FLUX.1-dev's widths (24 heads x 128,
# its rotary axes, T5-XXL's 4096 and CLIP-L) with one double- and two single-stream blocks and two T5 layers.
FLUX_PARITY = {"full": {"transformer": {"num_layers": 1, "num_single_layers": 2}, "text_encoder_2": {"num_layers": 2}},
               "tiny": {}}


def configs_for(family, size, parity=False):
    """A family's configs at `size`; with `parity`, the smaller models of a correctness job that runs whole
    pipelines (Flux's)."""
    configs = copy.deepcopy(SIZES[size][family])
    for name, change in (FLUX_PARITY[size] if parity else {}).items():
        configs[name].update(change)
    return configs
