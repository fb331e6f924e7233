"""Make `weights/tiny-sd`: a complete Stable Diffusion 1.x checkpoint in diffusers layout, scaled down, random weights.

It has every part of a real SD 1.x hub repo (`model_index.json`, `unet/`, `vae/`, `text_encoder/`, `tokenizer/`,
`scheduler/`, safetensors weights) and the same architecture with fewer channels and layers, so loading,
tokenizing, sampling and decoding all run offline in seconds. The tokenizer is the real CLIP BPE tokenizer and
the scheduler is SD 1.4's, so prompts tokenize and timesteps fall exactly as with real weights. The weights are
random: the checkpoint proves the machinery and draws noise, not pictures.

Built with diffusers' and transformers' PyTorch classes (the only place in the project that imports them besides
the tests) from a fixed seed; the safetensors files are byte-identical from run to run.

    python scripts/make_tiny_checkpoint.py                          # re-makes weights/tiny-sd
    python scripts/make_tiny_checkpoint.py --out elsewhere/tiny-sd  # somewhere else
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "weights" / "tiny-sd"
DEFAULT_TOKENIZER = REPO / "sdflax" / "configs" / "tokenizer"  # the bundled CLIP BPE: vocab.json + merges.txt
SEED = 0

# SD 1.x's UNet (block types, cross-attention, 32 norm groups, heads given as `attention_head_dim`),
# with channels 320/640/1280/1280 -> 32/64/64, one resnet per level instead of two, 768-wide text states -> 32.
UNET = dict(
    sample_size=32, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64, 64),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
)
# SD 1.x's VAE with three levels instead of four: vae_scale_factor 4, so images are 4 * 32 = 128 pixels a side.
VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64, 64), layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
    norm_num_groups=32, sample_size=128, scaling_factor=0.18215,
)
# CLIP ViT-L/14's text tower (quick_gelu, 77 positions, the full 49,408-token vocabulary), 32 wide and 3 deep.
# Pooling picks the eos token by id, so the ids are the real ones (SD 1.x's old config says 1 and 2).
TEXT_ENCODER = dict(
    vocab_size=49408, max_position_embeddings=77, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=4, projection_dim=32, hidden_act="quick_gelu",
    bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
)
# CompVis/stable-diffusion-v1-4's scheduler/scheduler_config.json.
SCHEDULER = dict(
    beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000, steps_offset=1,
    skip_prk_steps=True, set_alpha_to_one=False, clip_sample=False, trained_betas=None,
)
CHECK_PROMPT = "a photo of an astronaut riding a horse on mars"
CHECK_IDS = [49406, 320, 1125, 539, 550, 18376, 6765, 320, 4558, 525, 7496, 49407]
MAX_BYTES = 20_000_000


def require_torch():
    """PyTorch, which builds the models; without it one line and status 2 (--help needs none)."""
    try:
        import torch
    except ImportError as e:
        print(f"make_tiny_checkpoint: error: the checkpoint is built with PyTorch ({e}): pip install torch==2.13.0",
              file=sys.stderr)
        raise SystemExit(2) from None
    return torch


def randomize_norms(model, seed):
    """Norm layers start at scale 1, bias 0; draw them too, so a loader that mixes the two up shows it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None:
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
    return model.eval()


def seeded(build, seed):
    """Each model from its own fresh seed, so changing one model's config leaves the others' weights alone."""
    import torch

    torch.manual_seed(seed)
    return randomize_norms(build(), seed)


def make_tokenizer(tokenizer_dir: Path):
    from transformers import CLIPTokenizer

    eot = "<|endoftext|>"
    return CLIPTokenizer(str(tokenizer_dir / "vocab.json"), str(tokenizer_dir / "merges.txt"), model_max_length=77,
                         bos_token="<|startoftext|>", eos_token=eot, pad_token=eot, unk_token=eot)


def make_pipeline(tokenizer_dir: Path, seed: int = SEED):
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    return StableDiffusionPipeline(
        vae=seeded(lambda: AutoencoderKL(**VAE), seed),
        text_encoder=seeded(lambda: CLIPTextModel(CLIPTextConfig(**TEXT_ENCODER)), seed),
        tokenizer=make_tokenizer(tokenizer_dir),
        unet=seeded(lambda: UNet2DConditionModel(**UNET), seed),
        scheduler=PNDMScheduler.from_config(SCHEDULER),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def save(pipe, out: Path, tokenizer_dir: Path):
    """save_pretrained, then give tokenizer/ the SD 1.x hub layout: vocab.json + merges.txt + tokenizer_config.json.

    transformers 5 writes tokenizer.json instead of the two BPE files; dropping it makes every transformers
    version read the files real SD 1.x repos ship (and saves 3.6 MB)."""
    if out.exists():
        if not (out / "model_index.json").exists():
            raise SystemExit(f"{out} exists and is not a diffusers checkpoint; not overwriting it")
        shutil.rmtree(out)
    pipe.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer" / "tokenizer.json").unlink(missing_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(tokenizer_dir / name, out / "tokenizer" / name)


def check(out: Path):
    """The saved tokenizer gives the real ids; the whole checkpoint stays small."""
    from transformers import CLIPTokenizer

    ids = CLIPTokenizer.from_pretrained(out / "tokenizer")(CHECK_PROMPT).input_ids
    if ids != CHECK_IDS:
        raise SystemExit(f"tokenizer check failed: {CHECK_PROMPT!r} -> {ids}, expected {CHECK_IDS}")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    if total >= MAX_BYTES:
        raise SystemExit(f"{out} is {total / 1e6:.1f} MB, over the {MAX_BYTES / 1e6:.0f} MB budget")
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: weights/tiny-sd)")
    parser.add_argument("--tokenizer-dir", type=Path, default=DEFAULT_TOKENIZER,
                        help="folder with CLIP's vocab.json and merges.txt (default: ../shared/data/clip-tokenizer)")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    require_torch()

    start = time.perf_counter()
    save(make_pipeline(args.tokenizer_dir, args.seed), args.out, args.tokenizer_dir)
    total = check(args.out)
    size = UNET["sample_size"] * 2 ** (len(VAE["block_out_channels"]) - 1)
    print(f"wrote {args.out}: {total / 1e6:.1f} MB, default image {size}x{size}, "
          f"in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
