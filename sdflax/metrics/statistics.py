"""FID and KID from Inception features, in numpy float64 (no JAX, no scipy).

FID (Heusel et al. 2017) is the Fréchet distance of two Gaussians fitted to the features:
    ‖μ₁ − μ₂‖² + tr Σ₁ + tr Σ₂ − 2 tr (Σ₁ Σ₂)^½,
pytorch-fid's `calculate_frechet_distance`, whose scipy `sqrtm` of the product is replaced by the eigenvalues of a
symmetric matrix similar to Σ₁Σ₂ (so of the same trace), as k-diffusion's `fid` takes them.
KID (Bińkowski et al. 2018) is the unbiased squared MMD under the kernel (x·y / d + 1)³, averaged over the
partitions of at most `max_size` features each, as k-diffusion's `kid` computes it.
"""

from __future__ import annotations

import math
import os
import zipfile

import numpy as np


class StatisticsFileError(ValueError):
    """A statistics .npz is not one: unreadable, or without `mu` (d,) and `sigma` (d, d) of one d."""


def as_features(features, what="features") -> np.ndarray:
    """(N, d) float64, checked: two rows at least (a covariance needs them), finite."""
    array = np.asarray(features, dtype=np.float64)
    if array.ndim != 2 or array.shape[0] < 2 or array.shape[1] < 1:
        raise ValueError(f"{what} of shape {array.shape}: expected (N, d) with N >= 2 (one row a picture)")
    if not np.isfinite(array).all():
        raise ValueError(f"{what} hold NaN or inf")
    return array


def feature_statistics(features) -> tuple[np.ndarray, np.ndarray]:
    """(μ (d,), Σ (d, d)) of (N, d) features: the mean and the unbiased covariance (np.cov, as pytorch-fid)."""
    features = as_features(features)
    return features.mean(axis=0), np.cov(features, rowvar=False)


def trace_sqrt_product(sigma1, sigma2) -> float:
    """tr (Σ₁ Σ₂)^½ = Σ √λ of √Σ₁ Σ₂ √Σ₁, or of Lᵀ Σ₂ L with Σ₁ = L Lᵀ where Σ₁ is definite (both similar to Σ₁Σ₂,
    symmetric and semi-definite); |λ|: round-off negatives of a singular product count as the zeros they are."""
    try:
        root = np.linalg.cholesky(sigma1)  # a quarter of the work of an eigen-decomposition
    except np.linalg.LinAlgError:  # singular: fewer pictures than features
        values, vectors = np.linalg.eigh(sigma1)
        root = vectors * np.sqrt(np.abs(values))  # root @ root.T = Σ₁
    product = root.T @ sigma2 @ root
    return float(np.sqrt(np.abs(np.linalg.eigvalsh((product + product.T) / 2))).sum())


def fid_from_stats(mu1, sigma1, mu2, sigma2) -> float:
    """‖μ₁ − μ₂‖² + tr Σ₁ + tr Σ₂ − 2 tr (Σ₁ Σ₂)^½."""
    mu1, mu2 = (np.atleast_1d(np.asarray(m, np.float64)) for m in (mu1, mu2))
    sigma1, sigma2 = (np.atleast_2d(np.asarray(s, np.float64)) for s in (sigma1, sigma2))
    d = mu1.shape[0]
    if mu1.shape != (d,) or mu2.shape != (d,) or sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise ValueError(f"statistics of different sizes: mu {mu1.shape} and {mu2.shape}, sigma {sigma1.shape} and "
                         f"{sigma2.shape} (features of one network and layer on both sides?)")
    if not all(np.isfinite(a).all() for a in (mu1, mu2, sigma1, sigma2)):
        raise ValueError("the statistics hold NaN or inf")
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2)
                 - 2 * trace_sqrt_product((sigma1 + sigma1.T) / 2, sigma2))


def fid(features_a, features_b) -> float:
    """The FID of two (N, d) feature sets (`inception_features` of two sets of pictures). With fewer pictures than
    features, from the features themselves: Σ = XᵀX with X the centred features / √(N − 1), and the eigenvalues of
    Σ₁Σ₂ are the squared singular values of X₁X₂ᵀ (N₁ x N₂), so tr (Σ₁Σ₂)^½ is their sum."""
    a, b = as_features(features_a, "features_a"), as_features(features_b, "features_b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"features of {a.shape[1]} and {b.shape[1]} dimensions")
    if min(len(a), len(b)) > a.shape[1]:
        return fid_from_stats(*feature_statistics(a), *feature_statistics(b))
    xa, xb = ((x - x.mean(0)) / np.sqrt(len(x) - 1) for x in (a, b))
    diff = a.mean(0) - b.mean(0)
    return float(diff @ diff + (xa * xa).sum() + (xb * xb).sum() - 2 * np.linalg.svd(xa @ xb.T, compute_uv=False).sum())


def polynomial_kernel(x, y):
    return (x @ y.T / x.shape[-1] + 1) ** 3


def squared_mmd(x, y) -> float:
    """The unbiased estimate of MMD² (the diagonals of k(x, x) and k(y, y) left out)."""
    m, n = len(x), len(y)
    kxx, kyy, kxy = polynomial_kernel(x, x), polynomial_kernel(y, y), polynomial_kernel(x, y)
    return ((kxx.sum() - np.trace(kxx)) / m / (m - 1) + (kyy.sum() - np.trace(kyy)) / n / (n - 1)
            - kxy.sum() * 2 / m / n)


def kid(features_a, features_b, max_size=5000) -> float:
    """KID: MMD² averaged over ⌈max(N_a, N_b) / max_size⌉ partitions of both sets, in order (k-diffusion's)."""
    x, y = as_features(features_a, "features_a"), as_features(features_b, "features_b")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"features of {x.shape[1]} and {y.shape[1]} dimensions")
    parts = math.ceil(max(len(x) / max_size, len(y) / max_size))
    splits = [(x[round(i * len(x) / parts):round((i + 1) * len(x) / parts)],
               y[round(i * len(y) / parts):round((i + 1) * len(y) / parts)]) for i in range(parts)]
    if min(len(part) for pair in splits for part in pair) < 2:
        raise ValueError(f"KID of {len(x)} and {len(y)} pictures in {parts} partitions (of at most max_size="
                         f"{max_size}) leaves a partition of fewer than two: give a larger max_size")
    return float(sum(squared_mmd(a, b) for a, b in splits) / parts)


def save_statistics(path, mu, sigma) -> None:
    """An .npz with `mu` and `sigma`, as pytorch-fid's `--save-stats` writes it (and reads it back)."""
    mu, sigma = np.asarray(mu, np.float64), np.asarray(sigma, np.float64)
    check_statistics(mu, sigma, os.fspath(path))
    with open(path, "wb") as f:  # a file object: np.savez would add ".npz" to a name without it
        np.savez(f, mu=mu, sigma=sigma)


def load_statistics(path) -> tuple[np.ndarray, np.ndarray]:
    """(μ, Σ) of an .npz holding `mu` and `sigma` (pytorch-fid's, clean-fid's and `save_statistics`' files),
    read without pickle."""
    name = os.fspath(path)
    try:
        data = np.load(name, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise StatisticsFileError(f"{name}: a single array, not an .npz with mu and sigma")
        with data:
            missing = [key for key in ("mu", "sigma") if key not in data.files]
            if missing:
                raise StatisticsFileError(f"{name}: no {' and '.join(missing)} in it (it holds "
                                          f"{', '.join(data.files) or 'nothing'}): not FID statistics")
            mu, sigma = data["mu"], data["sigma"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        if isinstance(e, StatisticsFileError):
            raise
        raise StatisticsFileError(f"{name}: cannot read it as .npz ({' '.join(str(e).split())[:200]})") from None
    check_statistics(mu, sigma, name)
    return mu.astype(np.float64), sigma.astype(np.float64)


def check_statistics(mu, sigma, where):
    if mu.ndim != 1 or sigma.shape != (mu.shape[0], mu.shape[0]) or mu.dtype.kind != "f" or sigma.dtype.kind != "f":
        raise StatisticsFileError(f"{where}: mu {mu.dtype} {mu.shape} and sigma {sigma.dtype} {sigma.shape}: "
                                  "expected float mu (d,) and sigma (d, d)")
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise StatisticsFileError(f"{where}: mu or sigma hold NaN or inf")
