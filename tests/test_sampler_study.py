"""scripts/sampler_study.py on the tiny stand-ins, 2 samplers x 2 step counts: its CSV holds the FID and CLIP score
of the images the pipeline makes for each, and its plot draws a line per sampler in both panels. FID's Inception-v3
is stood in for by a cheap feature map (compiling the network costs a minute of CPU; tests/test_metrics.py holds
`inception_features` to pytorch-fid's): the study's statistics and distances are sdflax.metrics' own."""

from __future__ import annotations

import csv
import importlib.util

import jax
import numpy as np
import pytest
from PIL import Image
from test_cli import ROOT, TINY
from test_metrics import save_random_clip

SAMPLERS = ["Euler", "DPM++ 2M Karras"]
PROMPTS = ["a red fox in the snow", "a lighthouse at dusk"]


def stand_in_features(images, inception, batch_size=50, preprocessing="pytorch-fid"):
    """(N, 12) features of pictures (a folder or arrays): each quadrant's mean colour."""
    from sdflax.metrics.pictures import picture_files

    if not isinstance(images, np.ndarray):
        images = np.stack([np.asarray(Image.open(p).convert("RGB"), np.float32) / 255 for p in picture_files(images)])
    h, w = images.shape[1] // 2, images.shape[2] // 2
    quadrants = [images[:, i * h:(i + 1) * h, j * w:(j + 1) * w].mean((1, 2)) for i in (0, 1) for j in (0, 1)]
    return np.concatenate(quadrants, 1).astype(np.float64)


def script():
    spec = importlib.util.spec_from_file_location("sampler_study", ROOT / "scripts" / "sampler_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from sdflax import metrics

    tmp = tmp_path_factory.mktemp("study")
    save_random_clip(tmp / "clip")
    (tmp / "inception.pth").write_bytes(b"")
    patch = pytest.MonkeyPatch()
    patch.setattr(metrics, "load_inception", lambda path: None)
    patch.setattr(metrics, "inception_features", stand_in_features)
    (tmp / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    (tmp / "reference").mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp / "reference" / f"{i}.png")
    module = script()
    args = ["--model", TINY, "--prompts", str(tmp / "prompts.txt"), "--samplers", ",".join(SAMPLERS), "--steps",
            "1,2", "--size", "32", "--inception", str(tmp / "inception.pth"), "--reference", str(tmp / "reference"),
            "--clip", str(tmp / "clip"), "--out", str(tmp / "out")]
    try:
        assert module.main(args) == 0
    finally:
        patch.undo()
    with open(tmp / "out" / "study.csv") as file:
        rows = list(csv.DictReader(file))
    return tmp, module, rows


def test_the_csv_holds_the_metrics_of_the_pipelines_images(study):
    from sdflax import StableDiffusion, metrics

    tmp, _, rows = study
    assert [(r["sampler"], r["steps"], r["evaluations"]) for r in rows] == [
        (s, n, n) for s in SAMPLERS for n in ("1", "2")]
    pipe, params = StableDiffusion.from_pretrained(TINY, scheduler="DPM++ 2M Karras")
    keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(s))) for s in (0, 1)])
    images = pipe(pipe.prepare_inputs(PROMPTS), params, keys, 2, neg_prompt_ids=pipe.prepare_inputs([""] * 2),
                  height=32, width=32).images
    fid = metrics.fid(stand_in_features(np.asarray(images), None), stand_in_features(tmp / "reference", None))
    clip = metrics.clip_scores(images, PROMPTS, metrics.load_clip(tmp / "clip")).mean()
    np.testing.assert_allclose([float(rows[3]["fid"]), float(rows[3]["clip_score"])], [fid, clip], rtol=1e-4)
    values = np.array([[float(r["fid"]), float(r["clip_score"])] for r in rows])
    # the sampler moves both numbers, by ten times the tolerance they are held to (random weights: little)
    assert (np.abs(values[:2] - values[2:]) > 1e-3 * np.abs(values[2:])).all()


def test_the_plot_draws_a_line_per_sampler_in_both_panels(study):
    tmp, module, _ = study
    plot = np.asarray(Image.open(tmp / "out" / "study.png").convert("RGB"))
    width, height = module.PANEL
    for colour in module.COLOURS[:len(SAMPLERS)]:
        found = (plot == colour).all(-1)
        assert found[:height, :width].sum() > 20 and found[:height, width:].sum() > 20  # FID's and CLIP's
        assert found[height:].any()  # and its legend entry
