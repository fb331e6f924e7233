"""sdflax's guiders that perturb the UNet (PAG, SEG, SLG, AutoGuidance) against diffusers.guiders: each guider's
images equal diffusers' own UNet, scheduler and VAE stepping with that guider, its layer hooks put on the UNet and
taken off around each of the guider's batches as diffusers' modular pipelines do; for SD and SDXL."""

from __future__ import annotations

import math

import diffusers.guiders as theirs_guiders
import diffusers.hooks.smoothed_energy_guidance_utils as seg_utils
import numpy as np
import pytest
import test_guiders
import torch
from diffusers import LayerSkipConfig, SmoothedEnergyGuidanceConfig
from builders import guided_by_batches
from test_guiders import ATOL, MOVES, PROMPTS, STEPS, diffusers_images, sdflax_images

from sdflax.guiders import perturbed

pipes = test_guiders.pipes  # the fixture: (arch, diffusers' pipeline, sdflax's, its params, latents), SD 1.x and SDXL


def oracle_images(theirs, latents, guider):
    call = dict(num_inference_steps=STEPS, latents=torch.from_numpy(latents), output_type="np")
    with torch.no_grad(), guided_by_batches(theirs.unet, guider, STEPS):
        return theirs(PROMPTS, guidance_scale=2.0, **call).images


class PerturbedPassAsPAGPipelines:
    """diffusers' PAG, SLG and SEG guiders with their perturbed pass run as diffusers' PAG pipelines run it, which is
    what the guiders' `forward` expects: without classifier-free guidance (two batches) diffusers runs it on the
    unconditional inputs (`prepare_inputs` takes tuple index 1 for the second batch) and unperturbed
    (`is_conditional` counts only the first and third batches), which makes PAG alone classifier-free guidance."""

    def prepare_inputs(self, data):
        batches = super().prepare_inputs(data)
        if len(batches) == 2 and not self._is_cfg_enabled():
            batches[1] = self._prepare_batch(data, 0, getattr(batches[1], self._identifier_key))
        return batches

    @property
    def is_conditional(self):
        count = self._count_prepared
        return count in (1, 3) or (count == 2 == self.num_conditions and not self._is_cfg_enabled())


class PAG(PerturbedPassAsPAGPipelines, theirs_guiders.PerturbedAttentionGuidance):
    pass


def test_the_oracle_is_diffusers_pag_pipeline(pipes):
    from diffusers import StableDiffusionPAGPipeline, StableDiffusionXLPAGPipeline

    arch, theirs, _, _, latents = pipes
    pag = (StableDiffusionPAGPipeline if arch == "sd1" else StableDiffusionXLPAGPipeline).from_pipe(
        theirs, pag_applied_layers=["mid"])
    call = dict(num_inference_steps=STEPS, latents=torch.from_numpy(latents), output_type="np")
    # perturbed_guidance_start below 0: from the first step on, as the PAG pipelines do
    every_mid_layer = dict(perturbed_guidance_config=LayerSkipConfig([0], fqn="mid_block.attentions"),
                           perturbed_guidance_scale=3.0, perturbed_guidance_start=-1.0, perturbed_guidance_stop=1.0)
    with torch.no_grad():
        expected = pag(PROMPTS, guidance_scale=5.0, pag_scale=3.0, **call).images
        alone = pag(PROMPTS, guidance_scale=1.0, pag_scale=3.0, **call).images
    np.testing.assert_allclose(oracle_images(theirs, latents, PAG(guidance_scale=5.0, **every_mid_layer)), expected,
                               rtol=0, atol=1e-5)
    # without CFG the PAG pipeline gives ε(c) + s (ε(c) − ε_ptb(c)): the guider's original formulation at scale 0
    np.testing.assert_allclose(oracle_images(theirs, latents, PAG(guidance_scale=0.0, use_original_formulation=True,
                                                                  **every_mid_layer)),
                               alone, rtol=0, atol=1e-5)


class SLG(PerturbedPassAsPAGPipelines, theirs_guiders.SkipLayerGuidance):
    pass


class SEG(PerturbedPassAsPAGPipelines, theirs_guiders.SmoothedEnergyGuidance):
    def prepare_models(self, denoiser):
        self._count_prepared += 1  # diffusers' SEG does not count its batches, so its hooks never go on
        super().prepare_models(denoiser)


def mended_blur(blur, threshold):
    """diffusers' `_gaussian_blur_2d` with its branches as documented (and as SEG-SDXL has them): the mean above
    the guider's `seg_blur_threshold_inf`, the Gaussian below it. diffusers averages below the threshold and blurs
    above it (PR 14187), and its hook passes its own threshold (9999.9), not the guider's."""
    return lambda query, kernel_size, sigma, _: blur(query, kernel_size, sigma,
                                                     math.inf if sigma > threshold else -math.inf)


def test_smoothed_queries_are_diffusers_blur():
    rng = np.random.default_rng(0)
    for tokens in (64, 49, 70, 4):  # an even and an odd side, tokens past the square, a kernel wider than the image
        for sigma in (0.5, 1.0, 2.0, 1e7):
            q = rng.standard_normal((2, tokens, 3, 4)).astype(np.float32)
            kernel_size = math.ceil(6 * sigma) + 1 - math.ceil(6 * sigma) % 2  # diffusers' hook's
            expected = mended_blur(seg_utils._gaussian_blur_2d, 9999.0)(
                torch.from_numpy(q.reshape(2, tokens, 12).copy()), kernel_size, sigma, None).numpy()
            np.testing.assert_allclose(np.asarray(perturbed.smoothed_queries(q, sigma, 9999.0)).reshape(2, tokens, 12),
                                       expected, rtol=0, atol=1e-6)


# the layers: lists of transformer blocks by checkpoint name, and the entry of each (SDXL's lists hold two blocks)
STACKS = {"sd1": ("mid_block.attentions.0.transformer_blocks", "down_blocks.0.attentions.0.transformer_blocks",
                  "up_blocks.1.attentions.1.transformer_blocks"),
          "sdxl": ("mid_block.attentions.0.transformer_blocks", "down_blocks.1.attentions.1.transformer_blocks",
                   "up_blocks.0.attentions.2.transformer_blocks")}
ENTRY = {"sd1": 0, "sdxl": 1}


def layer_settings(name, arch, skip, smooth):
    """The guider's static settings: its layers (`skip`, `smooth`: diffusers' or sdflax's config classes) and its
    perturbation from the second step on."""
    mid, down, up = STACKS[arch]
    i = ENTRY[arch]
    if name == "PerturbedAttentionGuidance":  # SDXL: the list of the mid block's transformers, two blocks each
        return dict(perturbed_guidance_config=skip([0], fqn="mid_block.attentions") if arch == "sdxl"
                    else skip([i], fqn=mid), perturbed_guidance_start=0.0, perturbed_guidance_stop=1.0)
    if name == "SmoothedEnergyGuidance":  # every self-attention layer: down and up blocks by index, the mid block
        return dict(seg_guidance_config=[smooth([i], fqn="down_blocks"), smooth([1 - i], fqn="up_blocks"),
                                         smooth([0], fqn="mid_block.attentions")])
    if name == "SkipLayerGuidance":  # a feed-forward, an attention layer, a whole block
        return dict(skip_layer_config=[skip([i], fqn=mid, skip_attention=False), skip([i], fqn=down, skip_ff=False),
                                       skip([i], fqn=up)], skip_layer_guidance_start=0.0, skip_layer_guidance_stop=1.0)
    # AutoGuidance: attention scores with a feed-forward, and a whole block, in the unconditional pass
    return dict(auto_guidance_config=[skip([i], fqn=mid, skip_attention=False, skip_attention_scores=True),
                                      skip([i], fqn=up)])


SKIPS = {"SkipLayerGuidance": "skip_layer_config", "AutoGuidance": "auto_guidance_config"}  # lists of configs
THEIRS = {"PerturbedAttentionGuidance": PAG, "SmoothedEnergyGuidance": SEG, "SkipLayerGuidance": SLG,
          "AutoGuidance": theirs_guiders.AutoGuidance}


def theirs_guider(name, arch, leave_out=None, **settings):
    """diffusers' guider (mended as `THEIRS` says), without its `leave_out`-th layer config where given."""
    layers = layer_settings(name, arch, LayerSkipConfig, SmoothedEnergyGuidanceConfig)
    if leave_out is not None:
        layers[SKIPS[name]] = [config for j, config in enumerate(layers[SKIPS[name]]) if j != leave_out]
    return THEIRS[name](**layers, **settings)


def ours_guider(name, arch, **settings):
    return getattr(perturbed, name)(**layer_settings(name, arch, perturbed.LayerSkipConfig,
                                                   perturbed.SmoothedEnergyGuidanceConfig), **settings)


# (guider, the settings of the case, the settings it is compared with): only traced numbers vary, so each guider
# compiles once per model
CASES = {
    "PerturbedAttentionGuidance": [({"guidance_scale": 5.0, "perturbed_guidance_scale": 10.0},
                                    {"guidance_scale": 5.0, "perturbed_guidance_scale": 0.0}),
                                   ({"guidance_scale": 1.0, "perturbed_guidance_scale": 10.0},  # PAG alone
                                    {"guidance_scale": 1.0, "perturbed_guidance_scale": 0.0})],
    "SmoothedEnergyGuidance": [({"guidance_scale": 5.0, "seg_guidance_scale": 30.0},  # infinite blur: the mean
                                {"guidance_scale": 5.0, "seg_guidance_scale": 0.0}),
                               ({"guidance_scale": 5.0, "seg_guidance_scale": 30.0, "seg_blur_sigma": 0.5},  # 3 x 3
                                {"guidance_scale": 5.0, "seg_guidance_scale": 30.0})],
    "SkipLayerGuidance": [({"guidance_scale": 5.0, "skip_layer_guidance_scale": 3.0},
                           {"guidance_scale": 5.0, "skip_layer_guidance_scale": 0.0})],
    "AutoGuidance": [({"guidance_scale": 5.0}, "cfg")],
}
IDS = [(arch, name, i) for name, cases in CASES.items() for i in range(len(cases)) for arch in ("sd1", "sdxl")]


@pytest.mark.parametrize("pipes, name, case", IDS, ids=[f"{a}-{name}-{i}" for a, name, i in IDS], indirect=["pipes"])
def test_perturbing_guider_images_match_diffusers(pipes, name, case, monkeypatch):
    arch, theirs, _, _, latents = pipes
    monkeypatch.setattr(seg_utils, "_gaussian_blur_2d", mended_blur(seg_utils._gaussian_blur_2d, 9999.0))
    kwargs, baseline = CASES[name][case]
    expected = oracle_images(theirs, latents, theirs_guider(name, arch, **kwargs))
    if baseline == "cfg":
        moved_from = diffusers_images(theirs, latents, guidance_scale=kwargs["guidance_scale"])
    else:
        moved_from = oracle_images(theirs, latents, theirs_guider(name, arch, **baseline))
    assert np.abs(expected - moved_from).max() > MOVES
    if name in ("SkipLayerGuidance", "AutoGuidance"):  # each kind of skip matters
        for leave_out in range(len(layer_settings(name, arch, LayerSkipConfig, None)[SKIPS[name]])):
            without = oracle_images(theirs, latents, theirs_guider(name, arch, leave_out, **kwargs))
            assert np.abs(expected - without).max() > MOVES, leave_out
    np.testing.assert_allclose(sdflax_images(pipes, ours_guider(name, arch, **kwargs)), expected, rtol=0, atol=ATOL)


def test_what_diffusers_cannot_do_on_a_unet_is_refused():
    from builders import SD1, torch_unet
    from diffusers.hooks.layer_skip import _apply_layer_skip_hook

    with pytest.raises(ValueError, match="Could not find a suitable identifier"):  # fqn="auto": no DiT's blocks
        _apply_layer_skip_hook(torch_unet(SD1["unet"]), LayerSkipConfig([0]))
    for guider, settings in [(perturbed.PerturbedAttentionGuidance, dict(perturbed_guidance_layers=[0])),
                             (perturbed.SkipLayerGuidance, dict(skip_layer_config=perturbed.LayerSkipConfig([0]))),
                             (perturbed.SmoothedEnergyGuidance, dict(seg_guidance_layers=0)),
                             (perturbed.AutoGuidance, dict(auto_guidance_layers=[0], dropout=1.0))]:
        with pytest.raises(ValueError, match="fqn='auto'"):
            guider(**settings)
    with pytest.raises(ValueError, match="dropout=0.5 drops outputs at random"):
        perturbed.AutoGuidance(auto_guidance_config=dict(indices=[0], fqn=STACKS["sd1"][0], dropout=0.5))


@pytest.mark.parametrize("pipes", ["sd1"], indirect=True)
def test_layers_the_unet_has_not_are_refused(pipes):
    for config, message in [(perturbed.LayerSkipConfig([1], fqn=STACKS["sd1"][0]), "no module of this UNet"),
                            (perturbed.LayerSkipConfig([0], fqn="mid_block.attentions"), "no transformer block")]:
        with pytest.raises(ValueError, match=message):
            sdflax_images(pipes, perturbed.SkipLayerGuidance(skip_layer_config=config))
