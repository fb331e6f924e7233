"""Download a diffusers Stable Diffusion checkpoint from the Hugging Face hub into weights/<name>.

Only the files sdflax reads are fetched (the same allow patterns as `StableDiffusion.from_pretrained`: configs,
tokenizer, scheduler and one safetensors file per model; no safety checker, no fp16/EMA/.ckpt duplicates):

    python scripts/download_weights.py stable-diffusion-v1-5/stable-diffusion-v1-5    # -> weights/stable-diffusion-v1-5
    python scripts/download_weights.py CompVis/stable-diffusion-v1-4 --name sd-v1-4
    sdflax generate "a lighthouse at dawn" --model weights/sd-v1-4

Gated repos need a token (`hf auth login` or HF_TOKEN). Errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

WEIGHTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repo_id", help="hub id, e.g. stable-diffusion-v1-5/stable-diffusion-v1-5")
    parser.add_argument("--name", help="folder name under --dest (default: the repo's name)")
    parser.add_argument("--revision", help="branch, tag or commit (default: main)")
    parser.add_argument("--dest", default=WEIGHTS, help="parent folder (default: this repository's weights/)")
    args = parser.parse_args(argv)

    from sdflax.loading.hub import ModelNotFoundError, download
    from sdflax.loading.folders import COMPONENTS, check_pipeline_folder, checkpoint_files

    folder = os.path.join(args.dest, args.name or args.repo_id.rstrip("/").split("/")[-1])
    try:
        download(args.repo_id, args.revision, checkpoint_files(), local_dir=folder)
        # Repos without safetensors: the PyTorch .bin (or Flax msgpack) of each model that lacks them.
        lacking = [c for c in COMPONENTS if not any(f.endswith(".safetensors") for f in _files(folder, c))]
        if lacking:
            names = ("diffusion_pytorch_model.bin", "pytorch_model.bin", "diffusion_flax_model.msgpack",
                     "flax_model.msgpack")
            patterns = [f"{c}/{name}" for c in lacking for name in names]
            download(args.repo_id, args.revision, checkpoint_files() + patterns, local_dir=folder)
        check_pipeline_folder(folder, args.repo_id)
    except ModelNotFoundError as e:
        print(f"download_weights: error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0


def _files(folder, component):
    path = os.path.join(folder, component)
    return os.listdir(path) if os.path.isdir(path) else []


if __name__ == "__main__":
    sys.exit(main())
