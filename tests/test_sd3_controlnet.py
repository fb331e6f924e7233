"""SD 3.x ControlNets against diffusers (PyTorch), float32, on small random models saved with save_pretrained and
loaded by sdflax: SD3ControlNetModel in an InstantX-like shape (joint blocks, its own position table, zeros for
its pooled input) and an SD 3.5 Large-like one (single-stream blocks without text, the transformer's patch
embedding, the prompt's pooled embedding); the transformer's `block_controlnet_hidden_states`; and the pipelines
StableDiffusion3ControlNet (one net, two nets, a guidance window, a new scale without recompiling) and
StableDiffusion3ControlNetInpaint."""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import numpy as np
import pytest
import torch
from PIL import Image
from test_mmdit import torch_transformer
from test_sd3_pipeline import check_images, latents_for, moves, pictures_and_masks, torch_sd3_pipeline

from sdflax import (SD3ControlNetModel, SD3Transformer2DModel, StableDiffusion3ControlNet,
                    StableDiffusion3ControlNetInpaint, replicate, shard)

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
    """Every block's sample at scale 0.7, latents of 6x10 (an off-centre crop of InstantX's position table)."""
    config, theirs, model, params = net
    x = model_inputs(config, (6, 10))
    ours = jax.jit(model.apply)(params, x[0], x[1], 0.7, *x[2:])
    expected = theirs_samples(theirs, x, 0.7)
    assert len(ours) == len(expected) == config["num_layers"]
    for a, b in zip(ours, expected):
        assert np.abs(b).max() > 1e-2  # not the zero output of an untrained net
        np.testing.assert_allclose(np.asarray(a), b, rtol=RTOL, atol=ATOL)


def test_transformer_adds_block_samples_by_the_interval_rule(tmp_path):
    """Two samples for four blocks: blocks 0 and 1 take the first, block 2 the second, the last none (diffusers'
    `int(i / (num_layers / len(samples)))` on blocks that keep a context stream), block 1 skipped (its sample is
    added still)."""
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


# ---- pipelines ----------------------------------------------------------------------------------------------------
PROMPTS, NEGATIVE = ["a photo of an astronaut riding a horse on mars", "a red cat"], ["blurry", "a dog"]
STEPS, SIZE, T5_LENGTH = 4, 64, 16
CALL = dict(num_inference_steps=STEPS, guidance_scale=7.0, height=SIZE, width=SIZE)


@contextlib.contextmanager
def posterior_means():
    """diffusers' VAE posterior sample as its mean: it draws the control image's from torch's global generator,
    which no seed reproduces; ours is the mean (pipeline.sd3_controlnet)."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    with mock.patch.object(DiagonalGaussianDistribution, "sample", lambda self, generator=None: self.mean):
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, diffusers' SD 3 pipeline on the 4-block transformer, the nets: diffusers' and ours with params)."""
    from diffusers import StableDiffusion3Pipeline

    tmp = tmp_path_factory.mktemp("sd3_controlnet")
    base = torch_sd3_pipeline(tmp)
    theirs = StableDiffusion3Pipeline(**{**base.components, "transformer": torch_transformer(TRANSFORMER, seed=2)})
    theirs.save_pretrained(tmp / "sd3", safe_serialization=True)
    nets = {}
    for name, config, seed in (("instantx", NETS["instantx"], 5), ("large_a", NETS["sd35_large"], 6),
                               ("large_b", dict(NETS["sd35_large"], num_layers=1), 7),
                               ("inpaint", dict(NETS["instantx"], extra_conditioning_channels=1), 8)):
        net = torch_controlnet(config, seed=seed)
        net.save_pretrained(tmp / name)
        nets[name] = (net, *SD3ControlNetModel.from_pretrained(tmp / name))
    return tmp / "sd3", theirs, nets


def pipeline(checkpoint, cls, *names):
    """(diffusers' pipeline, ours, params) with the named nets (a list for several)."""
    from diffusers import StableDiffusion3ControlNetInpaintingPipeline, StableDiffusion3ControlNetPipeline

    folder, theirs, nets = checkpoint
    torch_nets, models, net_params = zip(*(nets[name] for name in names))
    several = len(names) > 1
    their_class = StableDiffusion3ControlNetInpaintingPipeline if cls is StableDiffusion3ControlNetInpaint else \
        StableDiffusion3ControlNetPipeline
    theirs = their_class(**{**theirs.components, "controlnet": list(torch_nets) if several else torch_nets[0]})
    pipe, params = cls.from_pretrained(folder, controlnet=list(models) if several else models[0])
    params["controlnet"] = list(net_params) if several else net_params[0]
    return theirs, pipe, params


def control_pictures(seed, count=2):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)) for _ in range(count)]


def run_theirs(theirs, **kwargs):
    with torch.no_grad(), posterior_means():
        return theirs(PROMPTS, negative_prompt=NEGATIVE, max_sequence_length=T5_LENGTH, output_type="np",
                      latents=torch.from_numpy(latents_for()), **CALL, **kwargs).images


@pytest.fixture(scope="module")
def one_net(checkpoint):
    """The one-net pipelines, shared: ours keeps its compiled programs for the tests that follow."""
    return pipeline(checkpoint, StableDiffusion3ControlNet, "instantx")


def test_one_net_matches_diffusers_and_a_new_scale_or_window_reuses_the_program(one_net):
    """InstantX's kind (zeros for its pooled input, unshifted control latents), guidance 7 with negative prompts;
    then a scale and a guidance window (each moves diffusers' image), in the same program."""
    theirs, pipe, params = one_net
    pictures = control_pictures(0)
    ids, neg = (pipe.prepare_inputs(p, max_sequence_length=T5_LENGTH) for p in (PROMPTS, NEGATIVE))
    control = pipe.prepare_image_inputs(pictures)

    def ours(**kwargs):
        return pipe(ids, control, params, jax.random.PRNGKey(0), neg_prompt_ids=neg, latents=latents_for(), **CALL,
                    **kwargs).images

    expected = run_theirs(theirs, control_image=pictures)
    check_images(ours(), expected)
    compiled = pipe._jitted._cache_size()
    for settings in (dict(controlnet_conditioning_scale=0.4), dict(control_guidance_start=0.25,
                                                                   control_guidance_end=0.75)):
        other = run_theirs(theirs, control_image=pictures, **settings)
        assert moves(other, expected)
        check_images(ours(**settings), other)
    assert pipe._jitted._cache_size() == compiled  # scales and windows are traced


def test_two_nets_match_diffusers(checkpoint):
    """Two of Stability's SD 3.5 Large kind (the transformer's patch embedding, the prompt's pooled embedding,
    shifted control latents), of 2 and 1 blocks (zip: the second adds to the first sample only), one scale and
    window each."""
    theirs, pipe, params = pipeline(checkpoint, StableDiffusion3ControlNet, "large_a", "large_b")
    pictures = [control_pictures(1), control_pictures(2)]
    ids, neg = (pipe.prepare_inputs(p, max_sequence_length=T5_LENGTH) for p in (PROMPTS, NEGATIVE))
    settings = dict(controlnet_conditioning_scale=[0.9, 0.6], control_guidance_start=[0.0, 0.25],
                    control_guidance_end=[1.0, 0.75])
    expected = run_theirs(theirs, control_image=pictures, **settings)
    one = run_theirs(theirs, control_image=pictures, **{**settings, "controlnet_conditioning_scale": [0.9, 0.0]})
    assert moves(expected, one)  # the second net reaches diffusers' image
    control = [pipe.prepare_image_inputs(p) for p in pictures]
    images = pipe(ids, control, params, jax.random.PRNGKey(0), neg_prompt_ids=neg, latents=latents_for(), **CALL,
                  **settings).images
    check_images(images, expected)

    # controlnet_pooled_projections (B, P), for both halves of the guidance batch: diffusers takes the whole batch
    # and, mended, reads it (its `controlnet_pooled_projections or pooled_prompt_embeds` asks a tensor's truth)
    pooled = np.random.default_rng(9).standard_normal((2, 72), dtype=np.float32)
    given = torch.from_numpy(np.concatenate([pooled, pooled])).as_subclass(Truthy)
    expected = run_theirs(theirs, control_image=pictures, controlnet_pooled_projections=given, **settings)
    assert moves(expected, images)
    check_images(pipe(ids, control, params, jax.random.PRNGKey(0), neg_prompt_ids=neg, latents=latents_for(),
                      controlnet_pooled_projections=pooled, **CALL, **settings).images, expected)


class Truthy(torch.Tensor):
    """A tensor whose truth is True, as `x or y` needs."""

    def __bool__(self):
        return True


def test_inpainting_matches_diffusers(checkpoint):
    """Alimama's kind: 17 control channels, the masked picture's latents and 1 - the mask; from noise."""
    theirs, pipe, params = pipeline(checkpoint, StableDiffusion3ControlNetInpaint, "inpaint")
    pictures, masks = pictures_and_masks(3)
    ids, image, mask = pipe.prepare_inputs(PROMPTS, pictures, masks, max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs(NEGATIVE, max_sequence_length=T5_LENGTH)
    expected = run_theirs(theirs, control_image=pictures, control_mask=masks)
    full = [Image.fromarray(np.full((SIZE, SIZE), 255, np.uint8))] * 2
    assert moves(expected, run_theirs(theirs, control_image=pictures, control_mask=full))  # the mask matters
    images = pipe(ids, image, mask, params, jax.random.PRNGKey(0), neg_prompt_ids=neg, latents=latents_for(),
                  **CALL).images
    check_images(images, expected)


def test_nets_that_do_not_fit_are_refused_in_one_line(checkpoint):
    folder, _, nets = checkpoint
    cases = [(StableDiffusion3ControlNet, ["instantx", "large_a"], "ControlNets of both kinds"),
             (StableDiffusion3ControlNet, ["inpaint"], "reads 17 control latent channels, this pipeline gives 16"),
             (StableDiffusion3ControlNetInpaint, ["instantx"], "reads 16 control latent channels, this pipeline "
                                                                "gives 17")]
    for cls, names, message in cases:
        pipe, params = cls.from_pretrained(folder, controlnet=[nets[name][1] for name in names])
        with pytest.raises(ValueError, match=message):
            pipe.spec
    pipe, params = pipeline(checkpoint, StableDiffusion3ControlNet, "instantx")[1:]
    ids = pipe.prepare_inputs(PROMPTS[:1], max_sequence_length=T5_LENGTH)
    control = pipe.prepare_image_inputs(control_pictures(0, 1))
    with pytest.raises(ValueError, match=r"controlnet_pooled_projections: these ControlNets \(force_zeros_for_pooled_"
                                         r"projection, InstantX's\) see zeros there"):
        pipe(ids, control, params, jax.random.PRNGKey(0), controlnet_pooled_projections=np.zeros((1, 72)), **CALL)


def test_jit_and_pmap_equal_one_device(one_net):
    """Two prompts a device over the local devices (jit=True: pmap), and a one-device call on one device's rows
    (the parity test's program): the same images, with a control image per prompt and a scale."""
    _, pipe, params = one_net
    devices = jax.local_device_count()
    prompts = [f"a painting of a {i}" for i in range(2 * devices)]
    ids = pipe.prepare_inputs(prompts, max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs(["blurry"] * len(prompts), max_sequence_length=T5_LENGTH)
    control = pipe.prepare_image_inputs(control_pictures(4, len(prompts)))
    latents = latents_for(len(prompts), seed=5)
    keys = jax.random.split(jax.random.PRNGKey(0), devices)
    settings = dict(CALL, controlnet_conditioning_scale=0.8)
    images = pipe(shard(ids), shard(control), replicate(params), keys, jit=True, neg_prompt_ids=shard(neg),
                  latents=shard(latents), **settings).images
    rows = slice(2 * devices - 2, 2 * devices)
    single = pipe(ids[rows], control[rows], params, keys[-1], neg_prompt_ids=neg[rows], latents=latents[rows],
                  **settings).images
    np.testing.assert_allclose(images[-1], single, rtol=0, atol=1e-5)
    assert np.abs(images[0] - images[-1]).max() > 1e-2
