"""Flax msgpack checkpoints as diffusers' own Flax classes wrote them (the `flax`/`bf16` revisions of old repos)."""

from __future__ import annotations

import warnings

from functools import partial

import jax
import numpy as np
import pytest
import torch
from builders import torch_unet, torch_vae

from sdflax import AutoencoderKL, UNet2DConditionModel
from sdflax.pipeline.runner import compiler_options

jit = partial(jax.jit, compiler_options=compiler_options())  # compiled as the pipelines compile them

# diffusers' Flax UNet always uses 32 groups whatever the config says, so these configs use 32 (as SD does).
UNET = dict(sample_size=8, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=4, norm_num_groups=32)
VAE = dict(block_out_channels=(32, 64), layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 2,
           up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=32, latent_channels=4, sample_size=16)


class ShapesOfParams:
    """A diffusers Flax model whose `init_weights` gives its params' shapes without drawing them."""

    def __init__(self, model):
        self.model = model

    def init_weights(self, rng):
        return jax.eval_shape(self.model.init_weights, rng)


def to_flax_msgpack(torch_model, flax_class, folder, monkeypatch):
    torch_model.save_pretrained(folder / "pt", safe_serialization=False)
    # diffusers' conversion from PyTorch draws the model's random weights, eagerly (one compile per operation), only
    # to read their names and shapes: it gets the shapes alone, and writes the same file.
    from diffusers.models import modeling_flax_utils

    convert = modeling_flax_utils.convert_pytorch_state_dict_to_flax
    monkeypatch.setattr(modeling_flax_utils, "convert_pytorch_state_dict_to_flax",
                        lambda state, model: convert(state, ShapesOfParams(model)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, params = flax_class.from_pretrained(folder / "pt", from_pt=True)
        model.save_pretrained(folder / "flax", params=params)
    assert (folder / "flax" / "diffusion_flax_model.msgpack").is_file()
    return folder / "flax"


def test_unet_from_diffusers_flax_msgpack(tmp_path, monkeypatch):
    from diffusers import FlaxUNet2DConditionModel

    theirs = torch_unet(UNET)
    folder = to_flax_msgpack(theirs, FlaxUNet2DConditionModel, tmp_path, monkeypatch)
    unet, params = UNet2DConditionModel.from_pretrained(folder)
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, 4, 8, 8), dtype=np.float32)
    context = rng.standard_normal((2, 77, 32), dtype=np.float32)
    t = np.array([3, 700])
    with torch.no_grad():
        expected = theirs(torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(context)).sample.numpy()
    np.testing.assert_allclose(jit(unet.apply)(params, sample, t, context), expected, rtol=1e-4, atol=1e-5)


def test_vae_from_diffusers_flax_msgpack(tmp_path, monkeypatch):
    from diffusers import FlaxAutoencoderKL

    theirs = torch_vae(VAE)
    vae, params = AutoencoderKL.from_pretrained(to_flax_msgpack(theirs, FlaxAutoencoderKL, tmp_path, monkeypatch))
    rng = np.random.default_rng(1)
    latents = rng.standard_normal((1, 4, 8, 8), dtype=np.float32)
    images = rng.uniform(-1, 1, (1, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        decoded = theirs.decode(torch.from_numpy(latents)).sample.numpy()
        mean = theirs.encode(torch.from_numpy(images)).latent_dist.mean.numpy()
    np.testing.assert_allclose(jit(partial(vae.apply, method="decode"))(params, latents), decoded, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(jit(partial(vae.apply, method="encode"))(params, images).mean, mean, rtol=1e-4, atol=1e-5)


def test_malicious_bin_is_refused_through_from_pretrained(tmp_path):
    import os
    import pickle
    import zipfile

    from sdflax.loading.files import UnsafeCheckpointError

    theirs = torch_vae(VAE)
    theirs.save_pretrained(tmp_path, safe_serialization=False)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    path = tmp_path / "diffusion_pytorch_model.bin"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"decoder.conv_in.weight": Exploit()}, protocol=2))
    with pytest.raises(UnsafeCheckpointError, match="system"):
        AutoencoderKL.from_pretrained(tmp_path)
    assert not marker.exists()
