"""ControlNetModel (Zhang et al. 2023) against diffusers' PyTorch ControlNetModel, on small random ControlNets made
from the SD 1.x, 2.x and SDXL-shaped test UNets, and the UNet fed its residuals."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
import torch
from builders import SD1, SD2, SDXL, torch_controlnet, torch_unet
from flax import traverse_util
from test_flax_msgpack import to_flax_msgpack
from test_unet_residuals import skip_shapes, xl_inputs

from sdflax import UNet2DConditionModel
from sdflax.models import ControlNetConfig, ControlNetModel

RTOL, ATOL = 1e-4, 1e-5  # float32 parity

# arch -> (UNet config, condition encoder channels, channel order): three condition scales (2, 4, 8), both orders.
CASES = {"sd1": (SD1["unet"], (8, 16, 16), "rgb"), "sd2": (SD2["unet"], (8, 16), "bgr"),
         "sdxl": (SDXL["unet"], (8, 8, 16, 16), "rgb")}


def inputs(cfg, scale, seed=0):
    """Batch-2 latents 16x10 (an odd downsampling: 16x10 -> 8x5 -> 4x3), a condition image `scale` times their size,
    7 text tokens, and SDXL's pooled embedding and size ids."""
    rng = np.random.default_rng(seed)
    added = xl_inputs(cfg, rng, 2) if cfg.get("addition_embed_type") else {}
    return dict(sample=rng.standard_normal((2, 4, 16, 10), dtype=np.float32), timesteps=np.array([999, 37]),
                encoder_hidden_states=rng.standard_normal((2, 7, cfg["cross_attention_dim"]), dtype=np.float32),
                controlnet_cond=rng.uniform(0, 1, (2, 3, 16 * scale, 10 * scale)).astype(np.float32), **added)


def torch_residuals(controlnet, x, conditioning_scale=1.0, guess_mode=False):
    added = {k: torch.from_numpy(x[k]) for k in ("text_embeds", "time_ids") if k in x} or None
    with torch.no_grad():
        down, mid = controlnet(torch.from_numpy(x["sample"]), torch.from_numpy(x["timesteps"]),
                               torch.from_numpy(x["encoder_hidden_states"]), torch.from_numpy(x["controlnet_cond"]),
                               conditioning_scale, added_cond_kwargs=added, guess_mode=guess_mode, return_dict=False)
    return [r.numpy() for r in down], mid.numpy()


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """diffusers' UNet and ControlNet, saved and loaded by sdflax, with one jitted apply each."""
    cfg, channels, order = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    theirs_unet = torch_unet(cfg)
    theirs = torch_controlnet(theirs_unet, channels, order)
    theirs_unet.save_pretrained(folder / "unet")
    theirs.save_pretrained(folder / "controlnet")
    unet, unet_params = UNet2DConditionModel.from_pretrained(folder / "unet")
    controlnet, params = ControlNetModel.from_pretrained(folder / "controlnet")
    return dict(arch=request.param, cfg=cfg, theirs_unet=theirs_unet, theirs=theirs, unet=unet,
                unet_params=unet_params, controlnet=controlnet, params=params,
                run=jax.jit(controlnet.apply, static_argnames="guess_mode"), x=inputs(cfg, 2 ** (len(channels) - 1)))


@pytest.mark.parametrize("conditioning_scale, guess_mode", [(1.0, False), (0.5, False), (0.5, True)])
def test_residuals_match_diffusers(case, conditioning_scale, guess_mode):
    x = case["x"]
    down, mid = case["run"](case["params"], **x, conditioning_scale=conditioning_scale, guess_mode=guess_mode)
    expected_down, expected_mid = torch_residuals(case["theirs"], x, conditioning_scale, guess_mode)
    down_shapes, mid_shape = skip_shapes(case["cfg"], 2, 16, 10)
    assert [r.shape for r in down] == down_shapes and mid.shape == mid_shape  # what the UNet takes
    for i, (ours, theirs) in enumerate(zip(down, expected_down, strict=True)):
        np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL, err_msg=f"down residual {i}")
        assert np.abs(theirs).max() > 0.01, f"down residual {i} is ~0: the test would mean nothing"
    np.testing.assert_allclose(mid, expected_mid, rtol=RTOL, atol=ATOL, err_msg="mid residual")
    assert np.abs(expected_mid).max() > 0.01


# SD 2.x's residuals differ from SD 1.x's only in count and shapes, which test_residuals_match_diffusers checks
# against what the UNet takes; its UNet compile (the slowest step here) is left out.
@pytest.mark.parametrize("case", ["sd1", "sdxl"], indirect=True)
def test_unet_fed_residuals_matches_diffusers(case):
    x = case["x"]
    down, mid = case["run"](case["params"], **x, conditioning_scale=0.8)
    theirs_down, theirs_mid = torch_residuals(case["theirs"], x, 0.8)
    added = {k: x[k] for k in ("text_embeds", "time_ids") if k in x}
    ours = jax.jit(case["unet"].apply)(case["unet_params"], x["sample"], x["timesteps"], x["encoder_hidden_states"],
                                       **added, down_block_additional_residuals=down, mid_block_additional_residual=mid)
    sample, t, context = (torch.from_numpy(x[k]) for k in ("sample", "timesteps", "encoder_hidden_states"))
    with torch.no_grad():
        expected = case["theirs_unet"](
            sample, t, context, added_cond_kwargs={k: torch.from_numpy(v) for k, v in added.items()} or None,
            down_block_additional_residuals=tuple(map(torch.from_numpy, theirs_down)),
            mid_block_additional_residual=torch.from_numpy(theirs_mid)).sample.numpy()
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=RTOL, atol=ATOL)


def test_from_unet_copies_the_encoder_and_zeroes_the_zero_convs(case):
    """The trainable copy starts as the UNet's encoder and the zero convolutions at zero, so the ControlNet first
    adds nothing (§3.1); config and copied weights as diffusers' from_unet makes them."""
    controlnet = ControlNetModel.from_unet(case["unet"], conditioning_embedding_out_channels=CASES[case["arch"]][1])
    loaded = case["controlnet"]
    assert controlnet.config == dataclasses.replace(loaded.config, controlnet_conditioning_channel_order="rgb")
    assert hash(controlnet.config) and (controlnet.dtype, controlnet.kernels) == (loaded.dtype, loaded.kernels)
    params = traverse_util.flatten_dict(controlnet.params_from_unet(case["unet_params"]))
    theirs = traverse_util.flatten_dict(case["params"])  # diffusers' from_unet copy, zero convs made random
    assert params.keys() == theirs.keys()
    for path, value in params.items():
        if path[0].startswith("controlnet_"):
            zero_conv = path[0] != "controlnet_cond_embedding" or path[1] == "conv_out"
            assert (np.abs(np.asarray(value)).max() == 0) == zero_conv, path  # the condition encoder's others random
        else:
            np.testing.assert_array_equal(value, theirs[path], err_msg="/".join(path))
    down, mid = case["run"](traverse_util.unflatten_dict(params), **case["x"], conditioning_scale=1.0, guess_mode=False)
    assert all(np.abs(np.asarray(r)).max() == 0 for r in (*down, mid))


# diffusers' Flax ControlNet always has 32 groups and a condition encoder of four levels (its init draws an image
# 8x the latents), so this one does too.
FLAX_UNET = dict(sample_size=8, layers_per_block=1, block_out_channels=(32, 64), norm_num_groups=32,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=4)


def test_bin_and_diffusers_flax_msgpack_load(tmp_path, monkeypatch):
    from diffusers import FlaxControlNetModel

    theirs = torch_controlnet(torch_unet(FLAX_UNET), (8, 8, 16, 16))
    to_flax_msgpack(theirs, FlaxControlNetModel, tmp_path, monkeypatch)  # tmp_path / "pt": .bin, tmp_path / "flax": msgpack
    x = inputs(FLAX_UNET, 8)
    expected_down, expected_mid = torch_residuals(theirs, x)
    run = None
    for folder in ("pt", "flax"):
        controlnet, params = ControlNetModel.from_pretrained(tmp_path / folder)
        run = run or jax.jit(controlnet.apply)
        down, mid = run(params, **x)
        for ours, expected in zip((*down, mid), (*expected_down, expected_mid), strict=True):
            np.testing.assert_allclose(ours, expected, rtol=RTOL, atol=ATOL, err_msg=folder)


def test_global_pool_conditions(tmp_path):
    """The shuffle ControlNet's spatially averaged residuals, given at full size (what the UNet adds is the same)."""
    from diffusers import ControlNetModel as TorchControlNet

    made = torch_controlnet(torch_unet(FLAX_UNET), (8, 16))
    theirs = TorchControlNet.from_config(made.config, global_pool_conditions=True).eval()
    theirs.load_state_dict(made.state_dict())
    theirs.save_pretrained(tmp_path)
    controlnet, params = ControlNetModel.from_pretrained(tmp_path)
    assert controlnet.config.global_pool_conditions
    x = inputs(FLAX_UNET, 2)
    down, mid = jax.jit(controlnet.apply, static_argnames="guess_mode")(params, **x, conditioning_scale=0.5,
                                                                       guess_mode=True)  # no log scale when pooled
    expected_down, expected_mid = torch_residuals(theirs, x, 0.5, guess_mode=True)
    for ours, expected in zip((*down, mid), (*expected_down, expected_mid), strict=True):
        assert expected.shape[2:] == (1, 1)
        np.testing.assert_allclose(ours, np.broadcast_to(expected, ours.shape), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("key, value, message", [
    ("controlnet_conditioning_channel_order", "rbg",
     "controlnet_conditioning_channel_order='rbg'; it is 'rgb' or 'bgr'"),
    ("mid_block_type", "UNetMidBlock2D", "mid_block_type='UNetMidBlock2D', which sdflax does not support"),
    ("down_block_types", ("CrossAttnDownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
     "down_block_types has 'AttnDownBlock2D'"),
    ("addition_embed_type", "text", "addition_embed_type='text'; sdflax supports only None and 'text_time'"),
    ("conditioning_embedding_out_channels", [], "conditioning_embedding_out_channels is empty"),
])
def test_unsupported_configs_are_refused(key, value, message):
    assert ControlNetConfig.from_dict(SD1["unet"]).conditioning_embedding_out_channels == (16, 32, 96, 256)
    with pytest.raises(ValueError, match=f"ControlNetConfig: .*{message}"):
        ControlNetConfig.from_dict({**SD1["unet"], key: value})


def test_condition_image_is_checked():
    controlnet = ControlNetModel.from_config({**SD1["unet"], "conditioning_embedding_out_channels": (8, 16, 16)})
    params = controlnet.param_shapes()
    x = inputs(SD1["unet"], 4)
    run = lambda **kwargs: jax.eval_shape(controlnet.apply, params, **{**x, **kwargs})  # noqa: E731
    assert run()[1].shape == (2, 64, 8, 5)
    with pytest.raises(ValueError, match=r"controlnet_cond \(2, 3, 32, 20\) encodes to 8x5, the latents are 16x10: "
                                         "the condition image is 4 times the latents' size"):
        run(controlnet_cond=np.zeros((2, 3, 32, 20), np.float32))
    with pytest.raises(ValueError, match="this ControlNet takes 3-channel images"):
        run(controlnet_cond=np.zeros((2, 1, 64, 40), np.float32))
    with pytest.raises(ValueError, match="this ControlNetModel's config has no addition_embed_type"):
        run(text_embeds=np.zeros((2, 8), np.float32), time_ids=np.zeros((2, 6), np.float32))


# ---- single files in the original layout (lllyasviel's cldm.py names) -------------------------------------------

def controlnet_to_ldm(state, config):
    """diffusers ControlNet names -> the original layout, written independently of sdflax/loading/single_file.py: the
    encoder as the UNet's (test_single_file.unet_to_ldm), zero convs, and the condition encoder's Sequential."""
    from test_single_file import unet_to_ldm

    blocks = 2 * (len(config["conditioning_embedding_out_channels"]) - 1)
    special = {"controlnet_mid_block": "middle_block_out.0", "controlnet_cond_embedding.conv_in": "input_hint_block.0",
               "controlnet_cond_embedding.conv_out": f"input_hint_block.{2 * blocks + 2}",
               "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}
    out, encoder = {}, {}
    for key, value in state.items():
        module, leaf = key.rsplit(".", 1)
        if module in special:
            out[f"{special[module]}.{leaf}"] = value
        elif m := re.fullmatch(r"controlnet_down_blocks\.(\d+)", module):
            out[f"zero_convs.{m[1]}.0.{leaf}"] = value
        elif m := re.fullmatch(r"controlnet_cond_embedding\.blocks\.(\d+)", module):
            out[f"input_hint_block.{2 * int(m[1]) + 2}.{leaf}"] = value
        else:
            encoder[key] = value
    ldm = unet_to_ldm(encoder, {**config, "up_block_types": ()})
    out.update({k.removeprefix("model.diffusion_model."): v for k, v in ldm.items()})
    return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def test_diffusers_converts_the_test_layout_back():
    """The oracle for controlnet_to_ldm: diffusers' own converter (which knows the standard 4-level condition
    encoder and no SDXL embedding) reads the file back to the net's state dict."""
    from diffusers.loaders.single_file_utils import convert_controlnet_checkpoint

    net = torch_controlnet(torch_unet(SD1["unet"]), channels=(16, 32, 96, 256))
    state = net.state_dict()
    ldm = controlnet_to_ldm(state, dict(net.config))
    converted = convert_controlnet_checkpoint({f"control_model.{k}": v for k, v in ldm.items()}, dict(net.config))
    assert converted.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(converted[key], value), key


def test_single_file_loads_the_params_from_pretrained_gives(case, tmp_path):
    from safetensors.torch import save_file

    from sdflax.loading import single_file

    folder = tmp_path / "diffusers"
    case["theirs"].save_pretrained(folder)
    ldm = controlnet_to_ldm(case["theirs"].state_dict(), dict(case["theirs"].config))
    save_file(ldm, tmp_path / "control.safetensors")
    # ControlNet 1.0 files: a whole SD model beside the net, which is under control_model.
    torch.save({**{f"control_model.{k}": v for k, v in ldm.items()},
                "model.diffusion_model.out.2.weight": torch.zeros(4, 4, 3, 3)}, tmp_path / "control.pth")
    for name in ("control.safetensors", "control.pth"):
        net, params = ControlNetModel.from_single_file(tmp_path / name, config=folder)
        assert net.config == case["controlnet"].config
        flat, expected = traverse_util.flatten_dict(params), traverse_util.flatten_dict(case["params"])
        assert flat.keys() == expected.keys()
        for path, value in expected.items():
            np.testing.assert_array_equal(flat[path], value, err_msg="/".join(path))
    with pytest.raises(single_file.SingleFileError, match="cannot tell the base model"):  # 32-wide test nets
        ControlNetModel.from_single_file(tmp_path / "control.safetensors")
    save_file({k: v.contiguous() for k, v in case["theirs"].state_dict().items()}, tmp_path / "diffusers.safetensors")
    with pytest.raises(single_file.SingleFileError, match="diffusers names: use ControlNetModel.from_pretrained"):
        ControlNetModel.from_single_file(tmp_path / "diffusers.safetensors")
    del ldm["zero_convs.0.0.bias"]
    ldm["zero_convs.99.0.bias"] = torch.zeros(1)
    save_file(ldm, tmp_path / "broken.safetensors")
    with pytest.raises(single_file.SingleFileError, match="zero_convs.99.0.bias"):
        ControlNetModel.from_single_file(tmp_path / "broken.safetensors", config=folder)


# diffusers configs of the published nets: lllyasviel/control_v11p_sd15_canny, thibaud/controlnet-sd21-canny-diffusers
PUBLISHED = {
    "sd1": {"cross_attention_dim": 768, "attention_head_dim": 8, "use_linear_projection": False},
    "sd2": {"cross_attention_dim": 1024, "attention_head_dim": [5, 10, 20, 20], "use_linear_projection": True},
}


@pytest.mark.parametrize("version", sorted(PUBLISHED))
def test_full_size_single_files_need_no_config(version):
    """The architecture of a full-size SD 1.x / 2.x net is read off its tensors: a diffusers net of the published
    config, built on the meta device and written in the original layout, maps onto exactly our params' names."""
    import diffusers

    from sdflax.loading import ldm_names, single_file

    config = {**PUBLISHED[version], "conditioning_embedding_out_channels": (16, 32, 96, 256)}
    with torch.device("meta"):
        theirs = diffusers.ControlNetModel(**config)
    state = {k: np.broadcast_to(np.zeros((), np.float16), tuple(v.shape)) for k, v in theirs.state_dict().items()}
    ldm = controlnet_to_ldm(state, dict(theirs.config))
    inferred = single_file.controlnet_config(ldm, "control.safetensors")
    ours = ControlNetModel.from_config(inferred)
    assert ours.config == ControlNetModel.from_config(dict(theirs.config)).config
    table = ldm_names.controlnet_table(ours.config)
    mapped = {ldm_names.map_key(k, table)[0] for k in ldm}
    assert mapped == set(state)
