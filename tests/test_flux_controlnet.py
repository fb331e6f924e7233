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
from test_flux_pipeline import (NEGATIVE, PROMPTS, SIZE, STEPS, T5_LENGTH, TRANSFORMER, check_images, latents_for,
                                moves, randomized, theirs_images, torch_flux_pipeline, torch_flux_transformer)
from test_sd3_pipeline import patch_draws, pictures_and_masks

import sdflax
from sdflax import random_draws, replicate, shard, unshard
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
    # the dev pipeline's transformer, and the nets
    loaded = {"transformer": (torch_flux_transformer(2, guidance_embeds=True), FluxTransformer2DModel)}
    loaded.update({name: (torch_controlnet(seed, **config), sdflax.FluxControlNetModel)
                   for seed, (name, config) in enumerate(CONTROLNETS.items(), 10)})
    out = {"folder": tmp}
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


@pytest.mark.parametrize("name", ["plain", "union"])  # XLabs' net: test_xlabs_net_matches_diffusers
def test_controlnet_and_transformer_match_diffusers(models, name):
    """Each net's samples times a scale, and the transformer given them (the interval rule), equal diffusers'; a
    Union net's mode and every net's residuals move the output."""
    theirs, net, params = models[name]
    theirs_transformer, transformer, transformer_params = models["transformer"]
    config = {**TRANSFORMER, **CONTROLNETS[name]}
    modes = (np.array([[0], [2]]), np.array([[1], [1]])) if "num_mode" in config else (None,)
    firsts = []
    for mode in modes:
        args = net_inputs(config, mode)
        expected = theirs_samples(theirs, args, 0.7)
        firsts.append(expected[0][0].numpy())
        x, cond, _, context, pooled, t, img_ids, txt_ids, guidance = args
        ours = jax.jit(net.apply)(params, x, cond, None if mode is None else mode[:, 0], 0.7, context, pooled, t,
                                  img_ids, txt_ids, guidance)
        for ours_kind, theirs_kind in zip(ours, expected):
            assert (ours_kind is None) == (theirs_kind is None)
            for a, b in zip(ours_kind or (), theirs_kind or ()):
                assert_close(a, b.numpy())
        with torch.no_grad():
            controlled = theirs_transformer(
                *(torch.from_numpy(np.asarray(a)) for a in (x, context, pooled, t, img_ids, txt_ids, guidance)),
                controlnet_block_samples=expected[0], controlnet_single_block_samples=expected[1]).sample.numpy()
        plain = theirs_output(theirs_transformer, (x, context, pooled, t, img_ids, txt_ids, guidance))
        assert np.abs(controlled - plain).max() > MOVES
        assert_close(jax.jit(transformer.apply)(transformer_params, x, context, pooled, t, img_ids, txt_ids,
                                                guidance, *ours), controlled)
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
    previous, compiles = None, None
    for settings in (dict(controlnet_conditioning_scale=0.7), dict(controlnet_conditioning_scale=1.3),
                     dict(controlnet_conditioning_scale=1.3, control_guidance_end=0.5)):
        expected = theirs_controlnet_images(theirs, net, pictures, monkeypatch, key, guidance_scale=3.5, **settings)
        assert previous is None or moves(expected, previous)  # the scale, then the window
        check_images(ours_controlnet_images(pipe, params, ids, control, key, guidance_scale=3.5, **settings),
                     expected)
        compiles = compiles or pipe._jitted._cache_size()
        assert pipe._jitted._cache_size() == compiles
        previous = expected


def with_nets(pipes, models, names):
    """Our FluxControlNet of the dev checkpoint with the nets `names` (a list: several) and its params."""
    _, _, pipe, params = pipes
    nets = [models[name][1] for name in names]
    return pipe.replace(controlnet=nets), {**params, "controlnet": [models[name][2] for name in names]}


def test_two_nets_and_a_union_net_match_diffusers(pipes, models, monkeypatch):
    """Two nets (diffusers' FluxMultiControlNetModel: a plain net and a Union net, each its picture and scale), and a
    Union net alone at two modes, which give different images; the mode is traced."""
    _, theirs, pipe, params = pipes
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    pictures, others, key = control_pictures(), control_pictures(seed=1), jax.random.PRNGKey(2)
    both, both_params = with_nets(pipes, models, ["plain", "union"])
    settings = dict(guidance_scale=3.5, controlnet_conditioning_scale=[0.6, 0.9])
    expected = theirs_controlnet_images(theirs, [models["plain"][0], models["union"][0]], [pictures, others],
                                        monkeypatch, key, control_mode=[None, 1], **settings)
    control = [both.prepare_image_inputs(p) for p in (pictures, others)]
    check_images(ours_controlnet_images(both, both_params, ids, control, key, control_mode=[None, 1], **settings),
                 expected)

    union, union_params = with_nets(pipes, models, ["union"])
    by_mode = {mode: theirs_controlnet_images(theirs, models["union"][0], others, monkeypatch, key, control_mode=mode,
                                              guidance_scale=3.5) for mode in (0, 2)}
    assert moves(by_mode[0], by_mode[2])
    for mode, expected in by_mode.items():
        check_images(ours_controlnet_images(union, union_params, ids, control[1], key, control_mode=mode,
                                            guidance_scale=3.5), expected)
    assert union._jitted._cache_size() == 1


def test_xlabs_net_matches_diffusers(pipes, models, monkeypatch):
    """XLabs' net reads the picture through its input_hint_block (no VAE draw) and its one double block's residual
    is repeated over the transformer's blocks; true CFG with a negative prompt gives the negative's rows the
    prompt's residuals, as diffusers."""
    _, theirs, pipe, params = pipes
    xlabs, xlabs_params = with_nets(pipes, models, ["xlabs"])
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs(NEGATIVE, max_sequence_length=T5_LENGTH)
    pictures = control_pictures(seed=2)
    expected = theirs_controlnet_images(theirs, models["xlabs"][0], pictures, monkeypatch, jax.random.PRNGKey(0),
                                        guidance_scale=3.5, true_cfg_scale=3.0, negative_prompt=NEGATIVE)
    control = xlabs.prepare_image_inputs(pictures)
    settings = dict(guidance_scale=3.5, true_cfg_scale=3.0, neg_prompt_ids=neg)
    check_images(ours_controlnet_images(xlabs, xlabs_params, ids, control, jax.random.PRNGKey(0), **settings),
                 expected)
    without = ours_controlnet_images(xlabs, xlabs_params, ids, control, jax.random.PRNGKey(0),
                                     controlnet_conditioning_scale=0.0, **settings)  # the same program
    assert moves(expected, without)


def common(theirs) -> dict:
    """FluxPipeline's components that the other Flux pipelines take (all but the IP-Adapter's)."""
    return {name: part for name, part in theirs.components.items() if name not in ("image_encoder",
                                                                                   "feature_extractor")}


@pytest.fixture(scope="module")
def control_checkpoint(pipes):
    """(folder, diffusers' FluxControlPipeline): FLUX.1 Canny / Depth dev's shape, 128 input features."""
    from diffusers import FluxControlPipeline

    folder, theirs, _, _ = pipes
    control = FluxControlPipeline(**{**common(theirs), "transformer": torch_flux_transformer(
        5, in_channels=128, out_channels=64, guidance_embeds=True)})
    control.save_pretrained(folder.parent / "control", safe_serialization=True)
    return folder.parent / "control", control


def test_flux_control_matches_diffusers(control_checkpoint, monkeypatch):
    """`sdflax.from_pretrained` of a Control folder gives FluxControl; the control picture's latents beside the
    latents, and another picture moves the image."""
    import diffusers.pipelines.flux.pipeline_flux_control as module

    folder, control = control_checkpoint
    pipe, params = sdflax.from_pretrained(folder)
    assert type(pipe) is sdflax.FluxControl
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    key = jax.random.PRNGKey(3)
    expected = {}
    for seed in (0, 1):
        pictures = control_pictures(seed=seed)
        patch_draws(monkeypatch, module, list(control_draws(key, (2, 16, SIZE // 8, SIZE // 8), 1)), latents_for())
        expected[seed] = theirs_images(control, control_image=pictures, guidance_scale=3.5)
        image = pipe.prepare_image_inputs(pictures)
        check_images(pipe(ids, image, params, key, num_inference_steps=STEPS, latents=latents_for(),
                          guidance_scale=3.5).images, expected[seed])
    assert moves(expected[0], expected[1])


def test_pmap_and_sharded_equal_single_device(pipes):
    """A net's pictures split over eight devices, one prompt, picture and key each."""
    _, _, pipe, params = pipes
    devices = jax.local_device_count()
    ids = pipe.prepare_inputs([f"a painting of a {i}" for i in range(devices)], max_sequence_length=T5_LENGTH)
    control = pipe.prepare_image_inputs(pictures_and_masks(seed=3, batch=devices)[0])
    latents = latents_for(devices, seed=5)
    keys = jax.random.split(jax.random.PRNGKey(0), devices)
    settings = dict(num_inference_steps=2, guidance_scale=3.5, controlnet_conditioning_scale=0.8)
    images = pipe(shard(ids), shard(control), replicate(params), keys, jit=True, latents=shard(latents),
                  **settings).images
    for i in (0, 5):
        single = pipe(ids[i:i + 1], control[i:i + 1], params, keys[i], latents=latents[i:i + 1], **settings).images
        np.testing.assert_allclose(images[i], single, rtol=0, atol=1e-5)
    sharded = pipe.generate_sharded(ids, control, params, keys, latents=latents, **settings)
    np.testing.assert_allclose(sharded, unshard(images), rtol=0, atol=1e-5)


def test_bad_control_modes_are_refused(pipes, models):
    union, union_params = with_nets(pipes, models, ["union"])
    _, _, pipe, params = pipes
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    control = pipe.prepare_image_inputs(control_pictures())
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match=r"control_mode=None: the ControlNet is a Union net of 3 modes; give the kind "
                                         r"of its picture, a whole number in 0 \.\. 2"):
        ours_controlnet_images(union, union_params, ids, control, key)
    with pytest.raises(ValueError, match=r"control_mode=1, but the ControlNet is not a Union net"):
        ours_controlnet_images(pipe, params, ids, control, key, control_mode=1)
    both, both_params = with_nets(pipes, models, ["plain", "union"])
    with pytest.raises(ValueError, match="1 control images for 2 ControlNets: give one image"):
        ours_controlnet_images(both, both_params, ids, control, key, control_mode=[None, 1])


# ---- the command line ---------------------------------------------------------------------------------------------
CLI = ["--height", "32", "--width", "32", "--steps", "2", "--seed", "7", "--max-sequence-length", str(T5_LENGTH),
       "--no-progress", "--num-images", "1"]


def cli_library(pipe, params, *pictures, **kwargs):
    """The library's image of the CLI's call (its rows, keys and negative prompt ids), as test_cli_flux's."""
    from test_cli import rows
    from test_cli_controlnet import as_the_cli

    keys = as_the_cli(7)
    ids = pipe.prepare_inputs([PROMPTS[1]], max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs([""], max_sequence_length=T5_LENGTH)
    ids, neg, *pictures = rows([ids, neg, *pictures], keys)
    return pipe.generate_sharded(ids, *pictures, params, keys, num_inference_steps=2, neg_prompt_ids=neg,
                                 **kwargs)[0]


def test_the_cli_runs_a_union_net_and_a_control_checkpoint(pipes, models, control_checkpoint, tmp_path):
    """`--controlnet` with `--control-mode` on a Flux folder is FluxControlNet's call, and `--control-image` alone
    on a Control checkpoint FluxControl's; the PNG records the mode."""
    from PIL import Image
    from test_cli import close_to

    from sdflax.cli import main

    picture = control_pictures(seed=4)[0].resize((32, 32))
    picture.save(tmp_path / "edges.png")
    union = str(models["folder"] / "union")
    assert main(["generate", PROMPTS[1], "--model", str(pipes[0]), "--controlnet", union, "--control-image",
                 str(tmp_path / "edges.png"), "--control-mode", "2", *CLI, "--out", str(tmp_path / "net.png")]) == 0
    pipe, params = with_nets(pipes, models, ["union"])
    close_to(tmp_path / "net.png", cli_library(pipe, params, pipe.prepare_image_inputs([picture]), height=32,
                                               width=32, controlnet_conditioning_scale=[1.0], control_mode=[2]))
    assert Image.open(tmp_path / "net.png").text["control_mode"] == "[2]"

    assert main(["generate", PROMPTS[1], "--model", str(control_checkpoint[0]), "--control-image",
                 str(tmp_path / "edges.png"), *CLI, "--out", str(tmp_path / "control.png")]) == 0
    pipe, params = sdflax.FluxControl.from_pretrained(control_checkpoint[0])
    close_to(tmp_path / "control.png", cli_library(pipe, params, pipe.prepare_image_inputs([picture]),
                                                   guidance_scale=3.5))


@pytest.mark.parametrize("args, expected", [
    (["--controlnet", "union", "--control-image", "edges.png"], "--controlnet union is a Union ControlNet of 3 modes: "
     "give --control-mode N"),
    (["--controlnet", "plain", "--control-image", "edges.png", "--control-mode", "1"], "--control-mode 1 for "
     "--controlnet plain: -1 (not a Union net)"),
    (["--control-image", "edges.png"], "--control-image without --controlnet, but dev is not a Flux.1 Control "
     "checkpoint"),
    (["--model", "control", "--control-image", "edges.png", "--controlnet", "plain"], "control is a Flux.1 Control "
     "checkpoint (Canny / Depth dev"),
])
def test_bad_cli_input_is_one_line_and_status_2(args, expected, pipes, models, control_checkpoint, tmp_path,
                                                  capsys, monkeypatch):
    from test_cli import one_error_line

    from sdflax.cli import main

    for name in ("plain", "union"):
        (tmp_path / name).symlink_to(models["folder"] / name)
    (tmp_path / "dev").symlink_to(pipes[0])
    (tmp_path / "control").symlink_to(control_checkpoint[0])
    control_pictures()[0].save(tmp_path / "edges.png")
    monkeypatch.chdir(tmp_path)
    model = [] if "--model" in args else ["--model", "dev"]
    assert main(["generate", "a fox", *model, *args, "--out", str(tmp_path / "out")]) == 2
    assert expected in one_error_line(capsys)


@pytest.mark.parametrize("kind", ["img2img", "inpaint"])
def test_image_and_inpaint_nets_match_diffusers(pipes, models, monkeypatch, kind):
    """FluxControlNetImg2Img and FluxControlNetInpaint: the control picture drawn first, then the image (and the
    masked image), as diffusers' FluxControlNetImg2ImgPipeline and FluxControlNetInpaintPipeline encode them."""
    import diffusers.pipelines.flux.pipeline_flux_controlnet_image_to_image as img2img
    import diffusers.pipelines.flux.pipeline_flux_controlnet_inpainting as inpaint
    from diffusers import FluxControlNetImg2ImgPipeline, FluxControlNetInpaintPipeline

    folder, theirs, _, _ = pipes
    module, their_class, cls = {"img2img": (img2img, FluxControlNetImg2ImgPipeline, sdflax.FluxControlNetImg2Img),
                                "inpaint": (inpaint, FluxControlNetInpaintPipeline, sdflax.FluxControlNetInpaint)}[kind]
    pipe, params = cls.from_pretrained(folder, controlnet=models["plain"][1])
    params["controlnet"] = models["plain"][2]
    pictures, masks = pictures_and_masks(seed=5)
    masks = masks if kind == "inpaint" else []
    key, shape = jax.random.PRNGKey(6), (2, 16, SIZE // 8, SIZE // 8)
    draws = random_draws(key, shape, 3 if masks else 2)[0]
    noise = latents_for(seed=8)
    patch_draws(monkeypatch, module, [*control_draws(key, shape, 1), *draws[:-1]], noise)
    mask = {"mask_image": masks} if masks else {}
    with torch.no_grad():
        expected = their_class(**{**common(theirs), "controlnet": models["plain"][0]})(
            PROMPTS, image=pictures, control_image=control_pictures(), strength=0.8, num_inference_steps=STEPS,
            guidance_scale=3.5, controlnet_conditioning_scale=0.9, height=SIZE, width=SIZE,
            max_sequence_length=T5_LENGTH, output_type="np", **mask).images
    ids, *images = pipe.prepare_inputs(PROMPTS, pictures, **({"masks": masks} if masks else {}),
                                       control_images=control_pictures(), max_sequence_length=T5_LENGTH)
    check_images(pipe(ids, *images, params, key, strength=0.8, num_inference_steps=STEPS, guidance_scale=3.5,
                      controlnet_conditioning_scale=0.9, noise=noise).images, expected)


@pytest.mark.parametrize("kind", ["img2img", "inpaint"])
def test_control_image_and_inpaint_match_diffusers(control_checkpoint, monkeypatch, kind):
    """FluxControlImg2Img and FluxControlInpaint: the image noised as far as `strength` says (inpainting: the known
    region pasted back every step), the control picture's latents beside the latents; diffusers draws the posterior
    samples in its order (inpainting: the masked image's first, unused by this transformer), then the control
    picture's, then the image's. Another strength, or another mask, moves diffusers' image; the mask is traced."""
    import diffusers.pipelines.flux.pipeline_flux_control_img2img as img2img
    import diffusers.pipelines.flux.pipeline_flux_control_inpaint as inpaint
    from diffusers import FluxControlImg2ImgPipeline, FluxControlInpaintPipeline
    from PIL import ImageOps

    folder, control = control_checkpoint
    module, their_class, cls = {"img2img": (img2img, FluxControlImg2ImgPipeline, sdflax.FluxControlImg2Img),
                                "inpaint": (inpaint, FluxControlInpaintPipeline, sdflax.FluxControlInpaint)}[kind]
    theirs = their_class(**control.components)
    pipe, params = cls.from_pretrained(folder)
    pictures, masks = pictures_and_masks(seed=6)
    key, shape = jax.random.PRNGKey(7), (2, 16, SIZE // 8, SIZE // 8)
    noise = latents_for(seed=9)
    controls = control_pictures(seed=7)

    def expected(strength, mask=None):
        if mask is None:
            image_eps, _ = random_draws(key, shape, 2)[0]
            posterior = [*control_draws(key, shape, 1), image_eps]
        else:
            image_eps, masked_eps, _ = random_draws(key, shape, 3)[0]
            posterior = [masked_eps, *control_draws(key, shape, 1), image_eps]
        patch_draws(monkeypatch, module, posterior, noise)
        with torch.no_grad():
            return theirs(PROMPTS, image=pictures, control_image=controls, strength=strength,
                          num_inference_steps=STEPS, guidance_scale=3.5, height=SIZE, width=SIZE,
                          max_sequence_length=T5_LENGTH, output_type="np",
                          **({"mask_image": mask} if mask is not None else {})).images

    def ours(strength, *mask):
        return pipe(ids, image, *mask, control_image, params, key, strength=strength, num_inference_steps=STEPS,
                    guidance_scale=3.5, noise=noise).images

    if kind == "img2img":
        ids, image, control_image = pipe.prepare_inputs(PROMPTS, pictures, control_images=controls,
                                                        max_sequence_length=T5_LENGTH)
        assert moves(expected(0.8), expected(0.5))
        check_images(ours(0.8), expected(0.8))
    else:
        inverted = [ImageOps.invert(mask) for mask in masks]
        ids, image, mask, control_image = pipe.prepare_inputs(PROMPTS, pictures, masks, control_images=controls,
                                                              max_sequence_length=T5_LENGTH)
        _, _, other, _ = pipe.prepare_inputs(PROMPTS, pictures, inverted, control_images=controls,
                                             max_sequence_length=T5_LENGTH)
        by_mask = [expected(0.8, masks), expected(0.8, inverted)]
        assert moves(*by_mask) and moves(by_mask[0], expected(0.5, masks))
        for given, theirs_image in zip((mask, other), by_mask):
            check_images(ours(0.8, given), theirs_image)
        assert pipe._jitted._cache_size() == 1



def test_control_inpaint_under_pmap_and_sharded_equals_one_device(control_checkpoint):
    """FluxControlInpaint's three pictures (the image, its mask, the control picture) split over eight devices with
    one prompt and key each: pmap and the sharded path give the one-device call's images."""
    folder, _ = control_checkpoint
    pipe, params = sdflax.FluxControlInpaint.from_pretrained(folder)
    devices = jax.local_device_count()
    pictures, masks = pictures_and_masks(seed=3, batch=devices)
    ids, image, mask, control = pipe.prepare_inputs(
        [f"a painting of a {i}" for i in range(devices)], pictures, masks,
        control_images=pictures_and_masks(seed=4, batch=devices)[0], max_sequence_length=T5_LENGTH)
    noise = latents_for(devices, seed=5)
    keys = jax.random.split(jax.random.PRNGKey(0), devices)
    settings = dict(num_inference_steps=2, guidance_scale=3.5, strength=0.8)
    images = pipe(shard(ids), shard(image), shard(mask), shard(control), replicate(params), keys, jit=True,
                  noise=shard(noise), **settings).images
    for i in (0, 5):
        single = pipe(ids[i:i + 1], image[i:i + 1], mask[i:i + 1], control[i:i + 1], params, keys[i],
                      noise=noise[i:i + 1], **settings).images
        np.testing.assert_allclose(images[i], single, rtol=0, atol=1e-5)
    sharded = pipe.generate_sharded(ids, image, mask, control, params, keys, noise=noise, **settings)
    np.testing.assert_allclose(sharded, unshard(images), rtol=0, atol=1e-5)

def test_an_ordinary_checkpoint_is_refused_by_control_img2img(pipes):
    folder, _, _, _ = pipes
    pipe, params = sdflax.FluxControlImg2Img.from_pretrained(folder)
    ids, image, control = pipe.prepare_inputs(PROMPTS, control_pictures(), control_images=control_pictures(),
                                              max_sequence_length=T5_LENGTH)
    with pytest.raises(ValueError, match=r"^Flux Control's transformer takes 128 features per token .* this one takes "
                                         r"64: use Flux, FluxImg2Img or FluxInpaint \(FluxControlNet\* with a "
                                         r"ControlNet\) for an ordinary Flux checkpoint$"):
        pipe(ids, image, control, params, jax.random.PRNGKey(0), num_inference_steps=2)


def test_the_cli_runs_control_img2img_and_inpaint(control_checkpoint, tmp_path):
    """`img2img` and `inpaint` with --control-image on a Control checkpoint are FluxControlImg2Img's and
    FluxControlInpaint's calls (their defaults: strength 0.6, guidance 7)."""
    from PIL import Image
    from test_cli import close_to

    from sdflax.cli import main

    pictures, masks = pictures_and_masks(seed=8)
    for name, picture in (("edges", control_pictures(seed=9)[0]), ("in", pictures[0]), ("mask", masks[0])):
        picture.resize((32, 32)).save(tmp_path / f"{name}.png")
    edges, image, mask = (Image.open(tmp_path / f"{name}.png") for name in ("edges", "in", "mask"))
    for command, cls, given in (("img2img", sdflax.FluxControlImg2Img, []),
                                ("inpaint", sdflax.FluxControlInpaint, ["--mask", str(tmp_path / "mask.png")])):
        assert main([command, PROMPTS[1], "--model", str(control_checkpoint[0]), "--image", str(tmp_path / "in.png"),
                     *given, "--control-image", str(tmp_path / "edges.png"), *CLI,
                     "--out", str(tmp_path / f"{command}.png")]) == 0
        pipe, params = cls.from_pretrained(control_checkpoint[0])
        _, *arrays = pipe.prepare_inputs([PROMPTS[1]], [image], *([[mask]] if given else []), control_images=[edges],
                                         max_sequence_length=T5_LENGTH)
        close_to(tmp_path / f"{command}.png", cli_library(pipe, params, *arrays, strength=0.6, guidance_scale=7.0))
