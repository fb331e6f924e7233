"""sdflax.metrics and `sdflax eval` against their references, on random weights saved by the test in the real files'
layouts: the Inception features against torch-fidelity's `FeatureExtractorInceptionV3` (its resize) and against
the same network behind pytorch-fid's resize (`F.interpolate`, 2x - 1), at two picture sizes; FID against
pytorch-fid's `calculate_frechet_distance`, KID against k-diffusion's `kid`, CLIP score against torchmetrics'
`CLIPScore` on a transformers CLIPModel.

torch-fidelity's network module is pure torch, but its package imports torchvision (which does not import with the
CPU torch): the module is imported from an installed torch-fidelity, or else from its published wheel in
tests/oracles/, with a bare package in place of its __init__."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from builders import REPO, TOKENIZER, randomize_norms
from PIL import Image

from sdflax import metrics
from sdflax.cli import main
from sdflax.loading.files import CheckpointFileError, UnsafeCheckpointError
from sdflax.loading.legacy_torch import read_torch_any
from sdflax.metrics.pictures import pictures

WHEEL = REPO / "tests" / "oracles" / "torch_fidelity-0.4.0-py3-none-any.whl"
RTOL = 1e-4


def torch_fidelity_inception():
    """torch-fidelity's feature_extractor_inceptionv3 module; sys.modules is left as it was (torchmetrics looks for
    an installed torch-fidelity)."""
    spec = importlib.util.find_spec("torch_fidelity")
    package = types.ModuleType("torch_fidelity")
    package.__path__ = list(spec.submodule_search_locations) if spec else [f"{WHEEL}/torch_fidelity"]
    before = set(sys.modules)
    sys.modules["torch_fidelity"] = package
    try:
        return importlib.import_module("torch_fidelity.feature_extractor_inceptionv3")
    finally:
        for name in set(sys.modules) - before:
            if name.split(".")[0] == "torch_fidelity":
                del sys.modules[name]


def random_inception_state(fidelity):
    """The FID network's state dict with random weights and BatchNorm statistics, He-scaled so that the features
    stay of order one through its 94 layers; without num_batches_tracked, as pytorch-fid's file."""
    class Template(fidelity.FeatureExtractorInceptionV3):
        def load_state_dict(self, *args, **kwargs):
            pass

    download, fidelity.load_state_dict_from_url = fidelity.load_state_dict_from_url, lambda *a, **k: {}
    try:
        template = Template("inception-v3-compat", ["2048"])
    finally:
        fidelity.load_state_dict_from_url = download
    g = torch.Generator().manual_seed(0)
    state = {}
    for key, value in template.state_dict().items():
        if key.endswith("num_batches_tracked"):
            continue
        if key.endswith("conv.weight"):
            value = torch.randn(value.shape, generator=g) * math.sqrt(2 / value[0].numel())
        elif key.endswith("bn.weight"):
            value = 1 + 0.1 * torch.randn(value.shape, generator=g)
        elif key.endswith(("bn.bias", "running_mean")):
            value = 0.1 * torch.randn(value.shape, generator=g)
        elif key.endswith("running_var"):
            value = 0.5 + torch.rand(value.shape, generator=g)
        else:  # fc
            value = 0.02 * torch.randn(value.shape, generator=g)
        state[key] = value
    return state


@pytest.fixture(scope="module")
def inception(tmp_path_factory):
    """(the path of pytorch-fid's weights file, random, torch-fidelity's model loaded from it)."""
    path = tmp_path_factory.mktemp("inception") / "pt_inception-2015-12-05-6726825d.pth"
    save_random_inception(path)
    theirs = torch_fidelity_inception().FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                                                    feature_extractor_weights_path=path)
    return path, theirs


def pytorch_fid_features(theirs, pictures):
    """pytorch-fid's InceptionV3.forward: its resize and 2x - 1, then the FID network's blocks."""
    x = torch.from_numpy(np.stack(pictures)).permute(0, 3, 1, 2).float() / 255  # ToTensor
    x = 2 * F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False) - 1
    for name in ("Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "MaxPool_1", "Conv2d_3b_1x1", "Conv2d_4a_3x3",
                 "MaxPool_2", "Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d",
                 "Mixed_6e", "Mixed_7a", "Mixed_7b", "Mixed_7c", "AvgPool"):
        x = getattr(theirs, name)(x)
    return x.flatten(1).numpy()


def assert_close(ours, theirs, rtol=RTOL):
    np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=rtol * np.abs(theirs).max())


def test_inception_features_match_torch_fidelity_and_pytorch_fid(inception):
    """Two upsampled pictures and one downsampled, in batches of two (the last padded): each reference's resize."""
    path, theirs = inception
    rng = np.random.default_rng(0)
    small = [rng.integers(0, 256, (40, 56, 3), dtype=np.uint8) for _ in range(2)]
    large = [rng.integers(0, 256, (333, 301, 3), dtype=np.uint8)]
    model = metrics.load_inception(path)
    with torch.no_grad():
        fidelity = np.concatenate([theirs(torch.from_numpy(np.stack(group)).permute(0, 3, 1, 2))[0].numpy()
                                   for group in (small, large)])
        pytorch_fid = np.concatenate([pytorch_fid_features(theirs, group) for group in (small, large)])
    ours = metrics.inception_features(small + large, model, batch_size=2, preprocessing="torch-fidelity")
    assert ours.shape == (3, 2048) and ours.dtype == np.float32
    assert_close(ours, fidelity)
    ours = metrics.inception_features(small + large, model, batch_size=2)  # pytorch-fid's, the default
    assert_close(ours, pytorch_fid)
    assert np.abs(pytorch_fid - fidelity).max() > 100 * RTOL * np.abs(fidelity).max()  # the two resizes differ
    floats = metrics.inception_features(np.stack(small) / np.float32(255), model, batch_size=2)
    assert_close(floats, ours[:2], rtol=1e-5)  # float pictures in [0, 1] are uint8 / 255
    assert [p.shape for p in pictures(small[0])] == [(40, 56, 3)]  # one (H, W, 3) picture


def test_inception_weights_read_from_either_torch_format(inception, tmp_path):
    legacy = metrics.load_inception(inception[0])
    state = read_torch_any(inception[0])
    torch.save({k: torch.from_numpy(v.copy()) for k, v in state.items()}, tmp_path / "zip.pth")
    zipped = metrics.load_inception(tmp_path / "zip.pth")
    assert all(np.array_equal(a, b) for a, b in zip(*(jax.tree_util.tree_leaves(m.params) for m in (legacy, zipped))))
    torch.save({k: torch.from_numpy(v.copy()) for k, v in state.items() if not k.startswith("fc.")},
               tmp_path / "no_fc.pth")
    with pytest.raises(ValueError, match="missing from the checkpoint: fc/bias, fc/kernel"):
        metrics.load_inception(tmp_path / "no_fc.pth")


def test_legacy_torch_files_are_read_without_running_their_pickle(tmp_path):
    state = {"a": torch.randn(3, 4), "b": torch.arange(5), "t": torch.randn(4, 3).T, "h": torch.randn(2).half()}
    state["view"] = state["a"][1]  # shares a's storage
    torch.save(state, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    read = read_torch_any(tmp_path / "legacy.pth")
    assert all(np.array_equal(read[k], v.numpy()) for k, v in state.items())

    class Hostile:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))

    torch.save({"w": torch.ones(2), "x": Hostile()}, tmp_path / "hostile.pth", _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpointError, match="asks to import"):
        read_torch_any(tmp_path / "hostile.pth")
    assert not (tmp_path / "ran").exists()
    data = (tmp_path / "legacy.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[:-10])
    with pytest.raises(CheckpointFileError, match="runs past the end of the file"):
        read_torch_any(tmp_path / "cut.pth")
    (tmp_path / "noise.pth").write_bytes(b"\x80\x02" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointFileError):
        read_torch_any(tmp_path / "noise.pth")


def pytorch_fid_distance(mu1, sigma1, mu2, sigma2, eps=1e-6):
    """pytorch-fid's calculate_frechet_distance (scipy's sqrtm; without scipy, the same square root by numpy's
    general eigen-decomposition of the product, in float64)."""
    try:
        from scipy import linalg

        def sqrtm(a):
            return linalg.sqrtm(a)
    except ImportError:
        def sqrtm(a):
            values, vectors = np.linalg.eig(a)
            return (vectors * np.sqrt(values.astype(complex))) @ np.linalg.inv(vectors)
    diff = mu1 - mu2
    covmean = sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = sqrtm((sigma1 + offset).dot(sigma2 + offset))
    covmean = covmean.real
    return diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean)


@pytest.mark.parametrize("n, d", [(300, 64), (60, 128)])  # more pictures than features, and fewer (singular Σ)
def test_fid_matches_pytorch_fid(n, d, tmp_path):
    rng = np.random.default_rng(d)
    a = (rng.standard_normal((n, d)) * rng.uniform(0.5, 2, d)).astype(np.float32)
    b = (rng.standard_normal((n + 7, d)) @ (np.eye(d) + 0.1 * rng.standard_normal((d, d))) + 0.3).astype(np.float32)
    stats_a, stats_b = metrics.feature_statistics(a), metrics.feature_statistics(b)
    expected = pytorch_fid_distance(np.mean(a, axis=0), np.cov(a, rowvar=False),
                                    np.mean(b, axis=0), np.cov(b, rowvar=False))
    assert metrics.fid(a, b) == pytest.approx(expected, rel=RTOL)
    assert metrics.fid_from_stats(*stats_a, *stats_b) == pytest.approx(expected, rel=RTOL)
    assert metrics.fid(a, a) == pytest.approx(0, abs=1e-6 * expected)
    metrics.save_statistics(tmp_path / "a.npz", *stats_a)
    with open(tmp_path / "b.npz", "wb") as f:  # as pytorch-fid --save-stats writes it
        np.savez(f, mu=stats_b[0], sigma=stats_b[1])
    read = [metrics.load_statistics(tmp_path / name) for name in ("a.npz", "b.npz")]
    assert metrics.fid_from_stats(*read[0], *read[1]) == pytest.approx(expected, rel=RTOL)


def test_statistics_files_that_are_not_refuse_in_one_line(tmp_path):
    np.savez(tmp_path / "other.npz", mean=np.zeros(3))
    np.save(tmp_path / "array.npy", np.zeros(3))
    np.savez(tmp_path / "shapes.npz", mu=np.zeros(3), sigma=np.zeros((2, 2)))
    np.savez(tmp_path / "objects.npz", mu=np.array([{}], dtype=object), sigma=np.zeros((1, 1)))
    (tmp_path / "text.npz").write_text("mu, sigma")
    for name, expected in (("other.npz", "no mu and sigma in it"), ("array.npy", "not an .npz"),
                           ("shapes.npz", "expected float mu"), ("objects.npz", "cannot read it"),
                           ("text.npz", "cannot read it")):
        with pytest.raises(metrics.StatisticsFileError, match=expected) as error:
            metrics.load_statistics(tmp_path / name)
        assert "\n" not in str(error.value)


def k_diffusion_kid(x, y, max_size=5000):
    """k-diffusion's evaluation.kid (polynomial_kernel, squared_mmd), in torch."""
    def polynomial_kernel(x, y):
        d = x.shape[-1]
        dot = x @ y.transpose(-2, -1)
        return (dot / d + 1) ** 3

    def squared_mmd(x, y, kernel=polynomial_kernel):
        m = x.shape[-2]
        n = y.shape[-2]
        kxx = kernel(x, x)
        kyy = kernel(y, y)
        kxy = kernel(x, y)
        kxx_sum = kxx.sum([-1, -2]) - kxx.diagonal(dim1=-1, dim2=-2).sum(-1)
        kyy_sum = kyy.sum([-1, -2]) - kyy.diagonal(dim1=-1, dim2=-2).sum(-1)
        kxy_sum = kxy.sum([-1, -2])
        term_1 = kxx_sum / m / (m - 1)
        term_2 = kyy_sum / n / (n - 1)
        term_3 = kxy_sum * 2 / m / n
        return term_1 + term_2 - term_3

    x_size, y_size = x.shape[0], y.shape[0]
    n_partitions = math.ceil(max(x_size / max_size, y_size / max_size))
    total_mmd = x.new_zeros([])
    for i in range(n_partitions):
        cur_x = x[round(i * x_size / n_partitions):round((i + 1) * x_size / n_partitions)]
        cur_y = y[round(i * y_size / n_partitions):round((i + 1) * y_size / n_partitions)]
        total_mmd = total_mmd + squared_mmd(cur_x, cur_y)
    return total_mmd / n_partitions


@pytest.mark.parametrize("max_size", [5000, 12])  # one partition, and five of 6 and 10 rows
def test_kid_matches_k_diffusion(max_size):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((30, 64)), rng.standard_normal((50, 64)) * 1.2 + 0.1
    expected = k_diffusion_kid(torch.from_numpy(a), torch.from_numpy(b), max_size).item()
    assert metrics.kid(a.astype(np.float32), b.astype(np.float32), max_size) == pytest.approx(expected, rel=1e-6)


# ---- CLIP score ------------------------------------------------------------------------------------------------

CLIP_TEXT = dict(vocab_size=49408, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=77, hidden_act="gelu", projection_dim=24)
CLIP_VISION = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=28,
                   patch_size=14, projection_dim=24)
PROMPTS = ["a red fox", "a lighthouse at dusk, oil painting", "a very long prompt " * 20]  # the last cut at 77 ids


def save_random_clip(folder):
    """A random CLIPModel (projection 24) saved with the CLIP tokenizer and an image processor of its 28 px."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    torch.manual_seed(2)  # scores of both signs, a positive mean
    model = randomize_norms(CLIPModel(CLIPConfig(text_config=CLIP_TEXT, vision_config=CLIP_VISION,
                                                 projection_dim=24)), seed=1).eval()
    model.save_pretrained(folder)
    CLIPTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(folder)


def save_random_inception(path):
    """pytorch-fid's weights file, random, in torch's legacy format as the published file."""
    torch.save(random_inception_state(torch_fidelity_inception()), path, _use_new_zipfile_serialization=False)


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    save_random_clip(folder)
    return folder


def clip_pictures():
    rng = np.random.default_rng(2)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for shape in ((40, 56, 3), (30, 30, 3), (64, 20, 3))]


class Transformers4Features(torch.nn.Module):
    """transformers 5's get_image_features / get_text_features return an output whose pooler_output is the projected
    embedding; torchmetrics (written for transformers 4) takes that tensor itself."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def get_image_features(self, *args, **kwargs):
        out = self.model.get_image_features(*args, **kwargs)
        return getattr(out, "pooler_output", out)

    def get_text_features(self, *args, **kwargs):
        out = self.model.get_text_features(*args, **kwargs)
        return getattr(out, "pooler_output", out)


def reference_scores(folder, pictures, prompts):
    """(per-picture 100 · cos as torchmetrics' _clip_score_update makes them, CLIPScore's value or None without
    torchmetrics)."""
    from transformers import CLIPModel, CLIPProcessor

    model = Transformers4Features(CLIPModel.from_pretrained(folder).eval())
    processor = CLIPProcessor.from_pretrained(folder)
    tensors = [torch.from_numpy(p).permute(2, 0, 1) for p in pictures]
    with torch.no_grad():
        images = processor(images=tensors, return_tensors="pt", padding=True)
        image_features = model.get_image_features(images["pixel_values"])
        text = processor(text=prompts, return_tensors="pt", padding=True)
        ids, mask = text["input_ids"][..., :77], text["attention_mask"][..., :77]
        text_features = model.get_text_features(ids, mask)
    image_features = image_features / image_features.norm(p=2, dim=-1, keepdim=True)
    text_features = text_features / text_features.norm(p=2, dim=-1, keepdim=True)
    scores = (100 * (image_features * text_features).sum(axis=-1)).numpy()
    try:
        from torchmetrics.multimodal.clip_score import CLIPScore
    except ImportError:
        return scores, None
    metric = CLIPScore(model_name_or_path=lambda: (model, processor))
    with torch.no_grad():
        metric.update(tensors, prompts)
    return scores, metric.compute().item()


def test_clip_score_matches_torchmetrics(clip_folder):
    pictures = clip_pictures()
    scores, expected = reference_scores(clip_folder, pictures, PROMPTS)
    clip = metrics.load_clip(clip_folder)
    ours = metrics.clip_scores(pictures, PROMPTS, clip, batch_size=2)  # the second batch padded
    assert_close(ours, scores)
    assert ours[0] < 0 < ours.mean()  # the mean is clipped at 0, not each score
    if expected is None:  # torchmetrics not installed: its compute(), max(mean, 0)
        expected = max(scores.mean(), 0)
    assert metrics.clip_score(pictures, PROMPTS, clip) == pytest.approx(expected, rel=RTOL)
    assert metrics.clip_score(pictures[:1], PROMPTS[:1], clip) == 0
    with pytest.raises(ValueError, match="2 pictures and 3 prompts"):
        metrics.clip_scores(pictures[:2], PROMPTS, clip)


# ---- sdflax eval -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """images/ (three pictures of two sizes, with their prompts in prompts.txt) and reference/ (two)."""
    root = tmp_path_factory.mktemp("eval")
    rng = np.random.default_rng(3)
    for name, shapes in (("images", [(48, 40)] * 2 + [(70, 64)]), ("reference", [(48, 40)] * 2)):
        (root / name).mkdir()
        for i, shape in enumerate(shapes):
            Image.fromarray(rng.integers(0, 256, (*shape, 3), dtype=np.uint8)).save(root / name / f"{i:06d}.png")
    (root / "images" / "notes.txt").write_text("not a picture")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n\n")
    return root


def test_eval_prints_and_writes_the_librarys_numbers(inception, clip_folder, folders, capsys):
    images, reference, out = folders / "images", folders / "reference", folders / "metrics.json"
    args = ["eval", "--images", str(images), "--prompts", str(folders / "prompts.txt"), "--clip", str(clip_folder),
            "--inception", str(inception[0]), "--reference", str(reference), "--batch-size", "2",
            "--save-stats", str(folders / "images.npz"), "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    written = json.loads(out.read_text())
    model = metrics.load_inception(inception[0])
    ours = metrics.inception_features(images, model, batch_size=2)
    theirs = metrics.inception_features(reference, model, batch_size=2)
    assert written["count"] == 3 and written["reference_count"] == 2
    assert written["fid"] == pytest.approx(metrics.fid(ours, theirs), rel=1e-6)
    assert written["kid"] == pytest.approx(metrics.kid(ours, theirs), rel=1e-6)
    assert written["clip_score"] == pytest.approx(metrics.clip_score(images, PROMPTS, clip_folder), rel=1e-6)
    for name, key in (("FID", "fid"), ("KID", "kid"), ("CLIP score", "clip_score")):
        assert f"{name}: {written[key]:.6g}" in printed
    saved = metrics.load_statistics(folders / "images.npz")
    assert all(np.allclose(a, b) for a, b in zip(saved, metrics.feature_statistics(ours)))
    # the saved statistics as the reference of the reference pictures
    args = ["eval", "--images", str(reference), "--inception", str(inception[0]), "--reference-stats",
            str(folders / "images.npz"), "--batch-size", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out  # FID(reference, images) from the statistics: the first run's, another way
    assert printed.startswith("FID: ") and float(printed.split()[1]) == pytest.approx(written["fid"], rel=1e-5)


@pytest.mark.parametrize("args, expected", [
    ([], "nothing to compute"),
    (["--clip", "C"], "needs --clip (a CLIPModel) and --prompts"),
    (["--inception", "{inception}"], "give --reference DIR or --reference-stats"),
    (["--reference", "{reference}"], "FID needs --inception FILE"),
    (["--inception", "missing.pth", "--reference", "{reference}"], "--inception missing.pth: no such file"),
    (["--inception", "{inception}", "--reference", "{reference}", "--reference-stats", "r.npz"], "not allowed with"),
    (["--inception", "{inception}", "--reference", "{root}/nothing"], "--reference {root}/nothing: no such folder"),
    (["--inception", "{inception}", "--reference", "{root}"], "no pictures in it"),
    (["--inception", "{inception}", "--reference-stats", "{root}/prompts.txt"], "--reference-stats {root}/prompts"),
    (["--clip", "C", "--prompts", "{root}/two.txt"], "holds 2 prompts for the 3 pictures"),
    (["--inception", "{inception}", "--save-stats", "{root}/prompts.txt"], "exists: sdflax never overwrites"),
    (["--inception", "{root}/prompts.txt", "--save-stats", "{root}/new.npz"], "prompts.txt"),
    (["--batch-size", "0"], "--batch-size: must be at least 1"),
])
def test_eval_bad_input_is_one_line(args, expected, inception, folders, capsys):
    (folders / "two.txt").write_text("one\ntwo\n")
    fill = {"inception": str(inception[0]), "reference": str(folders / "reference"), "root": str(folders)}
    args = [arg.format(**fill) for arg in args]
    assert main(["eval", "--images", str(folders / "images"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and expected.format(**fill) in err, err
    assert not (folders / "new.npz").exists()


def test_eval_help_starts_without_jax(tmp_path):
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text('raise ImportError("jax is not to be imported here")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    for args, code, expected in ((["eval", "--help"], 0, "--reference-stats REF.npz"),
                                 (["eval", "--images", "x", "--batch-size", "0"], 2, "must be at least 1")):
        result = subprocess.run([sys.executable, "-m", "sdflax", *args], capture_output=True, text=True, env=env)
        assert result.returncode == code and expected in result.stdout + result.stderr, result.stderr
        assert "Traceback" not in result.stderr
