"""Time a LoRA training update of sdflax.train against diffusers' LoRA training step (PEFT's LoRA layers, AdamW,
clip_grad_norm_, the loss lines of train_text_to_image_lora.py), each in a fresh process of its own.

    python scripts/benchmark_train.py                                   # SD 1.5's architecture, 512², batch 1
    python scripts/benchmark_train.py --model tiny --resolution 64 --batch 2 --repeats 10
    python scripts/benchmark_train.py --mixed-precision bf16            # on an accelerator

Both sides build the same architecture with random weights (no download), train a rank --rank LoRA on the UNet's
attention projections, and take cached latents (the scripts' --cache_latents) and random caption ids. Prints one
JSON object: per side, `startup_s` (interpreter start to a built model: imports, backend start, weights),
`first_step_s` (sdflax: compiling included), `seconds_per_step` (median of --repeats updates, each waited on) with
its min and max, `steps_per_s`; and `ratio` (sdflax / diffusers; above 1 is faster for steps_per_s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

# the tests' SD 1.x shape (tests/builders.py): every kind of UNet block, one layer each
TINY = {
    "unet": {"sample_size": 16, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
             "block_out_channels": [32, 64], "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
             "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "cross_attention_dim": 32,
             "attention_head_dim": 8, "norm_num_groups": 8},
    "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [16, 32],
            "layers_per_block": 1, "down_block_types": ["DownEncoderBlock2D"] * 2,
            "up_block_types": ["UpDecoderBlock2D"] * 2, "norm_num_groups": 8, "sample_size": 32},
    "text_encoder": {"vocab_size": 49408, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 3,
                     "num_attention_heads": 4, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                     "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 49407, "projection_dim": 32},
}
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("sd15", "tiny"), default="sd15")
    parser.add_argument("--resolution", type=int, default=None, help="pixels a side (default: the model's)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed updates after the first")
    parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="no")
    parser.add_argument("--worker", choices=("sdflax", "diffusers"), help=argparse.SUPPRESS)
    return parser


def configs(model):
    if model == "tiny":
        tiny = dict(TINY)
        tiny["scheduler"] = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
                             "num_train_timesteps": 1000, "steps_offset": 1, "_class_name": "PNDMScheduler",
                             "skip_prk_steps": True}
        return tiny
    from benchmark import SD15

    return SD15


def inputs(args, config):
    import numpy as np

    side = (args.resolution or config["unet"]["sample_size"] * 2 ** (len(config["vae"]["block_out_channels"]) - 1))
    factor = 2 ** (len(config["vae"]["block_out_channels"]) - 1)
    g = np.random.default_rng(0)
    steps = []
    for _ in range(args.repeats + 1):
        steps.append({"latents": g.standard_normal((args.batch, 4, side // factor, side // factor)).astype(np.float32),
                      "input_ids": g.integers(0, 49407, (args.batch, 77)).astype(np.int32),
                      "noise": g.standard_normal((args.batch, 4, side // factor, side // factor)).astype(np.float32),
                      "timesteps": g.integers(0, 1000, args.batch).astype(np.int32)})
    return side, steps


def run_sdflax(args):
    import jax

    from benchmark import TOKENIZER, random_pipeline
    from sdflax.train import TrainConfig, Trainer

    config = configs(args.model)
    pipeline, params = random_pipeline(config, TOKENIZER, jax.numpy.float32)
    trainer = Trainer(pipeline, params, TrainConfig(method="lora", rank=args.rank,
                                                    mixed_precision=args.mixed_precision))
    startup = time.perf_counter() - STARTED
    side, steps = inputs(args, config)

    def update(step):
        draws = {k: step[k] for k in ("noise", "timesteps")}
        jax.block_until_ready(trainer.step({k: step[k] for k in ("latents", "input_ids")}, **draws))

    return side, startup, [timed(update, step) for step in steps], jax.devices()[0].device_kind


def run_diffusers(args):
    import numpy as np
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import CLIPTextConfig, CLIPTextModel

    config = configs(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    unet = UNet2DConditionModel(**config["unet"]).to(device)
    text_encoder = CLIPTextModel(CLIPTextConfig(**config["text_encoder"])).to(device)
    scheduler = DDPMScheduler.from_config({k: v for k, v in config["scheduler"].items() if not k.startswith("_")})
    unet.requires_grad_(False)
    text_encoder.requires_grad_(False)
    weight_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    text_encoder.to(dtype=weight_dtype)
    unet.to(dtype=weight_dtype)
    inject_adapter_in_model(LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
                                       target_modules=TARGETS), unet)
    trained = [p for n, p in unet.named_parameters() if "lora_" in n]
    for p in trained:
        p.data = p.data.float()  # cast_training_params: the LoRA in float32
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    startup = time.perf_counter() - STARTED
    side, steps = inputs(args, config)

    def update(step):
        latents, noise = (torch.from_numpy(step[k]).to(device) for k in ("latents", "noise"))
        timesteps = torch.from_numpy(step["timesteps"].astype(np.int64)).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16"):
            noisy = scheduler.add_noise(latents, noise, timesteps)
            states = text_encoder(torch.from_numpy(step["input_ids"].astype(np.int64)).to(device),
                                  return_dict=False)[0]
            prediction = unet(noisy, timesteps, states, return_dict=False)[0]
        loss = F.mse_loss(prediction.float(), noise.float(), reduction="mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()

    kind = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return side, startup, [timed(update, step) for step in steps], kind


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def report(side, startup, times, device):
    rest = times[1:]
    median = statistics.median(rest)
    return {"device": device, "resolution": side, "startup_s": startup, "first_step_s": times[0],
            "seconds_per_step": median, "seconds_per_step_min": min(rest), "seconds_per_step_max": max(rest),
            "steps_per_s": 1 / median}


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker:
        print(json.dumps(report(*(run_sdflax if args.worker == "sdflax" else run_diffusers)(args))))
        return 0
    results = {}
    for name in ("sdflax", "diffusers"):  # one after the other, each in a fresh process
        print(f"{name}: building and timing {args.repeats + 1} updates ...", file=sys.stderr)
        done = subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]), "--worker", name],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        if done.returncode:
            print(f"benchmark_train.py: the {name} process failed (exit {done.returncode}): see above",
                  file=sys.stderr)
            return 2
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    ours, theirs = results["sdflax"], results["diffusers"]
    ratio = {k: ours[k] / theirs[k] for k in ("steps_per_s", "first_step_s", "startup_s")}
    print(json.dumps({"model": args.model, "batch": args.batch, "rank": args.rank,
                      "mixed_precision": args.mixed_precision, **results, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
