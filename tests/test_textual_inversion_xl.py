"""SDXL textual-inversion embeddings (clip_l for the first text encoder, clip_g for the second), against diffusers'
load_textual_inversion called once per encoder, as diffusers documents for SDXL files."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from builders import torch_xl_pipeline
from safetensors.torch import load_file, save_file

import jax

from sdflax import StableDiffusionXL

ATOL = 1e-5  # text encoder states, float32 (as test_textual_inversion.py)
VOCAB = 49408
TOKEN = "<sks-toy>"
PROMPTS = [f"a photo of {TOKEN} on a beach", "no token here", f"{TOKEN} and {TOKEN}, twice"]
ENCODERS = {"clip_l": ("tokenizer", "text_encoder"), "clip_g": ("tokenizer_2", "text_encoder_2")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl")
    theirs = torch_xl_pipeline()
    theirs.save_pretrained(folder)
    return theirs, folder


@pytest.fixture
def fresh(saved):
    """Both pipelines anew: loading an embedding changes diffusers' tokenizers and text encoders."""
    theirs, folder = saved
    return (copy.deepcopy(theirs), *StableDiffusionXL.from_pretrained(folder))


def write(path, count, widths=(32, 32), keys=("clip_l", "clip_g")):
    g = torch.Generator().manual_seed(count)
    save_file({key: torch.randn((count, width), generator=g) for key, width in zip(keys, widths)}, path)
    return load_file(path)


def tables(params):
    return {key: np.asarray(params[encoder]["embeddings_token_embedding"]["embedding"])
            for key, (_, encoder) in ENCODERS.items()}


@pytest.mark.parametrize("count", [1, 3])
def test_embedding_matches_diffusers_in_both_encoders(fresh, tmp_path, count):
    theirs, pipe, params = fresh
    state = write(tmp_path / "embedding.safetensors", count)
    pipe, ours = pipe.load_textual_inversion(params, tmp_path / "embedding.safetensors", token=TOKEN)
    for key, (tokenizer, encoder) in ENCODERS.items():
        theirs.load_textual_inversion(state[key], token=TOKEN, tokenizer=getattr(theirs, tokenizer),
                                      text_encoder=getattr(theirs, encoder))

    # Each table gains exactly its tensor's rows; the other parameters are the same objects.
    for key, table in tables(ours).items():
        tokenizer, encoder = ENCODERS[key]
        assert table.shape == (VOCAB + count, 32) and getattr(pipe, encoder).config.vocab_size == VOCAB + count
        np.testing.assert_array_equal(table[:VOCAB], tables(params)[key][:VOCAB])
        np.testing.assert_array_equal(table[VOCAB:], state[key].numpy())
        np.testing.assert_array_equal(table, getattr(theirs, encoder).get_input_embeddings().weight.detach().numpy())
    assert all(a is b for a, b in zip(jax.tree.leaves([ours["unet"], ours["vae"]]),
                                      jax.tree.leaves([params["unet"], params["vae"]])))

    # Both tokenizers' ids expand the token to all its vectors, as diffusers' maybe_convert_prompt does.
    ids = pipe.prepare_inputs(PROMPTS)
    for row, (tokenizer, _) in enumerate(ENCODERS.values()):
        tok = getattr(theirs, tokenizer)
        expected = tok(theirs.maybe_convert_prompt(PROMPTS, tok), padding="max_length", max_length=77,
                       truncation=True, return_tensors="np").input_ids
        np.testing.assert_array_equal(ids[:, row], expected)
        first = list(ids[0, row])
        assert first[first.index(VOCAB): first.index(VOCAB) + count] == list(range(VOCAB, VOCAB + count))

    # The text conditioning (states of both encoders and the pooled output) equals diffusers' encode_prompt.
    with torch.no_grad():
        states, _, pooled, _ = theirs.encode_prompt(PROMPTS, device="cpu", do_classifier_free_guidance=False)
    ours_states, ours_pooled = pipe.encode_prompt(ours, ids)
    np.testing.assert_allclose(ours_states, states.numpy(), rtol=0, atol=ATOL)
    np.testing.assert_allclose(ours_pooled, pooled.numpy(), rtol=0, atol=ATOL)
    zeroed = {**ours, **{encoder: {**ours[encoder], "embeddings_token_embedding": {"embedding": jax.numpy.asarray(
        tables(ours)[key]).at[VOCAB:].set(0)}} for key, (_, encoder) in ENCODERS.items()}}
    for a, b in zip(pipe.encode_prompt(ours, ids[:1]), pipe.encode_prompt(zeroed, ids[:1])):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-2  # the new rows are used


def test_token_from_the_file_name(fresh, tmp_path):
    _, pipe, params = fresh
    write(tmp_path / "charturner.safetensors", 2)
    pipe, _ = pipe.load_textual_inversion(params, tmp_path / "charturner.safetensors")
    ids = pipe.prepare_inputs(["by charturner"])[0]
    assert list(ids[0, 2:4]) == list(ids[1, 2:4]) == [VOCAB, VOCAB + 1]


def test_bad_files_are_one_clear_line(fresh, tmp_path):
    _, pipe, params = fresh
    cases = {
        "only_g.safetensors": (dict(keys=("clip_g",)), "has no clip_l tensor"),
        "only_l.safetensors": (dict(keys=("clip_l",)), "has no clip_g tensor"),
        "wide.safetensors": (dict(widths=(32, 33)), "clip_g has vectors of 33 dimensions but text_encoder_2's have 32"),
        "sd.safetensors": (dict(keys=("emb_params",)), "not an SDXL textual-inversion embedding"),
    }
    for name, (kwargs, message) in cases.items():
        write(tmp_path / name, 1, **kwargs)
        with pytest.raises(ValueError, match=message) as error:
            pipe.load_textual_inversion(params, tmp_path / name, token="<bad>")
        assert "\n" not in str(error.value)
    save_file({"clip_l": torch.zeros(1, 32), "clip_g": torch.zeros(2, 32)}, tmp_path / "counts.safetensors")
    with pytest.raises(ValueError, match="clip_l has 1 vectors but clip_g 2"):
        pipe.load_textual_inversion(params, tmp_path / "counts.safetensors")
    # nothing was added by the files that failed (the first tokenizer's checks passed for "wide")
    assert len(pipe.tokenizer) == len(pipe.tokenizer_2) == VOCAB and pipe.text_encoder.config.vocab_size == VOCAB
