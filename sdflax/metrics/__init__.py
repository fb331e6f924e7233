"""Sample-quality metrics on sdflax's own models: FID and KID from FID's Inception-v3 (`inception_features`, as
pytorch-fid or torch-fidelity compute them), CLIP score from a CLIPModel's towers (as torchmetrics defines it).
Statistics (`mu`, `sigma`) are kept as .npz files, as pytorch-fid keeps them. `sdflax eval` is the command."""

from .clip_score import CLIP, clip_score, clip_scores, load_clip
from .inception import PREPROCESSING, Inception, inception_features, load_inception
from .pictures import PictureError, picture_files
from .statistics import (StatisticsFileError, feature_statistics, fid, fid_from_stats, kid, load_statistics,
                         save_statistics)

__all__ = ["CLIP", "Inception", "PREPROCESSING", "PictureError", "StatisticsFileError", "clip_score", "clip_scores",
           "feature_statistics", "fid", "fid_from_stats", "inception_features", "kid", "load_clip", "load_inception",
           "load_statistics", "picture_files", "save_statistics"]
