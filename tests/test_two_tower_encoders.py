"""Two-tower checkpoints as users point IP-Adapters and Redux at them (openai/clip-vit-large-patch14, a CLIPModel;
google/siglip-so400m-patch14-384, a SiglipModel): sdflax's image encoders read the vision tower out of them, its
config from `vision_config`, the text tower's tensors skipped, as transformers' CLIPVisionModelWithProjection and
SiglipVisionModel.from_pretrained do from the same folder."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from builders import randomize_norms
from safetensors.numpy import load_file

from sdflax import CLIPVisionModelWithProjection, SiglipVisionModel

RTOL = 1e-4  # float32, of the output's largest magnitude
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
              patch_size=14, hidden_act="gelu", projection_dim=20)  # a CLIPConfig's vision_config carries its own
TEXT = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, vocab_size=100,
            max_position_embeddings=16)


@pytest.fixture(scope="module", params=["clip", "siglip"])
def two_towers(request, tmp_path_factory):
    """(our class, transformers' vision class, the folder of a two-tower model saved by transformers)."""
    import transformers as t

    two, config, theirs, ours = {
        "clip": (t.CLIPModel, t.CLIPConfig(vision_config=VISION, text_config=TEXT, projection_dim=20),
                 t.CLIPVisionModelWithProjection, CLIPVisionModelWithProjection),
        "siglip": (t.SiglipModel, t.SiglipConfig(vision_config=VISION, text_config=TEXT), t.SiglipVisionModel,
                   SiglipVisionModel)}[request.param]
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp(request.param)
    randomize_norms(two(config), seed=1).eval().save_pretrained(folder)
    return ours, theirs, folder


def test_the_vision_tower_loads_as_transformers_reads_it(two_towers):
    ours, theirs_class, folder = two_towers
    assert any(key.startswith("text_model.") for key in load_file(folder / "model.safetensors"))  # both towers
    theirs = theirs_class.from_pretrained(folder).eval()
    model, params = ours.from_pretrained(folder)
    pixels = np.random.default_rng(0).standard_normal((2, 3, 28, 28), dtype=np.float32)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(pixels), output_hidden_states=True)
    out = jax.jit(lambda p, x: model.apply(p, x, output_hidden_states=True))(params, pixels)
    names = ["last_hidden_state", "image_embeds" if hasattr(out, "image_embeds") else "pooler_output"]
    for name in names:
        want = getattr(expected, name).numpy()
        np.testing.assert_allclose(np.asarray(getattr(out, name)), want, rtol=0, atol=RTOL * np.abs(want).max())
    want = expected.hidden_states[-2].numpy()  # the penultimate layer's states, which IP-Adapter Plus reads
    np.testing.assert_allclose(np.asarray(out.hidden_states[-2]), want, rtol=0, atol=RTOL * np.abs(want).max())

