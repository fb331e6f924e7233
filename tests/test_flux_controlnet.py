"""Flux.1 ControlNets against diffusers (PyTorch), float32, on small random models: FluxControlNetModel (plain, Union
with `num_mode`, XLabs' `input_hint_block`) and the transformer taking its residuals, loaded from folders saved with
save_pretrained; the pipelines FluxControlNet (one net, two nets, a Union net with two modes, a window, a scale)
and FluxControl (Canny / Depth dev: the control picture's latents beside the latents) against FluxControlNetPipeline
and FluxControlPipeline; jit, pmap and the sharded path agree."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from test_flux_model import inputs as transformer_inputs
from test_flux_model import theirs_output
from test_flux_pipeline import (PROMPTS, SIZE, STEPS, T5_LENGTH, TRANSFORMER, check_images, latents_for, moves,
                                randomized, theirs_images, torch_flux_pipeline, torch_flux_transformer)
from test_sd3_pipeline import patch_draws, pictures_and_masks

import sdflax
from sdflax.families.flux_control import control_draws
from sdflax.models.flux import FluxTransformer2DModel

RTOL = 1e-4  # float32 models, of the output's largest magnitude
MOVES = 1e-2

CONTROLNETS = {  # two double blocks over the transformer's two (one each), one single over its two (the interval rule)
    "plain": dict(num_layers=2, num_single_layers=1),
    "union": dict(num_layers=1, num_single_layers=0, num_mode=3),  # no single blocks: None single samples
    "xlabs": dict(num_layers=1, num_single_layers=0, conditioning_embedding_channels=16, patch_size=2),
}


def torch_controlnet(seed, **config):
    from diffusers import FluxControlNetModel

    torch.manual_seed(seed)
    return randomized(FluxControlNetModel(**{**TRANSFORMER, "guidance_embeds": True, **config}).eval())


def assert_close(ours, expected):
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=0, atol=RTOL * np.abs(expected).max())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: (diffusers' net, ours, our params)} of each net saved and loaded, and the transformer's."""
    tmp = tmp_path_factory.mktemp("flux_controlnets")
    loaded = {"transformer": (torch_flux_transformer(2, guidance_embeds=True), FluxTransformer2DModel)}  # the dev pipeline's
    loaded.update({name: (torch_controlnet(seed, **config), sdflax.FluxControlNetModel)
                   for seed, (name, config) in enumerate(CONTROLNETS.items(), 10)})
    out = {}
    for name, (theirs, cls) in loaded.items():
        theirs.save_pretrained(tmp / name)
        out[name] = (theirs, *cls.from_pretrained(tmp / name))
    return out


def net_inputs(config, mode=None, seed=0):
    """The transformer's inputs (a 4x4 grid of tokens, text of 5) and a control picture: packed latents, or XLabs'
    pixels (B, 3, 64, 64)."""
    x, context, pooled, t, img_ids, txt_ids, guidance = transformer_inputs({**config, "guidance_embeds": True}, seed)
    rng = np.random.default_rng(seed + 1)
    if config.get("conditioning_embedding_channels"):
        cond = rng.uniform(-1, 1, (2, 3, 8 * 2 * 3, 8 * 2 * 4)).astype(np.float32)  # the 3x4 grid's pixels
    else:
        cond = rng.standard_normal(x.shape, dtype=np.float32)
    return x, cond, mode, context, pooled, t, img_ids, txt_ids, guidance


def theirs_samples(net, args, scale):
    x, cond, mode, context, pooled, t, img_ids, txt_ids, guidance = (None if a is None else torch.from_numpy(
        np.asarray(a)) for a in args)
    with torch.no_grad():
        return net(hidden_states=x, controlnet_cond=cond, controlnet_mode=mode, conditioning_scale=scale,
                   encoder_hidden_states=context, pooled_projections=pooled, timestep=t, img_ids=img_ids,
                   txt_ids=txt_ids, guidance=guidance, return_dict=False)


@pytest.mark.parametrize("name", sorted(CONTROLNETS))
def test_controlnet_and_transformer_match_diffusers(models, name):
    """Each net's samples times a scale, and the transformer given them (the interval rule; XLabs' repeated),
    equal diffusers'; a Union net's mode and every net's residuals move the output."""
    theirs, net, params = models[name]
    theirs_transformer, transformer, transformer_params = models["transformer"]
    config = {**TRANSFORMER, **CONTROLNETS[name]}
    modes = (np.array([[0], [2]]), np.array([[1], [1]])) if "num_mode" in config else (None,)
    repeat = "conditioning_embedding_channels" in config
    firsts = []
    for mode in modes:
        args = net_inputs(config, mode)
        expected = theirs_samples(theirs, args, 0.7)
        firsts.append(expected[0][0].numpy())
        x, cond, _, context, pooled, t, img_ids, txt_ids, guidance = args
        ours = jax.jit(net.apply)(params, x, cond, None if mode is None else mode[:, 0], 0.7, context, pooled, t, img_ids,
                         txt_ids, guidance)
        for ours_kind, theirs_kind in zip(ours, expected):
            assert (ours_kind is None) == (theirs_kind is None)
            for a, b in zip(ours_kind or (), theirs_kind or ()):
                assert_close(a, b.numpy())
        with torch.no_grad():
            controlled = theirs_transformer(
                *(torch.from_numpy(np.asarray(a)) for a in (x, context, pooled, t, img_ids, txt_ids, guidance)),
                controlnet_block_samples=expected[0], controlnet_single_block_samples=expected[1],
                controlnet_blocks_repeat=repeat).sample.numpy()
        plain = theirs_output(theirs_transformer, (x, context, pooled, t, img_ids, txt_ids, guidance))
        assert np.abs(controlled - plain).max() > MOVES
        assert_close(jax.jit(transformer.apply, static_argnames="controlnet_blocks_repeat")(transformer_params, x, context, pooled, t, img_ids, txt_ids, guidance,
                                       *ours, controlnet_blocks_repeat=repeat), controlled)
    if len(modes) == 2:  # the mode matters
        assert np.abs(firsts[1] - firsts[0]).max() > MOVES


def test_a_union_net_needs_its_mode(models):
    _, net, params = models["union"]
    x, cond, _, context, pooled, t, img_ids, txt_ids, guidance = net_inputs({**TRANSFORMER, **CONTROLNETS["union"]})
    with pytest.raises(ValueError, match=r"controlnet_mode=None: this is a Union ControlNet \(num_mode=3\)"):
        net.apply(params, x, cond, None, 1.0, context, pooled, t, img_ids, txt_ids, guidance)


# ---- pipelines ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipes(models, tmp_path_factory):
    """(diffusers' dev FluxPipeline, our FluxControlNet of the plain net, params), the dev folder saved once."""
    folder = tmp_path_factory.mktemp("flux_dev")
    theirs = torch_flux_pipeline(folder)
    theirs.transformer = models["transformer"][0]
    theirs.save_pretrained(folder / "dev", safe_serialization=True)
    _, net, net_params = models["plain"]
    pipe, params = sdflax.FluxControlNet.from_pretrained(folder / "dev", controlnet=net)
    params["controlnet"] = net_params
    return folder / "dev", theirs, pipe, params


def theirs_controlnet_images(theirs, nets, pictures, monkeypatch, key, **kwargs):
    """diffusers' FluxControlNetPipeline with `nets` (a list: its Multi model), its posterior draws ours."""
    import diffusers.pipelines.flux.pipeline_flux_controlnet as module
    from diffusers import FluxControlNetPipeline, FluxMultiControlNetModel

    count = len(pictures) if isinstance(pictures[0], list) else 1
    posterior = control_draws(key, (2, 16, SIZE // 8, SIZE // 8), count)
    controlnet = FluxMultiControlNetModel(nets) if isinstance(nets, list) else nets
    patch_draws(monkeypatch, module, list(posterior), latents_for())
    pipeline = FluxControlNetPipeline(**{**theirs.components, "controlnet": controlnet})
    return theirs_images(pipeline, control_image=pictures, **kwargs)


def control_pictures(seed=0):
    return pictures_and_masks(seed=seed)[0]


def ours_controlnet_images(pipe, params, ids, control, key, **kwargs):
    return pipe(ids, control, params, key, num_inference_steps=STEPS, height=SIZE, width=SIZE, latents=latents_for(),
                **kwargs).images


def test_one_net_matches_diffusers_scale_and_window_traced(pipes, models, monkeypatch):
    """One plain net (two double blocks, one single block over the transformer's two): a scale and a guidance
    window that each move diffusers' image, ours equal to it, neither recompiling."""
    _, theirs, pipe, params = pipes
    net = models["plain"][0]
    pictures, key = control_pictures(), jax.random.PRNGKey(1)
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    control = pipe.prepare_image_inputs(pictures)
    previous, compiles = theirs_images(theirs, guidance_scale=3.5), None
    for settings in (dict(controlnet_conditioning_scale=0.7), dict(controlnet_conditioning_scale=1.3),
                     dict(controlnet_conditioning_scale=1.3, control_guidance_end=0.5)):
        expected = theirs_controlnet_images(theirs, net, pictures, monkeypatch, key, guidance_scale=3.5, **settings)
        assert moves(expected, previous)  # the net, then the scale, then the window
        check_images(ours_controlnet_images(pipe, params, ids, control, key, guidance_scale=3.5, **settings),
                     expected)
        compiles = compiles or pipe._jitted._cache_size()
        assert pipe._jitted._cache_size() == compiles
        previous = expected
