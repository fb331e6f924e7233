"""What perturbs SD 3's joint attention, against diffusers on the small random SD 3.5 Medium-shaped checkpoint of
test_sd3_pipeline (qk RMSNorm, a dual-attention block 0, a context-pre-only last block 2): the PAG hook against
StableDiffusion3PAGPipeline, the PAG and SEG guiders and LayerSkipConfig's attention, score and feed-forward skips
against diffusers.guiders on its SD3Transformer2DModel; attention maps against the joint attention's probabilities
recorded in diffusers' transformer; and the hooks that have no meaning there, refused.

The final latents are compared (the transformer's work; the VAE is test_sd3_pipeline's), within RTOL of their
largest magnitude, float32."""

from __future__ import annotations

import diffusers.hooks.smoothed_energy_guidance_utils as seg_utils
import jax
import numpy as np
import pytest
import torch
from builders import guided_by_batches
from test_guiders_perturbed import PAG, SEG, SLG, mended_blur
from test_sd3_pipeline import (NEGATIVE, PROMPTS, SIZE, STEPS, T5_LENGTH, checkpoints, latents_for,  # noqa: F401
                               text_to_image)

from sdflax import hooks
from sdflax.guiders import (LayerSkipConfig, PerturbedAttentionGuidance, SkipLayerGuidance, SmoothedEnergyGuidance,
                            SmoothedEnergyGuidanceConfig)
from sdflax.hooks.pag import perturbed_attention_guidance

RTOL = 1e-4  # of the latents' largest magnitude, float32
MOVES = 100 * RTOL  # what each tested setting changes in diffusers' latents, at least (relative, as RTOL)
GUIDANCE = 5.0


def check_latents(ours, expected):
    ours, expected = np.asarray(ours), np.asarray(expected)
    assert ours.shape == expected.shape == (len(PROMPTS), 16, SIZE // 8, SIZE // 8)
    scale = np.abs(expected).max()
    assert np.abs(ours - expected).max() <= RTOL * scale, np.abs(ours - expected).max() / scale


def moves(a, b):
    return np.abs(np.asarray(a) - np.asarray(b)).max() > MOVES * np.abs(np.asarray(b)).max()


def theirs_latents(pipe, guidance_scale=GUIDANCE, **kwargs):
    with torch.no_grad():
        return pipe(PROMPTS, negative_prompt=NEGATIVE, num_inference_steps=STEPS, height=SIZE, width=SIZE,
                    guidance_scale=guidance_scale, max_sequence_length=T5_LENGTH,
                    latents=torch.from_numpy(latents_for()), output_type="latent", **kwargs).images.numpy()


def ours_latents(pipe, params, guidance_scale=GUIDANCE):
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs(NEGATIVE, max_sequence_length=T5_LENGTH)
    return pipe(ids, params, jax.random.PRNGKey(0), num_inference_steps=STEPS, height=SIZE, width=SIZE,
                guidance_scale=guidance_scale, neg_prompt_ids=neg, latents=latents_for(),
                return_trajectory=True).trajectory.latents[-1]  # the SD 3 pipelines take no output_type


class HeadNormed(torch.nn.Module):
    """A projection followed by its per-head RMSNorm."""

    def __init__(self, projection, norm, heads):
        super().__init__()
        self.projection, self.norm, self.heads = projection, norm, heads

    def forward(self, x):
        y = self.projection(x)
        return self.norm(y.unflatten(-1, (self.heads, -1))).flatten(-2)


class WithQKNorm:
    """diffusers' PAG joint-attention processor mended: it leaves out SD 3.5's query and key RMSNorms (qk_norm), in
    every chunk, where JointAttnProcessor2_0 applies them; here its projections apply them."""

    NORMS = {"to_q": "norm_q", "to_k": "norm_k", "add_q_proj": "norm_added_q", "add_k_proj": "norm_added_k"}

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        projections = {name: getattr(attn, name) for name in self.NORMS}
        try:
            for name, norm in self.NORMS.items():
                setattr(attn, name, HeadNormed(projections[name], getattr(attn, norm), attn.heads))
            return self.processor(attn, hidden_states, encoder_hidden_states, attention_mask)
        finally:
            for name, projection in projections.items():
                setattr(attn, name, projection)


def test_pag_hook_matches_diffusers_sd3_pag_pipeline(text_to_image):
    """pag_applied_layers "blocks.(1|2)": the joint attention of block 1 and of the last block, whose text stream
    ends there; the image tokens' scores among themselves the identity in the perturbed copy."""
    from diffusers import StableDiffusion3PAGPipeline
    from diffusers.models.attention_processor import PAGCFGJointAttnProcessor2_0, PAGJointAttnProcessor2_0

    theirs, pipe, params = text_to_image
    layers = ["blocks.(1|2)"]
    pag = StableDiffusion3PAGPipeline.from_pipe(theirs, pag_applied_layers=layers)
    pag.set_pag_applied_layers(layers, pag_attn_processors=(WithQKNorm(PAGCFGJointAttnProcessor2_0()),
                                                             WithQKNorm(PAGJointAttnProcessor2_0())))
    expected = theirs_latents(pag, pag_scale=3.0)
    assert moves(expected, theirs_latents(theirs))  # PAG reaches diffusers' latents
    check_latents(ours_latents(pipe.with_hooks(perturbed_attention_guidance(3.0, layers)), params), expected)


@pytest.fixture
def joint_processor_registered(monkeypatch):
    """diffusers' layer-skip hooks mended for SD 3: they look up a skipped attention's processor in a registry that
    lacks JointAttnProcessor2_0 (a ValueError, "not registered", even for skip_attention_scores, which needs no
    entry); registered here, a skipped joint attention gives both streams' inputs and attn2 its input, and a
    skipped block gives (encoder_hidden_states, hidden_states), in the order SD 3's blocks return them (diffusers
    gives them reversed)."""
    from diffusers.hooks._helpers import AttentionProcessorMetadata, AttentionProcessorRegistry
    from diffusers.hooks.layer_skip import TransformerBlockSkipHook
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    def passed(self, hidden_states=None, encoder_hidden_states=None, *args, **kwargs):
        return hidden_states if encoder_hidden_states is None else (hidden_states, encoder_hidden_states)

    AttentionProcessorRegistry._register()
    monkeypatch.setitem(AttentionProcessorRegistry._registry, JointAttnProcessor2_0,
                        AttentionProcessorMetadata(skip_processor_output_fn=passed))
    skip = TransformerBlockSkipHook.new_forward

    def in_the_blocks_order(self, module, *args, **kwargs):
        out = skip(self, module, *args, **kwargs)
        return out[::-1] if isinstance(out, tuple) and self._metadata.return_hidden_states_index == 1 else out

    monkeypatch.setattr(TransformerBlockSkipHook, "new_forward", in_the_blocks_order)


def theirs_guided(theirs, guider):
    """diffusers' latents with `guider` (CFG at scale 2 in the pipeline gives the guider's prediction back)."""
    with guided_by_batches(theirs.transformer, guider, STEPS):
        return theirs_latents(theirs, guidance_scale=2.0)


# a config per kind: block 0 has SD 3.5 Medium's second attention (attn2), block 2 is the last (no text stream after
# its attention)
SKIPS = [dict(indices=[0], skip_attention=True, skip_ff=False), dict(indices=[1], skip_attention=False, skip_ff=True),
         dict(indices=[2], skip_attention=False, skip_attention_scores=True, skip_ff=False)]


def test_layer_skips_match_diffusers_guider(text_to_image, joint_processor_registered):
    """SkipLayerGuidance with an attention skip (block 0: attn and attn2), a feed-forward skip (block 1: ff and
    ff_context) and identity scores (block 2), each of which changes diffusers' latents."""
    from diffusers import LayerSkipConfig as TheirConfig

    theirs, pipe, params = text_to_image
    window = dict(skip_layer_guidance_scale=3.0, skip_layer_guidance_start=0.0, skip_layer_guidance_stop=1.0)

    def configs(kind, leave_out=None):
        return [kind(fqn="transformer_blocks", **skip) for i, skip in enumerate(SKIPS) if i != leave_out]

    expected = theirs_guided(theirs, SLG(guidance_scale=GUIDANCE, skip_layer_config=configs(TheirConfig), **window))
    for leave_out in range(len(SKIPS)):
        without = SLG(guidance_scale=GUIDANCE, skip_layer_config=configs(TheirConfig, leave_out), **window)
        assert moves(expected, theirs_guided(theirs, without)), leave_out
    guider = SkipLayerGuidance(GUIDANCE, skip_layer_config=configs(LayerSkipConfig), **window)
    check_latents(ours_latents(pipe.with_guider(guider), params), expected)


def test_pag_guider_matches_diffusers_guider(text_to_image, joint_processor_registered):
    """PerturbedAttentionGuidance on block 1: the perturbed copy's joint attention gives the values of the whole
    [image; text] sequence (diffusers' identity scores: its scaled_dot_product_attention returns the values)."""
    from diffusers import LayerSkipConfig as TheirConfig

    theirs, pipe, params = text_to_image
    settings = dict(perturbed_guidance_scale=3.0, perturbed_guidance_start=0.0, perturbed_guidance_stop=1.0)
    expected = theirs_guided(theirs, PAG(guidance_scale=GUIDANCE, **settings,
                                         perturbed_guidance_config=TheirConfig([1], fqn="transformer_blocks")))
    assert moves(expected, theirs_latents(theirs))
    guider = PerturbedAttentionGuidance(GUIDANCE, perturbed_guidance_config=LayerSkipConfig(
        [1], fqn="transformer_blocks"), **settings)
    check_latents(ours_latents(pipe.with_guider(guider), params), expected)


@pytest.mark.parametrize("sigma", [0.5, 9999999.0])  # a 3 x 3 Gaussian on the 4 x 4 patches; their mean
def test_seg_guider_matches_diffusers_guider(text_to_image, monkeypatch, sigma):
    """SmoothedEnergyGuidance on blocks 0 and 1: diffusers smooths what to_q gives in each attention of the block
    (the image stream's queries of attn, and attn2's), before the RMSNorm, as a square of ⌊√N⌋² tokens; the sigma
    is traced, so both cases run one program."""
    from diffusers import SmoothedEnergyGuidanceConfig as TheirConfig

    monkeypatch.setattr(seg_utils, "_gaussian_blur_2d", mended_blur(seg_utils._gaussian_blur_2d, 9999.0))
    theirs, pipe, params = text_to_image
    settings = dict(seg_guidance_scale=3.0, seg_blur_sigma=sigma)
    expected = theirs_guided(theirs, SEG(guidance_scale=GUIDANCE, **settings,
                                         seg_guidance_config=TheirConfig([0, 1], fqn="transformer_blocks")))
    assert moves(expected, theirs_latents(theirs))
    guider = SmoothedEnergyGuidance(GUIDANCE, seg_guidance_config=SmoothedEnergyGuidanceConfig(
        [0, 1], fqn="transformer_blocks"), **settings)
    check_latents(ours_latents(pipe.with_guider(guider), params), expected)


def test_hooks_without_a_meaning_on_the_transformer_are_refused(text_to_image):
    """Refused in one line before the transformer is traced: FreeU (a UNet's up blocks and skip connections),
    DeepCache (a UNet's down-up branches)."""
    _, pipe, params = text_to_image
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    for hook, name in [(hooks.freeu(0.9, 0.2, 1.2, 1.4), "freeu"), (hooks.deep_cache(), "deep_cache")]:
        with pytest.raises(ValueError, match=rf"^{name} works on a UNet only: .*, which a transformer \(SD 3.x's, "
                                             r"Flux.1's\) has not; drop the hook$"):
            pipe.with_hooks(hook)(ids, params, jax.random.PRNGKey(0), num_inference_steps=STEPS)


def test_pag_layers_the_transformer_has_not_are_refused(text_to_image):
    _, pipe, params = text_to_image
    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    with pytest.raises(ValueError, match=r"'mid' matches no self-attention layer .* e\.g\. one of transformer_blocks"):
        pipe.with_hooks(perturbed_attention_guidance(3.0, "mid"))(ids, params, jax.random.PRNGKey(0),
                                                                   num_inference_steps=STEPS)


def test_attention_maps_are_the_joint_attentions_image_to_text_probabilities(text_to_image):
    """The image tokens' probabilities over the text's tokens in each joint attention (conditional rows, heads'
    mean), as a processor recording diffusers' JointAttnProcessor2_0 computes them: one layer's at every
    evaluation, and the mean over the three layers."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    theirs, pipe, params = text_to_image
    records = []

    class Recorder(JointAttnProcessor2_0):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, *args, **kwargs):
            if encoder_hidden_states is not None:
                def heads(projection, norm, x):  # (B, L, inner) -> (B, heads, L, d), normed
                    return norm(projection(x).unflatten(-1, (attn.heads, -1)).transpose(1, 2))

                q = torch.cat([heads(attn.to_q, attn.norm_q, hidden_states),
                               heads(attn.add_q_proj, attn.norm_added_q, encoder_hidden_states)], 2)
                k = torch.cat([heads(attn.to_k, attn.norm_k, hidden_states),
                               heads(attn.add_k_proj, attn.norm_added_k, encoder_hidden_states)], 2)
                probs = (q @ k.transpose(-1, -2) * attn.scale).softmax(-1)
                rows, n = hidden_states.shape[:2]
                records.append((self.name, probs[rows // 2:, :, :n, n:].mean(1).numpy()))  # conditional half
            return super().__call__(attn, hidden_states, encoder_hidden_states, *args, **kwargs)

    transformer = theirs.transformer
    default = transformer.attn_processors
    transformer.set_attn_processor({name: Recorder(name.removesuffix(".processor")) for name in default})
    try:
        theirs_latents(theirs)
    finally:
        transformer.set_attn_processor(default)
    layers = sorted({name for name, _ in records})
    assert layers == [f"transformer_blocks.{i}.attn" for i in range(3)]
    side, patch = SIZE // 8 // 2, 2

    def at_latent_size(probs):  # (B, N, S) over the 4 x 4 patches -> (B, 8, 8, S)
        maps = probs.reshape(len(probs), side, side, -1)
        return maps.repeat(patch, axis=1).repeat(patch, axis=2)

    per_eval = [dict(records[i:i + len(layers)]) for i in range(0, len(records), len(layers))]
    expected_layer = np.stack([at_latent_size(call[layers[1]]) for call in per_eval])
    expected_mean = np.stack([np.mean([at_latent_size(p) for p in call.values()], 0) for call in per_eval])
    assert expected_mean.shape == (STEPS, len(PROMPTS), SIZE // 8, SIZE // 8, 77 + T5_LENGTH)
    assert np.abs(expected_layer - expected_mean).max() > MOVES * expected_mean.max()  # the layers differ

    ids = pipe.prepare_inputs(PROMPTS, max_sequence_length=T5_LENGTH)
    neg = pipe.prepare_inputs(NEGATIVE, max_sequence_length=T5_LENGTH)
    out = pipe.with_hooks(hooks.cross_attention_maps(per_layer=True))(
        ids, params, jax.random.PRNGKey(0), num_inference_steps=STEPS, height=SIZE, width=SIZE,
        guidance_scale=GUIDANCE, neg_prompt_ids=neg, latents=latents_for())
    for ours, expected in ((out.trajectory.hooks[layers[1]], expected_layer),
                           (out.trajectory.hooks["cross_attention_maps"], expected_mean)):
        np.testing.assert_allclose(ours, expected, rtol=0, atol=RTOL * expected.max())
