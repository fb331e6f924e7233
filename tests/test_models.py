"""Parity of sdflax's CLIP text encoder, UNet and VAE with diffusers / transformers (PyTorch), loaded from disk."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import pytest
import torch
from builders import BUILDERS, CONFIGS, torch_unet, torch_vae

import jax.numpy as jnp

from sdflax import AutoencoderKL, CLIPTextModel, UNet2DConditionModel
from sdflax.models import Kernels, layers, resolve_kernels
from sdflax.pipeline.runner import compiler_options
from sdflax.loading.weights import CheckpointMismatchError

RTOL, ATOL = 1e-4, 1e-5  # float32 parity, per module
jit = partial(jax.jit, compiler_options=compiler_options())  # compiled as the pipelines compile them
FORMATS = {"safetensors": True, "bin": False}


def save(model, folder, fmt):
    model.save_pretrained(folder, safe_serialization=FORMATS[fmt])
    return folder


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def torch_models(arch):
    return {name: build(CONFIGS[arch][name]) for name, build in BUILDERS.items()}


def assert_close(ours, theirs, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(ours, np.float32), theirs.detach().float().numpy(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_unet_matches_diffusers(torch_models, arch, fmt, tmp_path):
    theirs = torch_models["unet"]
    unet, params = UNet2DConditionModel.from_pretrained(save(theirs, tmp_path / "unet", fmt))
    cfg = CONFIGS[arch]["unet"]
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, 4, 16, 16), dtype=np.float32)
    context = rng.standard_normal((2, 77, cfg["cross_attention_dim"]), dtype=np.float32)
    apply = jit(unet.apply)
    for timesteps in ([1, 999], [500, 37]):
        t = np.array(timesteps)
        ours = apply(params, sample, t, context)
        with torch.no_grad():
            expected = theirs(torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(context)).sample
        assert ours.shape == (2, 4, 16, 16)
        assert_close(ours, expected)
    # a scalar timestep broadcasts over the batch, as in diffusers
    with torch.no_grad():
        expected = theirs(torch.from_numpy(sample), 250, torch.from_numpy(context)).sample
    assert_close(apply(params, sample, jnp.int32(250), context), expected)
    if fmt == "safetensors":
        # Sides that the UNet's downsampling does not divide: diffusers upsamples to each skip's size.
        odd = rng.standard_normal((1, 4, 15, 10), dtype=np.float32)
        with torch.no_grad():
            expected = theirs(torch.from_numpy(odd), 600, torch.from_numpy(context[:1])).sample
        assert_close(apply(params, odd, 600, context[:1]), expected)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_vae_matches_diffusers(torch_models, fmt, tmp_path):
    theirs = torch_models["vae"]
    vae, params = AutoencoderKL.from_pretrained(save(theirs, tmp_path / "vae", fmt))
    assert vae.config.scaling_factor == theirs.config.scaling_factor
    f = vae.config.scale_factor
    assert f == 2 ** (len(theirs.config.block_out_channels) - 1)
    rng = np.random.default_rng(1)
    latents = rng.standard_normal((2, 4, 8, 8), dtype=np.float32)
    images = rng.uniform(-1, 1, (2, 3, 8 * f, 8 * f)).astype(np.float32)
    with torch.no_grad():
        decoded = theirs.decode(torch.from_numpy(latents)).sample
        posterior = theirs.encode(torch.from_numpy(images)).latent_dist
    assert_close(jit(partial(vae.apply, method="decode"))(params, latents), decoded)
    ours = jit(partial(vae.apply, method="encode"))(params, images)
    assert_close(ours.mean, posterior.mean)
    assert_close(ours.logvar, posterior.logvar, atol=1e-4)  # logvar = log(std²) amplifies the mean's rounding
    # sample(key) = mean + std * N(0, 1): reproducible, and its spread is the posterior's std
    key = jax.random.key(0)
    draw = ours.sample(key)
    np.testing.assert_array_equal(draw, ours.sample(key))
    noise = (draw - ours.mean) / ours.std
    assert abs(float(noise.std()) - 1.0) < 0.1


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_text_encoder_matches_transformers(torch_models, arch, fmt, tmp_path):
    theirs = torch_models["text_encoder"]
    clip, params = CLIPTextModel.from_pretrained(save(theirs, tmp_path / "text_encoder", fmt))
    cfg = CONFIGS[arch]["text_encoder"]
    ids = np.full((2, 77), cfg["pad_token_id"], np.int64)
    ids[0, :6] = [49406, 5, 17, 30000, 42, 49407]  # SD 1.x pads with the end token, SD 2.x with "!" (0)
    ids[1, :3] = [49406, 7, 49407]
    with torch.no_grad():
        expected = theirs(torch.from_numpy(ids), output_hidden_states=True)
    ours = jit(partial(clip.apply, output_hidden_states=True))(params, ids)
    assert_close(ours.last_hidden_state, expected.last_hidden_state)
    assert_close(ours.pooler_output, expected.pooler_output)
    assert len(ours.hidden_states) == cfg["num_hidden_layers"] + 1
    for mine, theirs_h in zip(ours.hidden_states, expected.hidden_states):
        assert_close(mine, theirs_h)


def test_bfloat16_load_stays_close_to_float32(tmp_path):
    theirs = torch_unet(CONFIGS["sd1"]["unet"])
    folder = save(theirs, tmp_path / "unet", "safetensors")
    unet32, params32 = UNet2DConditionModel.from_pretrained(folder)
    unet16, params16 = UNet2DConditionModel.from_pretrained(folder, dtype=jnp.bfloat16)
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params16))
    rng = np.random.default_rng(2)
    # the shapes of test_unet_matches_diffusers' scalar-timestep call: the float32 program is the one compiled there
    sample = rng.standard_normal((2, 4, 16, 16), dtype=np.float32)
    context = rng.standard_normal((2, 77, 32), dtype=np.float32)
    full = np.asarray(jit(unet32.apply)(params32, sample, jnp.int32(10), context))
    half = jit(unet16.apply)(params16, sample, jnp.int32(10), context)
    assert half.dtype == jnp.bfloat16
    # bfloat16 keeps 8 mantissa bits: the output may move by a few percent of its scale, not more.
    err = np.abs(np.asarray(half, np.float32) - full).max() / np.abs(full).max()
    assert err < 0.05, err


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save(torch_vae(CONFIGS["sd1"]["vae"]), tmp_path / "vae", "safetensors")
    path = folder / "diffusion_pytorch_model.safetensors"
    original = load_file(path)

    tensors = dict(original)
    del tensors["decoder.conv_out.bias"]
    save_file(tensors, path)
    with pytest.raises(CheckpointMismatchError, match=r"missing.*decoder/conv_out/bias"):
        AutoencoderKL.from_pretrained(folder)

    tensors = dict(original)
    tensors["encoder.conv_in.weight"] = torch.zeros(16, 3, 5, 5)
    save_file(tensors, path)
    with pytest.raises(CheckpointMismatchError, match=r"encoder\.conv_in\.weight: checkpoint \(16, 3, 5, 5\)"):
        AutoencoderKL.from_pretrained(folder)

    tensors = dict(original)
    tensors["decoder.extra_layer.weight"] = torch.zeros(3)
    save_file(tensors, path)
    with pytest.raises(CheckpointMismatchError, match=r"not used by the model: decoder\.extra_layer\.weight"):
        AutoencoderKL.from_pretrained(folder)


def test_missing_weights_file_is_reported(tmp_path):
    folder = save(torch_vae(CONFIGS["sd1"]["vae"]), tmp_path / "vae", "safetensors")
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in .*diffusion_pytorch_model.safetensors"):
        AutoencoderKL.from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        AutoencoderKL.from_pretrained(tmp_path)


def test_models_take_one_kernels_value():
    """from_config resolves the kernels once, or takes them, and each model hands them to its attention."""
    xla = resolve_kernels("xla")
    for cls, name in ((CLIPTextModel, "text_encoder"), (UNet2DConditionModel, "unet"), (AutoencoderKL, "vae")):
        config = CONFIGS["sd1"][name]
        assert cls.from_config(config).kernels == resolve_kernels()
        assert cls.from_config(config, attention="xla").kernels == xla == cls.from_config(config, kernels=xla).kernels
        with pytest.raises(ValueError, match="give the choice in one place"):
            cls.from_config(config, attention="cudnn", kernels=xla)
        with pytest.raises(ValueError, match="attention='cudnn': cuDNN flash attention does not run on cpu"):
            cls.from_config(config, attention="cudnn").param_shapes()


def test_unet_paths_follow_its_kernels(monkeypatch):
    """The Kernels platform reaches every layer: the UNet built for a GPU, compiled here, runs its 256-token
    self-attention in one piece (no CPU loop over heads and query blocks, here made to run by a small block) and
    every 3x3 conv as a convolution, with the same numbers."""
    monkeypatch.setattr(layers, "CPU_ATTENTION_BLOCK_BYTES", 100_000)  # 256 x 256 logits: 262 kB a head
    monkeypatch.setattr(layers, "CPU_PATCH_MATMUL_MIN_CHANNELS", 0)  # its narrow 4x4 convs as patch matmuls here
    unet = UNet2DConditionModel.from_config(CONFIGS["sd1"]["unet"])
    gpu = unet.clone(kernels=Kernels("gpu", "9.0"))
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda p: 0.2 * rng.standard_normal(p.shape, dtype=np.float32), unet.param_shapes())
    inputs = (rng.standard_normal((1, 4, 16, 16), dtype=np.float32), np.array([10]),
              rng.standard_normal((1, 77, 32), dtype=np.float32))
    here, there = (jax.jit(m.apply).lower(params, *inputs).compile() for m in (unet, gpu))
    assert "while" in here.as_text() and "while" not in there.as_text()
    assert there.as_text().count("convolution(") > here.as_text().count("convolution(")
    np.testing.assert_allclose(there(params, *inputs), here(params, *inputs), rtol=RTOL, atol=ATOL)


def test_sd3_vae_matches_diffusers(tmp_path):
    """SD 3.x's VAE: 16 latent channels, no quant convs, and latents shifted before scaling (the pipelines' VAE
    piece applies `shift_factor` as diffusers' SD 3 pipelines do)."""
    from sdflax.pipeline.vae import VAE

    config = {**CONFIGS["sd1"]["vae"], "latent_channels": 16, "use_quant_conv": False, "use_post_quant_conv": False,
              "shift_factor": 0.0609, "scaling_factor": 1.5305}
    theirs = torch_vae(config)
    vae, params = AutoencoderKL.from_pretrained(save(theirs, tmp_path / "vae", "safetensors"))
    assert (vae.config.shift_factor, vae.config.latent_channels, vae.config.use_quant_conv) == (0.0609, 16, False)
    rng = np.random.default_rng(2)
    latents = rng.standard_normal((1, 16, 8, 8), dtype=np.float32)
    images = rng.uniform(-1, 1, (1, 3, 8 * vae.config.scale_factor, 8 * vae.config.scale_factor)).astype(np.float32)
    with torch.no_grad():
        decoded = theirs.decode(torch.from_numpy(latents) / 1.5305 + 0.0609).sample
        mean = theirs.encode(torch.from_numpy(images)).latent_dist.mean
    piece = VAE(vae)
    ours = jit(piece.decode)({"vae": params}, latents)  # (B, H, W, 3) in [0, 1]
    assert_close(ours, (decoded.clamp(-1, 1) / 2 + 0.5).permute(0, 2, 3, 1))
    encoded = jit(piece.encode)({"vae": params}, images, np.zeros_like(latents))  # the mean: eps = 0
    assert_close(encoded, (mean - 0.0609) * 1.5305)
