"""Features per second of FID's Inception-v3 on the CPU: `sdflax.metrics.inception_features` against torch-fidelity's
`FeatureExtractorInceptionV3` (its TensorFlow-1 resize) and the same torch network behind pytorch-fid's resize
(`F.interpolate`, 2x - 1: pytorch-fid's own package needs torchvision, which the CPU torch does not import), each
in separate fresh processes. A process loads the weights, runs one untimed pass (sdflax compiles there, or loads
the program from a compile cache the run shares), then times `--passes` passes over `--images` pictures; the
parent prints each implementation's median features/s with its spread (min - max over `--repeats` processes) and
the ratios sdflax / torch.

    python scripts/benchmark_inception.py                      # random weights, 32 pictures of 512 px, 3 processes each
    python scripts/benchmark_inception.py --weights pt_inception-2015-12-05-6726825d.pth --images 64

torch-fidelity is imported from an installed package, or from its wheel in tests/oracles/ (see tests/test_metrics.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WHEEL = REPO / "tests" / "oracles" / "torch_fidelity-0.4.0-py3-none-any.whl"
IMPLEMENTATIONS = {"sdflax (pytorch-fid resize)": ("sdflax", "pytorch-fid"),
                   "sdflax (torch-fidelity resize)": ("sdflax", "torch-fidelity"),
                   "torch, pytorch-fid resize": ("torch", "pytorch-fid"),
                   "torch-fidelity": ("torch", "torch-fidelity")}


def fidelity_module():
    """torch-fidelity's feature_extractor_inceptionv3, without its package's __init__ (which imports torchvision)."""
    spec = importlib.util.find_spec("torch_fidelity")
    package = types.ModuleType("torch_fidelity")
    package.__path__ = list(spec.submodule_search_locations) if spec else [f"{WHEEL}/torch_fidelity"]
    sys.modules["torch_fidelity"] = package
    return importlib.import_module("torch_fidelity.feature_extractor_inceptionv3")


def random_weights(path):
    """The FID network's state dict as torch initialises it, in pytorch-fid's file layout (torch's legacy format)."""
    import torch

    fidelity = fidelity_module()

    class Template(fidelity.FeatureExtractorInceptionV3):
        def load_state_dict(self, *args, **kwargs):
            pass

    fidelity.load_state_dict_from_url = lambda *a, **k: {}
    state = {k: v for k, v in Template("inception-v3-compat", ["2048"]).state_dict().items()
             if not k.endswith("num_batches_tracked")}
    torch.save(state, path, _use_new_zipfile_serialization=False)


def torch_extractor(weights, preprocessing):
    """pictures (N, H, W, 3) uint8 -> (N, 2048) features, torch on the CPU."""
    import torch
    import torch.nn.functional as F

    net = fidelity_module().FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                                        feature_extractor_weights_path=weights).eval()
    blocks = ("Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "MaxPool_1", "Conv2d_3b_1x1", "Conv2d_4a_3x3",
              "MaxPool_2", "Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d",
              "Mixed_6e", "Mixed_7a", "Mixed_7b", "Mixed_7c", "AvgPool")

    @torch.no_grad()
    def features(pictures):
        x = torch.from_numpy(pictures).permute(0, 3, 1, 2)
        if preprocessing == "torch-fidelity":
            return net(x)[0].numpy()
        x = 2 * F.interpolate(x.float() / 255, size=(299, 299), mode="bilinear", align_corners=False) - 1
        for name in blocks:
            x = getattr(net, name)(x)
        return x.flatten(1).numpy()

    return features


def sdflax_extractor(weights, preprocessing, batch_size):
    from sdflax import enable_compile_cache, metrics

    enable_compile_cache()
    inception = metrics.load_inception(weights)
    return lambda pictures: metrics.inception_features(pictures, inception, batch_size, preprocessing)


def worker(args):
    """One process: warm up, then the timed passes; prints a JSON line."""
    kind, preprocessing = IMPLEMENTATIONS[args.worker]
    pictures = np.random.default_rng(0).integers(0, 256, (args.images, args.size, args.size, 3), dtype=np.uint8)
    start = time.perf_counter()
    if kind == "sdflax":
        extract = sdflax_extractor(args.weights, preprocessing, args.batch_size)
    else:
        extract = torch_extractor(args.weights, preprocessing)
        batched = extract
        extract = lambda p: np.concatenate([batched(p[i:i + args.batch_size])  # noqa: E731
                                            for i in range(0, len(p), args.batch_size)])
    extract(pictures)  # sdflax: compiles (or loads) the programs
    warm = time.perf_counter() - start
    rates = []
    for _ in range(args.passes):
        start = time.perf_counter()
        extract(pictures)
        rates.append(args.images / (time.perf_counter() - start))
    print(json.dumps({"rate": statistics.median(rates), "first_pass_s": warm}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", help="pytorch-fid's weights file (default: random weights of its layout)")
    parser.add_argument("--images", type=int, default=32, help="pictures per pass")
    parser.add_argument("--size", type=int, default=512, help="their side in pixels (resized to 299)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--passes", type=int, default=2, help="timed passes per process (their median)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per implementation")
    parser.add_argument("--worker", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        weights = args.weights or os.path.join(tmp, "pt_inception-random.pth")
        if not args.weights:
            random_weights(weights)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "SDFLAX_CACHE_DIR": os.path.join(tmp, "cache"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        rates, first = {}, {}
        for repeat in range(args.repeats):  # interleaved, so that a slow spell of the machine hits all alike
            for name in IMPLEMENTATIONS:
                command = [sys.executable, __file__, "--worker", name, "--weights", weights, "--images",
                           str(args.images), "--size", str(args.size), "--batch-size", str(args.batch_size),
                           "--passes", str(args.passes)]
                result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                measured = json.loads(result.stdout.strip().splitlines()[-1])
                rates.setdefault(name, []).append(measured["rate"])
                first.setdefault(name, measured["first_pass_s"])
    print(f"{args.images} pictures of {args.size} px, batches of {args.batch_size}, CPU, {args.repeats} processes "
          f"x {args.passes} timed passes")
    for name, values in rates.items():
        print(f"{name:32s} {statistics.median(values):7.2f} features/s (spread {min(values):.2f} - "
              f"{max(values):.2f}); first process's first pass {first[name]:.1f} s")
    for preprocessing, theirs in (("pytorch-fid", "torch, pytorch-fid resize"), ("torch-fidelity", "torch-fidelity")):
        ours = rates[f"sdflax ({preprocessing} resize)"]
        ratios = [a / b for a, b in zip(ours, rates[theirs])]
        print(f"sdflax / {theirs:26s} {statistics.median(ratios):5.2f}x (per-round spread {min(ratios):.2f} - "
              f"{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
