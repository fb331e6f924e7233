"""SD3Transformer2DModel (the MMDiT of SD 3 and 3.5) against diffusers' PyTorch model, saved with save_pretrained and
loaded by sdflax: SD 3, SD 3.5 Medium (qk RMSNorm, a dual-attention block) and SD 3.5 Large (qk RMSNorm) shapes."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import pytest
import torch

from sdflax import SD3Transformer2DModel
from sdflax.hooks.core import intercept
from sdflax.models.config import ConfigError
from sdflax.models.mmdit import SD3TransformerConfig, sincos_position_table

RTOL, ATOL = 1e-4, 1e-5  # float32 parity

BASE = dict(sample_size=8, patch_size=2, attention_head_dim=8, joint_attention_dim=24, pooled_projection_dim=16,
            pos_embed_max_size=16)
CONFIGS = {
    "sd3": dict(BASE, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2, caption_projection_dim=16),
    "sd35_medium": dict(BASE, in_channels=16, out_channels=16, num_layers=3, num_attention_heads=3,
                        caption_projection_dim=24, qk_norm="rms_norm", dual_attention_layers=(0,)),
    "sd35_large": dict(BASE, in_channels=16, out_channels=16, num_layers=2, num_attention_heads=4,
                       caption_projection_dim=32, qk_norm="rms_norm"),
}
# Latent sizes: 8x8 and 6x10 are 4x4 and 3x5 patches, cropped from the 16x16 position table (off-centre for 3x5).
SIZES = [(8, 8), (6, 10)]


def torch_transformer(config, seed=0):
    """diffusers' model with random weights, RMSNorm scales and position table (the checkpoint stores the table,
    so the crop is tested on values that are not smooth)."""
    from diffusers import SD3Transformer2DModel as Theirs
    from diffusers.models.normalization import RMSNorm

    torch.manual_seed(seed)
    model = Theirs(**config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (RMSNorm, torch.nn.LayerNorm)) and m.weight is not None:
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
        model.pos_embed.pos_embed.add_(0.5 * torch.randn(model.pos_embed.pos_embed.shape, generator=g))
    return model


def inputs(config, size, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, config["in_channels"], *size), dtype=np.float32),
            rng.standard_normal((2, 7, config["joint_attention_dim"]), dtype=np.float32),
            rng.standard_normal((2, config["pooled_projection_dim"]), dtype=np.float32),
            np.array([999.0, 37.5], np.float32))


def theirs_output(model, x, **kwargs):
    with torch.no_grad():
        return model(*(torch.from_numpy(a) for a in x[:3]), timestep=torch.from_numpy(x[3]), **kwargs).sample.numpy()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def loaded(request, tmp_path_factory):
    config = CONFIGS[request.param]
    theirs = torch_transformer(config)
    folder = tmp_path_factory.mktemp(request.param) / "transformer"
    theirs.save_pretrained(folder)
    model, params = SD3Transformer2DModel.from_pretrained(folder)
    return config, theirs, model, params


def test_matches_diffusers(loaded):
    config, theirs, model, params = loaded
    apply = jax.jit(model.apply)
    for size in SIZES:
        x = inputs(config, size)
        ours = apply(params, *x)
        assert ours.shape == (2, config["out_channels"], *size)
        np.testing.assert_allclose(np.asarray(ours), theirs_output(theirs, x), rtol=RTOL, atol=ATOL)


def test_skip_layers_as_diffusers(loaded):
    config, theirs, model, params = loaded
    x = inputs(config, SIZES[1], seed=1)
    ours = jax.jit(partial(model.apply, skip_layers=(0,)))(params, *x)
    np.testing.assert_allclose(np.asarray(ours), theirs_output(theirs, x, skip_layers=[0]), rtol=RTOL, atol=ATOL)


def test_attention_layers_are_hook_sites():
    config = CONFIGS["sd35_medium"]
    model = SD3Transformer2DModel.from_config(config)
    params = jax.eval_shape(model.init_params, jax.random.key(0))
    sites = set()
    with intercept([], step=0, chunks=1, sites=sites):
        jax.eval_shape(model.apply, params, *inputs(config, (4, 4)))
    assert sites == {"transformer_blocks.0.attn", "transformer_blocks.0.attn2", "transformer_blocks.1.attn",
                     "transformer_blocks.2.attn"}


def test_position_table_as_diffusers():
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    for dim, grid, base in ((16, 16, 4), (24, 12, 6), (64, 96, 64)):
        expected = get_2d_sincos_pos_embed(dim, grid, base_size=base, output_type="pt").float().numpy()
        np.testing.assert_allclose(sincos_position_table(dim, grid, base), expected, rtol=1e-6, atol=1e-6)


def test_bad_configs_fail_in_one_line():
    cases = [(dict(qk_norm="layer_norm"), "qk_norm"), (dict(caption_projection_dim=20), "caption_projection_dim"),
             (dict(dual_attention_layers=[2]), "dual_attention_layers"),
             (dict(pos_embed_max_size=None), "pos_embed_max_size")]
    for change, key in cases:
        with pytest.raises(ConfigError, match=key):
            SD3TransformerConfig.from_dict({**CONFIGS["sd3"], **change})
    assert SD3TransformerConfig.from_dict({**CONFIGS["sd3"], "out_channels": None}).out_channels == 4


def test_latents_too_large_or_odd_fail():
    model = SD3Transformer2DModel.from_config(CONFIGS["sd3"])
    params = jax.eval_shape(model.init_params, jax.random.key(0))
    for size, message in (((34, 8), "pos_embed_max_size"), ((7, 8), "multiples of patch_size")):
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(model.apply, params, *inputs(CONFIGS["sd3"], size))
