"""SD 3.x ControlNets against diffusers (PyTorch), float32, on small random models saved with save_pretrained and
loaded by sdflax: SD3ControlNetModel in an InstantX-like shape (joint blocks, its own position table, zeros for
its pooled input) and an SD 3.5 Large-like one (single-stream blocks without text, the transformer's patch
embedding, the prompt's pooled embedding); the transformer's `block_controlnet_hidden_states`; and the pipelines
StableDiffusion3ControlNet (one net, two nets, a guidance window, a new scale without recompiling) and
StableDiffusion3ControlNetInpaint."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from test_mmdit import torch_transformer

from sdflax import SD3ControlNetModel, SD3Transformer2DModel

RTOL, ATOL = 1e-4, 1e-5  # float32 model parity

BASE = dict(sample_size=8, patch_size=2, in_channels=16, attention_head_dim=8, num_attention_heads=4,
            pooled_projection_dim=72, caption_projection_dim=32, out_channels=16)
NETS = {  # the two kinds of SD 3 ControlNet: InstantX's (SD 3 Medium) and Stability's (SD 3.5 Large)
    "instantx": dict(BASE, num_layers=2, joint_attention_dim=96, pos_embed_max_size=16),
    "sd35_large": dict(BASE, num_layers=2, joint_attention_dim=None, pos_embed_max_size=None, pos_embed_type=None,
                       use_pos_embed=False, force_zeros_for_pooled_projection=False),
}
# the denoiser the nets steer: 4 blocks, so that a 2-block net's samples go to blocks 0, 1 and 2 by the interval rule
TRANSFORMER = dict(BASE, num_layers=4, joint_attention_dim=96, pos_embed_max_size=16)


def torch_controlnet(config, seed=0):
    """diffusers' SD3ControlNetModel with random weights everywhere, its zero-initialised layers (pos_embed_input,
    controlnet_blocks) included, and a random position table (the checkpoint stores it)."""
    from diffusers import SD3ControlNetModel as Theirs

    torch.manual_seed(seed)
    model = Theirs(**config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("pos_embed_input", "controlnet_blocks")):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        if model.pos_embed is not None and model.pos_embed.pos_embed is not None:
            model.pos_embed.pos_embed.add_(0.5 * torch.randn(model.pos_embed.pos_embed.shape, generator=g))
    return model


def model_inputs(config, size=(8, 8), seed=0):
    """(hidden states, control latents, text states or None, pooled, timesteps): latents, or with
    use_pos_embed=False patch tokens, as diffusers' forward takes them."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    tokens = (size[0] // 2) * (size[1] // 2)
    hidden = normal(2, 16, *size) if config.get("use_pos_embed", True) else normal(2, tokens, 32)
    context = normal(2, 7, config["joint_attention_dim"]) if config["joint_attention_dim"] else None
    control = normal(2, 16 + config.get("extra_conditioning_channels", 0), *size)
    return hidden, control, context, normal(2, 72), np.array([999.0, 37.5], np.float32)


def theirs_samples(net, x, scale):
    hidden, control, context, pooled, t = (None if a is None else torch.from_numpy(a) for a in x)
    with torch.no_grad():
        return [s.numpy() for s in net(hidden, control, scale, context, pooled, t, return_dict=False)[0]]


@pytest.fixture(scope="module", params=sorted(NETS))
def net(request, tmp_path_factory):
    """(config, diffusers' net, ours loaded from the folder diffusers saved)."""
    config = NETS[request.param]
    theirs = torch_controlnet(config)
    folder = tmp_path_factory.mktemp(request.param) / "controlnet"
    theirs.save_pretrained(folder)
    return (config, theirs, *SD3ControlNetModel.from_pretrained(folder))


def test_model_matches_diffusers(net):
    """Every block's sample at two scales and two latent sizes (6x10: an off-centre crop of the position table)."""
    config, theirs, model, params = net
    apply = jax.jit(model.apply)
    for size, scale in (((8, 8), 1.0), ((6, 10), 0.7)):
        x = model_inputs(config, size)
        ours = apply(params, x[0], x[1], scale, *x[2:])
        expected = theirs_samples(theirs, x, scale)
        assert len(ours) == len(expected) == config["num_layers"]
        for a, b in zip(ours, expected):
            assert np.abs(b).max() > 1e-2  # not the zero output of an untrained net
            np.testing.assert_allclose(np.asarray(a), b, rtol=RTOL, atol=ATOL)


def test_transformer_adds_block_samples_by_the_interval_rule(tmp_path):
    """Two samples for four blocks: blocks 0 and 1 take the first, block 2 the second, the last none (diffusers'
    `int(i / (num_layers / len(samples)))` on blocks that keep a context stream), block 1 skipped (its sample is added still)."""
    theirs = torch_transformer(TRANSFORMER, seed=1)
    theirs.save_pretrained(tmp_path / "transformer")
    model, params = SD3Transformer2DModel.from_pretrained(tmp_path / "transformer")
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 16, 8, 8), dtype=np.float32), rng.standard_normal((2, 7, 96), dtype=np.float32),
         rng.standard_normal((2, 72), dtype=np.float32), np.array([999.0, 37.5], np.float32))
    samples = [rng.standard_normal((2, 16, 32), dtype=np.float32) for _ in range(2)]
    with torch.no_grad():
        expected = theirs(*(torch.from_numpy(a) for a in x[:3]), timestep=torch.from_numpy(x[3]),
                          block_controlnet_hidden_states=[torch.from_numpy(s) for s in samples],
                          skip_layers=[1]).sample.numpy()
        plain = theirs(*(torch.from_numpy(a) for a in x[:3]), timestep=torch.from_numpy(x[3]),
                       skip_layers=[1]).sample.numpy()
    assert np.abs(expected - plain).max() > 1e-2
    ours = jax.jit(model.apply, static_argnames="skip_layers")(params, *x, skip_layers=(1,),
                                                                block_controlnet_hidden_states=samples)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=RTOL, atol=ATOL)
