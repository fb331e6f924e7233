"""No wasted guidance: at guidance scales <= 1 the UNet runs on the conditional batch only, as diffusers does
(turbo and LCM models), and the images equal diffusers' at guidance_scale 1.0 and 0.0."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from builders import torch_pipeline
from test_pipeline import ATOL, NEGATIVE, PROMPTS

from sdflax import StableDiffusion


def latents(size):
    return np.random.default_rng(0).standard_normal((2, 4, size, size), dtype=np.float32)


@pytest.mark.parametrize("arch, scheduler, config, steps, scale", [
    ("sd1", "pndm", {}, 3, 1.0),
    # SD-Turbo's recipe: Euler ancestral, trailing spacing, one step, no guidance (that step adds no noise)
    ("sd2", "euler_ancestral", {"timestep_spacing": "trailing", "prediction_type": "v_prediction"}, 1, 0.0),
])
def test_images_match_diffusers_without_guidance(tmp_path, arch, scheduler, config, steps, scale):
    theirs = torch_pipeline(arch, scheduler, **config)
    theirs.save_pretrained(tmp_path)
    pipe, params = StableDiffusion.from_pretrained(tmp_path)
    x = latents(pipe.unet.config.sample_size)
    with torch.no_grad():
        expected = theirs(PROMPTS, negative_prompt=NEGATIVE, guidance_scale=scale, num_inference_steps=steps,
                          latents=torch.from_numpy(x), output_type="np").images
    ids, neg = pipe.prepare_inputs(PROMPTS), pipe.prepare_inputs(NEGATIVE)
    ours = pipe(ids, params, jax.random.key(0), steps, guidance_scale=scale, latents=x, neg_prompt_ids=neg).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=ATOL)
    # the negative prompt is unused without guidance, and guidance would have changed the image
    with torch.no_grad():
        guided = theirs(PROMPTS, negative_prompt=NEGATIVE, guidance_scale=7.5, num_inference_steps=steps,
                        latents=torch.from_numpy(x), output_type="np").images
    assert np.abs(guided - expected).max() > 1e-2


def scan_conv_rows(pipe, params, ids, x, **kwargs):
    """The batch sizes of the convolutions inside the sampling scan (the UNet's), from the traced program."""
    jaxpr = jax.make_jaxpr(lambda p: pipe._generate(ids, p, jax.random.key(0), 2, latents=x, **kwargs))(params)
    rows = set()

    def visit(jaxpr, in_scan):
        for eqn in jaxpr.eqns:
            if in_scan and eqn.primitive.name == "conv_general_dilated":
                rows.add(eqn.invars[0].aval.shape[0])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        sub = sub.jaxpr
                    if isinstance(sub, jax.extend.core.Jaxpr):
                        visit(sub, in_scan or eqn.primitive.name == "scan")

    visit(jaxpr.jaxpr, False)
    return rows


def test_the_unet_runs_on_the_conditional_batch_only(tmp_path):
    torch_pipeline("sd1", "ddim").save_pretrained(tmp_path)
    pipe, params = StableDiffusion.from_pretrained(tmp_path)
    ids, x = pipe.prepare_inputs(PROMPTS), latents(pipe.unet.config.sample_size)
    assert scan_conv_rows(pipe, params, ids, x, guidance_scale=7.5) == {4}  # [unconditional; conditional]
    assert scan_conv_rows(pipe, params, ids, x, guidance_scale=1.0) == {2}
    assert scan_conv_rows(pipe, params, ids, x, guidance_scale=0.0) == {2}
    # a guidance function of the user's combines both halves, at any scale
    assert scan_conv_rows(pipe, params, ids, x, guidance_scale=1.0, guidance=lambda u, c, s: c) == {4}
