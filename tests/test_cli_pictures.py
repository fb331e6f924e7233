"""Pictures of the sampler from `sdflax generate`: --trajectory's WebP frames are the pipeline's `return_trajectory`
x̂₀ decoded (lossless: equal pixels), --trajectory-sheet shows them with their σ, and --attention-maps' overlays are
the cross-attention hook's word maps laid over the image; bad flags are one line and status 2."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageSequence
from test_cli import TINY, pixels
from test_cli_controlnet import as_the_cli

from sdflax.cli import main

PROMPT = "a red fox in the snow"
SEED = 3
ARGS = ["generate", PROMPT, "--model", TINY, "--steps", "3", "--scheduler", "euler", "--height", "32", "--width",
        "32", "--seed", str(SEED), "--num-images", "1", "--no-progress"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The command's files, and the library's call as the command makes it (every device a row, hooked and with
    its trajectory)."""
    import jax

    from sdflax import StableDiffusion
    from sdflax.hooks import cross_attention_maps

    tmp = tmp_path_factory.mktemp("pictures")
    assert main([*ARGS, "--out", str(tmp / "fox.png"), "--trajectory", str(tmp / "steps.webp"),
                 "--trajectory-sheet", str(tmp / "sheet.png"), "--attention-maps", "fox, snow"]) == 0
    pipe, params = StableDiffusion.from_pretrained(TINY, scheduler="euler")
    keys = as_the_cli(SEED)
    ids, neg = pipe.prepare_inputs([PROMPT] * len(keys)), pipe.prepare_inputs([""] * len(keys))
    images, trajectory = pipe.with_hooks(cross_attention_maps()).generate_sharded(
        ids, params, keys, 3, neg_prompt_ids=neg, height=32, width=32, return_trajectory=True)
    frames = np.asarray(jax.jit(pipe.decode_latents)(params, trajectory.pred_x0[:, 0]))
    return tmp, pipe, ids, images, trajectory, (frames * 255).round().astype(np.uint8)


def test_the_webp_frames_are_the_decoded_predictions(made):
    tmp, _, _, images, trajectory, frames = made
    webp = Image.open(tmp / "steps.webp")
    got = np.stack([np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(webp)])
    assert got.shape == (3, 32, 32, 3) == frames.shape  # Euler: one evaluation a step
    np.testing.assert_array_equal(got, frames)
    # Euler's last step lands on its x̂₀: the last frame is the image; the first, still a guess, is far from it
    assert np.abs(got[-1].astype(int) - pixels(tmp / "fox.png")).max() <= 1
    assert np.abs(got[0].astype(np.float32) - got[-1]).mean() / 255 > 1e-2


def test_the_sheet_shows_the_frames_with_their_sigmas(made):
    from sdflax.cli.features.trajectory import evaluation_sigmas

    tmp, pipe, _, _, _, frames = made
    sheet = pixels(tmp / "sheet.png")
    assert sheet.shape[1] == 3 * 32 and sheet.shape[0] > 32
    for i in range(3):
        np.testing.assert_array_equal(sheet[:32, 32 * i:32 * (i + 1)], frames[i])
        assert (sheet[32:, 32 * i:32 * (i + 1)].max(-1) < 96).sum() > 10  # its σ written under it
    state = pipe.scheduler.set_timesteps(3, shape=(1, 4, 16, 16))
    np.testing.assert_allclose(evaluation_sigmas(pipe.scheduler, 3, 3), np.asarray(state.sigmas)[:3], rtol=1e-5)


def test_attention_overlays_are_the_hooks_word_maps(made):
    from sdflax.hooks.attention_maps import KEY, overlay, word_map

    tmp, pipe, ids, images, trajectory, _ = made
    maps = trajectory.hooks[KEY][:, :1]
    heats = {}
    for word in ("fox", "snow"):
        heats[word] = word_map(maps, ids[:1], pipe.tokenizer(word).input_ids[1:-1])[0]
        expected = np.asarray(overlay(images[0], heats[word]))
        got = pixels(tmp / f"fox-attention-{word}.png")
        assert np.abs(got.astype(int) - expected).max() <= 1
        # where the map is hottest the overlay is reddest: red over green, against the image's own
        redness = got[..., 0].astype(int) - got[..., 1] - (pixels(tmp / "fox.png")[..., 0].astype(int)
                                                           - pixels(tmp / "fox.png")[..., 1])
        assert redness.mean() > 5
    fox, snow = (heats[w] / heats[w].max() for w in ("fox", "snow"))
    assert np.abs(fox - snow).max() > 1e-2  # two words, two maps


@pytest.mark.parametrize("args, expected", [
    (["--trajectory", "steps.gif"], "--trajectory steps.gif: give a file name ending in .webp"),
    (["--trajectory-sheet", "taken.png"], "--trajectory-sheet taken.png exists: sdflax never overwrites a file"),
    (["--trajectory", "nowhere/steps.webp"], "the folder nowhere does not exist"),
    (["--attention-maps", "fox,cat"], "--attention-maps fox,cat: cat not in the prompt"),
    (["--attention-maps", "fox,,snow"], "argument --attention-maps: expected comma-separated words"),
])
def test_bad_picture_flags_are_one_line(args, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken.png").write_bytes(b"")
    assert main([*ARGS, *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err, err
