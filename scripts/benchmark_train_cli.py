"""Time `sdflax train lora` against diffusers' `train_text_to_image_lora.py` on the CPU, each in a fresh process.

    python scripts/benchmark_train_cli.py                                        # weights/tiny-sd at 32 px
    python scripts/benchmark_train_cli.py --model sd15 --resolution 128 --steps 4 # stable-diffusion-v1-5's configs

The script is not in the diffusers wheel: its training loop is reimplemented here line by line (the components from
the model folder, PEFT's LoRA on the UNet's to_q / to_k / to_v / to_out.0 in float32, the dataset's Resize +
CenterCrop + Normalize, and per update: the VAE's posterior sample times its scaling factor, the noise, the
timesteps, DDPM's add_noise, the text encoder, the UNet, MSE on the noise, backward, clip_grad_norm_, AdamW,
the scheduler's step, loss.item()). Both sides train on the same folder of random pictures with captions, from the
same model folder (sd15: random weights in stable-diffusion-v1-5's shapes, written once by diffusers).

Prints one JSON object: per side, `first_step_s` (from starting the process to the first update done: what a user
waits; sdflax with an empty compile cache), `steps_per_s` (the median over the updates after the first) with the
fastest and slowest update, and `wall_s` (the whole process); and `ratio` (sdflax / diffusers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "weights" / "tiny-sd"
TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]  # the script's target_modules
PICTURES = 8


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "sd15"), default="tiny")
    parser.add_argument("--resolution", type=int, default=None, help="pixels a side (default: 32, sd15 128)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12, help="updates, the first of them timed apart")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--worker", nargs=4, metavar=("SIDE", "MODEL", "DATA", "STARTED"), help=argparse.SUPPRESS)
    return parser


def sd15_folder(folder: Path) -> Path:
    """A diffusers folder with random weights in stable-diffusion-v1-5's shapes (made once)."""
    if (folder / "model_index.json").exists():
        return folder
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    sys.path.insert(0, str(REPO / "scripts"))
    from benchmark import SD15

    torch.manual_seed(0)
    strip = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}  # noqa: E731
    pipe = StableDiffusionPipeline(
        vae=AutoencoderKL(**strip(SD15["vae"])), unet=UNet2DConditionModel(**strip(SD15["unet"])),
        text_encoder=CLIPTextModel(CLIPTextConfig(**strip(SD15["text_encoder"]))),
        tokenizer=CLIPTokenizer.from_pretrained(TINY / "tokenizer"),
        scheduler=DDPMScheduler.from_config(strip(SD15["scheduler"])), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    pipe.save_pretrained(folder)
    return folder


def write_data(folder: Path, side: int) -> Path:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(0)
    for i in range(PICTURES):
        Image.fromarray(g.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(folder / f"p{i}.png")
        (folder / f"p{i}.txt").write_text(f"a photo of pattern number {i}")
    return folder


def run_sdflax(args, model, data, started):
    """`sdflax train lora` in this process, each update's end noted where its loss is logged."""
    from sdflax.__main__ import main
    from sdflax.cli import train_log

    done = []
    add = train_log.TrainLog.add
    train_log.TrainLog.add = lambda self, *a: done.append(time.time()) or add(self, *a)
    with tempfile.TemporaryDirectory() as out:
        code = main(["train", "lora", "--model", model, "--data", data, "--out", os.path.join(out, "run"),
                     "--cache-dir", os.path.join(out, "compiled"), "--resolution", str(args.resolution),
                     "--train-batch-size", str(args.batch), "--max-train-steps", str(args.steps), "--rank",
                     str(args.rank), "--learning-rate", "1e-4", "--checkpointing-steps", str(10 ** 6),
                     "--devices", "1", "--seed", "0", "--no-progress"])
    assert code == 0, code
    return [started, *done]


def run_diffusers(args, model, data, started):
    """train_text_to_image_lora.py's loop (its defaults: no flip, centre crop, epsilon, constant lr)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig
    from PIL import Image
    from transformers import CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    noise_scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(model, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(model, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
    for frozen in (unet, vae, text_encoder):
        frozen.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian",
                                target_modules=TARGETS))
    cast_training_params(unet, dtype=torch.float32)
    lora_layers = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora_layers, lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer, num_warmup_steps=0,
                                 num_training_steps=args.steps)

    def example(path):  # Resize(resolution, bilinear), CenterCrop, ToTensor, Normalize([0.5], [0.5])
        image = Image.open(path).convert("RGB")
        scale = args.resolution / min(image.size)
        image = image.resize((max(args.resolution, round(image.width * scale)),
                              max(args.resolution, round(image.height * scale))), Image.BILINEAR)
        left, top = (image.width - args.resolution) // 2, (image.height - args.resolution) // 2
        image = image.crop((left, top, left + args.resolution, top + args.resolution))
        pixels = torch.from_numpy(np.asarray(image, np.float32).transpose(2, 0, 1) / 255.0)
        caption = Path(path).with_suffix(".txt").read_text().strip()
        ids = tokenizer(caption, max_length=tokenizer.model_max_length, padding="max_length", truncation=True,
                        return_tensors="pt").input_ids[0]
        return (pixels - 0.5) / 0.5, ids

    examples = [example(p) for p in sorted(Path(data).glob("*.png"))]
    loader = torch.utils.data.DataLoader(examples, batch_size=args.batch, shuffle=True, collate_fn=lambda rows: (
        torch.stack([r[0] for r in rows]).contiguous().float(), torch.stack([r[1] for r in rows])))
    unet.train()
    done, step = [started], 0
    while step < args.steps:
        for pixel_values, input_ids in loader:
            latents = vae.encode(pixel_values).latent_dist.sample() * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],)).long()
            noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
            encoder_hidden_states = text_encoder(input_ids, return_dict=False)[0]
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
            loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lora_layers, 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            loss.item()  # the script's logging reads it
            done.append(time.time())
            step += 1
            if step == args.steps:
                break
    return done


def summary(times, ended):
    """times: the process's start, then each update's end."""
    steps = [b - a for a, b in zip(times[1:], times[2:])]
    median = statistics.median(steps)
    return {"first_step_s": times[1] - times[0], "steps_per_s": 1 / median, "steps_per_s_min": 1 / max(steps),
            "steps_per_s_max": 1 / min(steps), "seconds_per_step": median, "wall_s": ended - times[0]}


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.resolution = args.resolution or (128 if args.model == "sd15" else 32)
    if args.worker:
        side, model, data, started = args.worker
        run = run_sdflax if side == "sdflax" else run_diffusers
        print(json.dumps(run(args, model, data, float(started))))
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        model = str(TINY if args.model == "tiny" else sd15_folder(scratch / "sd15"))
        data = str(write_data(scratch / "data", args.resolution))
        results = {}
        for side in ("sdflax", "diffusers"):  # one after the other, each in a fresh process
            print(f"{side}: {args.steps} updates ...", file=sys.stderr)
            env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
            started = time.time()
            done = subprocess.run([sys.executable, __file__, *(argv or sys.argv[1:]), "--worker", side, model, data,
                                   repr(started)], stdout=subprocess.PIPE, text=True, env=env)
            if done.returncode:
                print(f"benchmark_train_cli.py: the {side} process failed (exit {done.returncode})", file=sys.stderr)
                return 2
            results[side] = summary(json.loads(done.stdout.strip().splitlines()[-1]), time.time())
    ratio = {k: results["sdflax"][k] / results["diffusers"][k] for k in ("steps_per_s", "first_step_s", "wall_s")}
    print(json.dumps({"model": args.model, "resolution": args.resolution, "batch": args.batch, "steps": args.steps,
                      "rank": args.rank, **results, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
