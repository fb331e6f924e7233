"""The UNet's extra residuals (ControlNet's way in) against diffusers, and the block types its config may name."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from builders import SD1, SDXL, torch_unet

from sdflax import UNet2DConditionModel
from sdflax.models import UNetConfig

RTOL, ATOL = 1e-4, 1e-5  # float32 parity


def skip_shapes(cfg, batch, height, width):
    """NCHW shapes of diffusers' down_block_res_samples (conv_in, each down resnet, each downsampler) and of the
    mid block's output."""
    shapes = [(batch, cfg["block_out_channels"][0], height, width)]
    for i, channels in enumerate(cfg["block_out_channels"]):
        shapes += [(batch, channels, height, width)] * cfg["layers_per_block"]
        if i < len(cfg["block_out_channels"]) - 1:
            height, width = (height + 1) // 2, (width + 1) // 2  # 3x3, stride 2, padding 1
            shapes.append((batch, channels, height, width))
    return shapes, (batch, cfg["block_out_channels"][-1], height, width)


def xl_inputs(cfg, rng, batch):
    text_dim = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
    return {"text_embeds": rng.standard_normal((batch, text_dim), dtype=np.float32),
            "time_ids": np.array([[1024, 1024, 0, 0, 1024, 1024], [512, 768, 16, 32, 480, 640]], np.float32)}


@pytest.mark.parametrize("arch, height, width", [("sd1", 16, 16), ("sd1", 15, 10), ("sdxl", 16, 16)])
def test_additional_residuals_match_diffusers(arch, height, width, tmp_path):
    cfg = {"sd1": SD1, "sdxl": SDXL}[arch]["unet"]
    theirs = torch_unet(cfg)
    theirs.save_pretrained(tmp_path / "unet")
    unet, params = UNet2DConditionModel.from_pretrained(tmp_path / "unet")
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, 4, height, width), dtype=np.float32)
    context = rng.standard_normal((2, 77, cfg["cross_attention_dim"]), dtype=np.float32)
    t = np.array([999, 37])
    added = xl_inputs(cfg, rng, 2) if arch == "sdxl" else {}
    down_shapes, mid_shape = skip_shapes(cfg, 2, height, width)
    down = [rng.standard_normal(shape, dtype=np.float32) for shape in down_shapes]
    mid = rng.standard_normal(mid_shape, dtype=np.float32)

    apply = jax.jit(lambda params, down, mid: unet.apply(params, sample, t, context, **added,
                                                         down_block_additional_residuals=down,
                                                         mid_block_additional_residual=mid))
    ours = apply(params, down, mid)
    inputs = (torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(context))
    added_cond = {k: torch.from_numpy(v) for k, v in added.items()} or None
    with torch.no_grad():
        expected = theirs(*inputs, added_cond_kwargs=added_cond,
                          down_block_additional_residuals=tuple(torch.from_numpy(r) for r in down),
                          mid_block_additional_residual=torch.from_numpy(mid)).sample.numpy()
        without = theirs(*inputs, added_cond_kwargs=added_cond).sample.numpy()
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=RTOL, atol=ATOL)
    assert np.abs(expected - without).max() > 0.1 * np.abs(without).max()  # the residuals matter

    # Zero residuals change nothing; the mid one alone, or the last skip's alone, does (one program for all).
    zeros = [np.zeros_like(r) for r in down]
    plain = np.asarray(apply(params, zeros, np.zeros_like(mid)))
    np.testing.assert_allclose(plain, without, rtol=RTOL, atol=ATOL)
    for out in (apply(params, zeros, mid), apply(params, zeros[:-1] + down[-1:], np.zeros_like(mid))):
        assert not np.allclose(np.asarray(out), plain, rtol=RTOL, atol=ATOL)


def test_residuals_are_checked():
    cfg = SD1["unet"]
    unet = UNet2DConditionModel.from_config(cfg)
    params = unet.param_shapes()
    sample, t, context = np.zeros((1, 4, 16, 16), np.float32), 1, np.zeros((1, 77, 32), np.float32)
    down_shapes, mid_shape = skip_shapes(cfg, 1, 16, 16)
    down, mid = [np.zeros(s, np.float32) for s in down_shapes], np.zeros(mid_shape, np.float32)
    run = lambda **kwargs: jax.eval_shape(unet.apply, params, sample, t, context, **kwargs)  # noqa: E731

    assert run(down_block_additional_residuals=down, mid_block_additional_residual=mid).shape == sample.shape
    with pytest.raises(ValueError, match=rf"down_block_additional_residuals: expected {len(down)} arrays, one per "
                                         rf"skip connection, got {len(down) - 1}"):
        run(down_block_additional_residuals=down[:-1], mid_block_additional_residual=mid)
    wrong = down[:2] + [np.zeros((1, 32, 16, 16), np.float32)] + down[3:]  # the first downsampler's is 8x8
    with pytest.raises(ValueError, match=r"down_block_additional_residuals\[2\]: expected shape \(1, 32, 8, 8\), "
                                         r"got \(1, 32, 16, 16\)"):
        run(down_block_additional_residuals=wrong, mid_block_additional_residual=mid)
    with pytest.raises(ValueError, match=r"mid_block_additional_residual: expected shape \(1, 64, 8, 8\), got "
                                         r"\(1, 8, 64, 8\)"):
        run(down_block_additional_residuals=down, mid_block_additional_residual=mid.reshape(1, 8, 64, 8))
    with pytest.raises(ValueError, match="go together, as ControlNet gives them; got only one"):
        run(down_block_additional_residuals=down)


@pytest.mark.parametrize("key, value, message", [
    ("down_block_types", ("AttnDownBlock2D", "DownBlock2D"),
     "down_block_types has 'AttnDownBlock2D'; sdflax supports CrossAttnDownBlock2D, DownBlock2D"),
    ("up_block_types", ("UpBlock2D", "SimpleCrossAttnUpBlock2D"),
     "up_block_types has 'SimpleCrossAttnUpBlock2D'; sdflax supports CrossAttnUpBlock2D, UpBlock2D"),
    ("down_block_types", ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
     "3 down_block_types for 2 block_out_channels; give one per block"),
    ("mid_block_type", "UNetMidBlock2DSimpleCrossAttn",
     "mid_block_type='UNetMidBlock2DSimpleCrossAttn', which sdflax does not support "
     r"\(only 'UNetMidBlock2DCrossAttn'\)"),
])
def test_unknown_block_types_are_refused(key, value, message):
    assert UNetConfig.from_dict(SD1["unet"]).down_block_types == SD1["unet"]["down_block_types"]
    with pytest.raises(ValueError, match=f"UNetConfig: .*{message}"):
        UNetConfig.from_dict({**SD1["unet"], key: value})


def intrablock_shapes(cfg, batch, height, width):
    """NCHW shapes of a T2I-Adapter's features as diffusers' UNet adds them: each down block's output (a
    cross-attention block's before its downsampler, a plain block's after it)."""
    shapes = []
    for i, (kind, channels) in enumerate(zip(cfg["down_block_types"], cfg["block_out_channels"])):
        last = i == len(cfg["block_out_channels"]) - 1
        if kind == "DownBlock2D" and not last:
            height, width = (height + 1) // 2, (width + 1) // 2
        shapes.append((batch, channels, height, width))
        if kind != "DownBlock2D" and not last:
            height, width = (height + 1) // 2, (width + 1) // 2
    return shapes


@pytest.mark.parametrize("arch", ["sd1", "sdxl"])
def test_adapter_residuals_match_diffusers(arch, tmp_path):
    """T2I-Adapter's way in (`down_intrablock_additional_residuals`), with SDXL's extra feature for the mid block."""
    cfg = {"sd1": SD1, "sdxl": SDXL}[arch]["unet"]
    theirs = torch_unet(cfg)
    theirs.save_pretrained(tmp_path / "unet")
    unet, params = UNet2DConditionModel.from_pretrained(tmp_path / "unet")
    rng = np.random.default_rng(1)
    sample = rng.standard_normal((2, 4, 16, 16), dtype=np.float32)
    context = rng.standard_normal((2, 77, cfg["cross_attention_dim"]), dtype=np.float32)
    t = np.array([999, 37])
    added = xl_inputs(cfg, rng, 2) if arch == "sdxl" else {}
    shapes = intrablock_shapes(cfg, 2, 16, 16)
    if arch == "sdxl":
        shapes.append(skip_shapes(cfg, 2, 16, 16)[1])  # the mid block's
    features = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    ours = jax.jit(lambda params, f: unet.apply(params, sample, t, context, **added,
                                                down_intrablock_additional_residuals=f))(params, features)
    inputs = (torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(context))
    added_cond = {k: torch.from_numpy(v) for k, v in added.items()} or None
    with torch.no_grad():
        expected = theirs(*inputs, added_cond_kwargs=added_cond, down_intrablock_additional_residuals=[
            torch.from_numpy(f) for f in features]).sample.numpy()
        without = theirs(*inputs, added_cond_kwargs=added_cond).sample.numpy()
        last_only = theirs(*inputs, added_cond_kwargs=added_cond, down_intrablock_additional_residuals=[
            torch.from_numpy(f * (i == len(features) - 1)) for i, f in enumerate(features)]).sample.numpy()
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=RTOL, atol=ATOL)
    assert np.abs(expected - without).max() > 0.1 * np.abs(without).max()  # the features matter
    assert np.abs(last_only - without).max() > 1e-3  # the last one (SDXL: the mid block's) too
