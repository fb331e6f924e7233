"""`sdflax eval --images DIR ...`: FID, KID and CLIP score of a folder of pictures (`sdflax.metrics`), each where
its inputs are given, printed and written as JSON (--out). The flags are checked, and the files read that need no
model, before anything loads; JAX is imported only then."""

from __future__ import annotations

import json
import os
import sys
import types

from .parse import positive_int
from .request import UserError

# sdflax.metrics.PREPROCESSING, written out so that --help and argument errors start without JAX
PREPROCESSING = ("pytorch-fid", "torch-fidelity")


def add_command(commands):
    e = commands.add_parser("eval", help="a folder of pictures -> FID, KID, CLIP score (JSON)",
                            description="Score the pictures of --images: FID (against --reference-stats, or the "
                            "pictures of --reference, with KID too) on FID's Inception-v3 (--inception), and the CLIP "
                            "score of each picture with its prompt (--prompts with --clip), as pytorch-fid, "
                            "k-diffusion and torchmetrics compute them. Pictures are read in the order of their "
                            "names; line n of --prompts belongs to the n-th.")
    e.add_argument("--images", required=True, metavar="DIR", help="the pictures to score (.png, .jpg, .webp, .bmp)")
    e.add_argument("--prompts", metavar="FILE", help="one prompt a line (blank lines skipped), or sdflax batch's "
                   ".jsonl: the prompts of the pictures, in their names' order (what sdflax batch wrote from it)")
    e.add_argument("--clip", metavar="ID_OR_DIR", help="a transformers CLIPModel folder or hub id for the CLIP score "
                   "(torchmetrics' default: openai/clip-vit-large-patch14)")
    e.add_argument("--inception", metavar="FILE", help="FID's Inception weights, pytorch-fid's "
                   "pt_inception-2015-12-05-6726825d.pth (read without running its pickle)")
    reference = e.add_mutually_exclusive_group()
    reference.add_argument("--reference-stats", metavar="REF.npz", help="FID statistics (mu, sigma) of the "
                           "reference pictures, as pytorch-fid or --save-stats writes them")
    reference.add_argument("--reference", metavar="DIR", help="the reference pictures themselves (FID and KID)")
    e.add_argument("--save-stats", metavar="OUT.npz", help="write the statistics of --images (a new file)")
    e.add_argument("--out", metavar="FILE.json", help="write the metrics as JSON (a new file)")
    e.add_argument("--preprocessing", choices=PREPROCESSING, default=PREPROCESSING[0],
                   help="the resize to 299 x 299 before the Inception network: pytorch-fid's (default) or "
                   "torch-fidelity's (TensorFlow 1's)")
    e.add_argument("--batch-size", type=positive_int, default=50, metavar="N", help="pictures per network call "
                   "(default: 50)")
    e.add_argument("--kid-subset-size", type=positive_int, default=5000, metavar="N",
                   help="KID averages the MMD of partitions of at most N pictures (default: 5000, as k-diffusion)")


def run(args) -> int:
    plan = check(args)
    from .. import cache
    from .. import metrics

    cache.enable_compile_cache()
    results = {"images": args.images, "count": plan.count}
    if args.clip:
        print(f"CLIP score of {plan.count} pictures with {args.clip} ...", file=sys.stderr)
        results["clip_score"] = metrics.clip_score(args.images, plan.prompts, args.clip, args.batch_size)
        results["clip"] = args.clip
    if args.inception:
        inception = metrics.load_inception(args.inception)
        features = {}
        for name, folder in (("images", args.images), ("reference", args.reference)):
            if folder:
                print(f"Inception features of {folder} ...", file=sys.stderr)
                features[name] = metrics.inception_features(folder, inception, args.batch_size, args.preprocessing)
        results.update(inception=args.inception, preprocessing=args.preprocessing)
        stats = metrics.feature_statistics(features["images"])
        if args.save_stats:
            metrics.save_statistics(args.save_stats, *stats)
        if args.reference:
            results.update(reference=args.reference, reference_count=len(features["reference"]),
                           fid=metrics.fid(features["images"], features["reference"]),
                           kid=metrics.kid(features["images"], features["reference"], args.kid_subset_size))
        elif args.reference_stats:
            results.update(reference_stats=args.reference_stats, fid=metrics.fid_from_stats(*stats, *plan.reference))
    for key, name in (("fid", "FID"), ("kid", "KID"), ("clip_score", "CLIP score")):
        if key in results:
            print(f"{name}: {results[key]:.6g}")
    if args.save_stats:
        print(f"statistics of {plan.count} pictures written to {args.save_stats}")
    if args.out:
        with open(args.out, "x", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
    return 0


def check(args):
    """The flags together, the folders' pictures counted, the prompts read, --reference-stats read, the outputs
    new: what needs no model or JAX."""
    from ..metrics.pictures import PictureError, picture_files
    from ..metrics.statistics import StatisticsFileError, load_statistics

    if bool(args.clip) != bool(args.prompts):
        raise UserError("the CLIP score needs --clip (a CLIPModel) and --prompts (one per picture): give both")
    fid = args.reference or args.reference_stats
    if (fid or args.save_stats) and not args.inception:
        raise UserError("FID needs --inception FILE (pytorch-fid's pt_inception-2015-12-05-6726825d.pth)")
    if args.inception and not (fid or args.save_stats):
        raise UserError("--inception: give --reference DIR or --reference-stats REF.npz to compute FID (or "
                        "--save-stats OUT.npz)")
    if not (args.clip or args.inception):
        raise UserError("nothing to compute: give --clip and --prompts (CLIP score), or --inception with --reference "
                        "or --reference-stats (FID)")
    for flag, path in (("--inception", args.inception), ("--reference-stats", args.reference_stats)):
        if path and not os.path.isfile(os.path.expanduser(path)):
            raise UserError(f"{flag} {path}: no such file")
    for flag, path in (("--out", args.out), ("--save-stats", args.save_stats)):
        if path and os.path.lexists(path):
            raise UserError(f"{flag} {path} exists: sdflax never overwrites a file; give a new name")
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UserError(f"{flag} {path}: no folder {os.path.dirname(os.path.abspath(path))} to write it in")
    counts = {}
    for flag, folder in (("--images", args.images), ("--reference", args.reference)):
        try:
            counts[flag] = len(picture_files(folder)) if folder else None
        except PictureError as e:
            raise UserError(f"{flag} {e}") from None
        if args.inception and folder and counts[flag] < 2:
            raise UserError(f"{flag} {folder}: FID needs two pictures at least (a covariance), found {counts[flag]}")
    count = counts["--images"]
    try:
        reference = load_statistics(os.path.expanduser(args.reference_stats)) if args.reference_stats else None
    except StatisticsFileError as e:
        raise UserError(f"--reference-stats {e}") from None
    prompts = None
    if args.prompts:
        from .batch import read_prompts

        defaults = types.SimpleNamespace(negative_prompt=None, guidance=None, steps=None, height=None, width=None)
        prompts = [line.prompt for line in read_prompts(args.prompts, defaults)]
        if len(prompts) != count:
            raise UserError(f"--prompts {args.prompts} holds {len(prompts)} prompts for the {count} pictures of "
                            f"{args.images}: give one prompt per picture, in the order of their names")
    return types.SimpleNamespace(count=count, prompts=prompts, reference=reference)
