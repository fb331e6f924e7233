"""Sampler study: each sampler at each step count makes the same prompts with the same seeds; FID (against reference
pictures or their statistics) and CLIP score (with the prompts) are drawn against the number of model evaluations,
one line per sampler, as study.png, and written as study.csv.

The CLIP score is the mean of 100 · cos(image, prompt) over the pictures (torchmetrics' CLIPScore before its clip
at 0, which no real model's mean reaches). A model evaluation is one iteration of the sampling loop (one UNet call on the guided batch): one a step for most
samplers, one more than the steps for PNDM, two a step for Heun and DPM2. Image i of prompt p gets the seed
seed + p * images_per_prompt + i whatever the sampler, so the lines differ by the sampler alone.

    python scripts/sampler_study.py --model stable-diffusion-v1-5/stable-diffusion-v1-5 --prompts prompts.txt \\
        --samplers "Euler,DPM++ 2M Karras,UniPC" --steps 10,20,30 --inception pt_inception-2015-12-05-6726825d.pth \\
        --reference-stats reference.npz --clip openai/clip-vit-large-patch14 --out study
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import numpy as np

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127)]  # one per sampler, in the order given
GREY = (90, 90, 90)
PANEL = (420, 300)


def comma_list(kind):
    """"a,b,c" -> [kind(a), kind(b), kind(c)], each non-empty (a number: positive)."""
    def parse(text):
        try:
            values = [kind(value.strip()) for value in text.split(",")]
        except ValueError:
            values = None
        if not values or not all(value > 0 if isinstance(value, int) else value for value in values):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return values
    return parse


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a diffusers folder or hub id")
    parser.add_argument("--prompts", required=True, help="a text file, one prompt a line")
    parser.add_argument("--samplers", required=True, type=comma_list(str), help="sdflax's or A1111's names, commas "
                        "between (\"Euler,DPM++ 2M Karras\")")
    parser.add_argument("--steps", required=True, type=comma_list(int), help="step counts, e.g. 10,20,30")
    parser.add_argument("--images-per-prompt", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--guidance", type=float, default=None, help="default: the pipeline's")
    parser.add_argument("--size", type=int, default=None, help="image side in pixels (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=8, help="images per call")
    parser.add_argument("--inception", required=True, help="pytorch-fid's pt_inception-2015-12-05-6726825d.pth")
    reference = parser.add_mutually_exclusive_group(required=True)
    reference.add_argument("--reference", help="a folder of reference pictures")
    reference.add_argument("--reference-stats", help="their FID statistics (.npz: mu, sigma)")
    parser.add_argument("--clip", required=True, help="a transformers CLIPModel folder or hub id")
    parser.add_argument("--out", required=True, help="a new folder: study.png, study.csv")
    args = parser.parse_args(argv)
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or os.listdir(args.out)):
        parser.error(f"--out {args.out} exists and is not an empty folder: give a new one")
    return args


def generate(pipeline, params, prompts, seeds, steps, args):
    """The images (N, H, W, 3) in [0, 1] of prompts[i] with seeds[i], `args.batch_size` at a time."""
    import jax

    images = []
    size = {"height": args.size, "width": args.size} if args.size else {}
    guidance = {"guidance_scale": args.guidance} if args.guidance is not None else {}
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start:start + args.batch_size]
        keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(s))) for s in seeds[start:start + len(batch)]])
        out = pipeline(pipeline.prepare_inputs(batch), params, keys, steps, neg_prompt_ids=pipeline.prepare_inputs(
            [""] * len(batch)), **size, **guidance)
        images.append(np.asarray(out.images))
    return np.concatenate(images)


def run(args) -> list[dict]:
    """The study's rows: sampler, steps, evaluations, fid, clip_score."""
    from sdflax import from_pretrained, metrics

    with open(args.prompts) as file:
        unique = [line.strip() for line in file if line.strip()]
    prompts = [p for p in unique for _ in range(args.images_per_prompt)]
    seeds = [args.seed + i for i in range(len(prompts))]
    inception, clip = metrics.load_inception(args.inception), metrics.load_clip(args.clip)
    if args.reference_stats:
        reference = metrics.load_statistics(args.reference_stats)
    else:
        reference = metrics.feature_statistics(metrics.inception_features(args.reference, inception))
    rows = []
    for sampler in args.samplers:
        pipeline, params = from_pretrained(args.model, scheduler=sampler)
        for steps in args.steps:
            images = generate(pipeline, params, prompts, seeds, steps, args)
            features = metrics.inception_features(images, inception)
            evaluations = pipeline.scheduler.set_timesteps(steps, shape=(1, 4, 8, 8)).timesteps.shape[0]
            rows.append({"sampler": sampler, "steps": steps, "evaluations": int(evaluations),
                         "fid": metrics.fid_from_stats(*metrics.feature_statistics(features), *reference),
                         "clip_score": float(np.mean(metrics.clip_scores(images, prompts, clip)))})
            print(f"{sampler}, {steps} steps ({evaluations} evaluations): FID {rows[-1]['fid']:.4g}, CLIP score "
                  f"{rows[-1]['clip_score']:.4g}", file=sys.stderr)
    return rows


def panel(rows, samplers, metric, title):
    """One metric against the evaluations, a line per sampler, its range written on the axes."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", PANEL, "white")
    draw = ImageDraw.Draw(image)
    left, right, top, bottom = 60, PANEL[0] - 16, 28, PANEL[1] - 36
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=GREY)
    xs = [row["evaluations"] for row in rows]
    ys = [row[metric] for row in rows]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(ys), max(ys)
    y0, y1 = (y0 - 1, y1 + 1) if y1 - y0 < 1e-12 else (y0, y1)

    def point(x, y):
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)

    for sampler, colour in zip(samplers, COLOURS):
        points = sorted(point(r["evaluations"], r[metric]) for r in rows if r["sampler"] == sampler)
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        for x, y in points:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
    draw.text((left, 6), title, fill=(0, 0, 0))
    draw.text((4, top), f"{y1:.4g}", fill=GREY)
    draw.text((4, bottom - 10), f"{y0:.4g}", fill=GREY)
    draw.text((left, bottom + 6), f"{x0} evaluations", fill=GREY)
    draw.text((right - 30, bottom + 6), f"{x1}", fill=GREY)
    return image


def plot(rows, samplers):
    """FID and CLIP score side by side, the samplers' colours named under them."""
    from PIL import Image, ImageDraw

    legend = 16 * len(samplers) + 8
    image = Image.new("RGB", (2 * PANEL[0], PANEL[1] + legend), "white")
    image.paste(panel(rows, samplers, "fid", "FID (lower is better)"), (0, 0))
    image.paste(panel(rows, samplers, "clip_score", "CLIP score (higher is better)"), (PANEL[0], 0))
    draw = ImageDraw.Draw(image)
    for i, (sampler, colour) in enumerate(zip(samplers, COLOURS)):
        y = PANEL[1] + 4 + 16 * i
        draw.rectangle([60, y + 2, 80, y + 10], fill=colour)
        draw.text((88, y), sampler, fill=(0, 0, 0))
    return image


def main(argv=None) -> int:
    args = parse_args(argv)
    if len(args.samplers) > len(COLOURS):
        print(f"sampler_study: at most {len(COLOURS)} samplers a plot", file=sys.stderr)
        return 2
    rows = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "study.csv"), "x", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.samplers).save(os.path.join(args.out, "study.png"))
    print(os.path.join(args.out, "study.csv"))
    print(os.path.join(args.out, "study.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
