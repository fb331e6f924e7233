"""Textual-inversion embeddings in the A1111 and diffusers formats, against diffusers' load_textual_inversion."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from builders import torch_pipeline
from safetensors.torch import save_file

import jax

from sdflax import StableDiffusion
from sdflax.loading.embeddings import load_textual_inversion

ATOL = 1e-5  # text encoder states, float32 (the per-module tolerance of test_models.py)
VOCAB = 49408


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    saved = {}

    def get(arch):
        if arch not in saved:
            folder = tmp_path_factory.mktemp(arch)
            theirs = torch_pipeline(arch)
            theirs.save_pretrained(folder)
            saved[arch] = theirs, folder
        return saved[arch]

    return get


def write(path, fmt, vectors, token):
    """One embedding file as each tool writes it; `vectors` (n, D)."""
    if fmt == "a1111.pt":
        torch.save({"string_to_token": {"*": 265}, "string_to_param": {"*": vectors.clone().requires_grad_(True)},
                    "name": token, "step": 3000, "sd_checkpoint": "abcdef12", "sd_checkpoint_name": "model"}, path)
    elif fmt == "a1111.safetensors":
        save_file({"emb_params": vectors.contiguous()}, path)
    elif fmt == "diffusers.safetensors":
        save_file({token: vectors[0].contiguous() if len(vectors) == 1 else vectors.contiguous()}, path)
    elif fmt == "diffusers.bin":
        torch.save({token: vectors[0] if len(vectors) == 1 else vectors}, path)


FORMATS = {  # format -> (file name, vectors)
    "a1111.pt": ("embedding.pt", 3),
    "a1111.safetensors": ("embedding.safetensors", 2),
    "diffusers.safetensors": ("learned_embeds.safetensors", 1),
    "diffusers.bin": ("learned_embeds.bin", 1),
}


@pytest.mark.parametrize("arch, fmt", [("sd1", fmt) for fmt in FORMATS] + [("sd2", "a1111.pt")])
def test_embedding_matches_diffusers(folders, tmp_path, arch, fmt):
    theirs, folder = folders(arch)
    theirs = copy.deepcopy(theirs)  # load_textual_inversion changes the tokenizer and text encoder
    pipe, params = StableDiffusion.from_pretrained(folder)
    name, count = FORMATS[fmt]
    width = pipe.text_encoder.config.hidden_size
    vectors = torch.randn((count, width), generator=torch.Generator().manual_seed(count))
    token = "<sks-toy>"
    write(tmp_path / name, fmt, vectors, token)

    given = pipe
    pipe, ours = pipe.load_textual_inversion(params, tmp_path / name, token=token)
    theirs.load_textual_inversion(str(tmp_path / name), token=token)
    assert len(given.tokenizer) == given.text_encoder.config.vocab_size == VOCAB  # a new pipeline; this one as it was

    # Exactly the new rows are added, the old table and every other parameter unchanged.
    table = np.asarray(ours["text_encoder"]["embeddings_token_embedding"]["embedding"])
    assert table.shape == (VOCAB + count, width) and pipe.text_encoder.config.vocab_size == VOCAB + count
    np.testing.assert_array_equal(table[:VOCAB], params["text_encoder"]["embeddings_token_embedding"]["embedding"])
    np.testing.assert_array_equal(table[VOCAB:], vectors.numpy())
    flat = lambda p: jax.tree.leaves({k: v for k, v in p.items() if k != "text_encoder"})  # noqa: E731
    assert all(a is b for a, b in zip(flat(ours), flat(params)))
    np.testing.assert_array_equal(table, theirs.text_encoder.get_input_embeddings().weight.detach().numpy())

    # The token (all its vectors) tokenizes to the new ids, as diffusers' maybe_convert_prompt makes it.
    prompts = [f"a photo of {token} on a beach", "no token here", f"{token} and {token}, twice"]
    ids = pipe.prepare_inputs(prompts)
    expected_ids = theirs.tokenizer(theirs.maybe_convert_prompt(prompts, theirs.tokenizer), padding="max_length",
                                    max_length=77, truncation=True, return_tensors="np").input_ids
    np.testing.assert_array_equal(ids, expected_ids)
    new_ids = list(range(VOCAB, VOCAB + count))
    row = list(ids[0])
    assert row[row.index(VOCAB): row.index(VOCAB) + count] == new_ids
    assert not set(new_ids) & set(ids[1])

    with torch.no_grad():
        expected = theirs.text_encoder(torch.from_numpy(expected_ids)).last_hidden_state.numpy()
    np.testing.assert_allclose(pipe.encode_prompt(ours, ids), expected, rtol=0, atol=ATOL)
    zeroed = {**ours, "text_encoder": {**ours["text_encoder"], "embeddings_token_embedding": {
        "embedding": ours["text_encoder"]["embeddings_token_embedding"]["embedding"].at[VOCAB:].set(0)}}}
    assert np.abs(pipe.encode_prompt(ours, ids[:1]) - pipe.encode_prompt(zeroed, ids[:1])).max() > 1e-2  # rows used


def test_token_name_from_the_file_and_two_embeddings(folders, tmp_path):
    theirs, folder = folders("sd1")
    pipe, params = StableDiffusion.from_pretrained(folder)
    width = pipe.text_encoder.config.hidden_size
    first, second = torch.randn(1, width), torch.randn(2, width)
    write(tmp_path / "learned_embeds.safetensors", "diffusers.safetensors", first, "<cat-toy>")
    write(tmp_path / "charturner.pt", "a1111.pt", second, "ignored-name")
    pipe, params = pipe.load_textual_inversion(params, tmp_path / "learned_embeds.safetensors")  # its key: <cat-toy>
    pipe, params = pipe.load_textual_inversion(params, tmp_path / "charturner.pt")  # A1111: the file name
    ids = pipe.prepare_inputs(["<cat-toy> by charturner"])[0]
    assert list(ids[1:2]) == [VOCAB] and list(ids[3:5]) == [VOCAB + 1, VOCAB + 2]
    table = params["text_encoder"]["embeddings_token_embedding"]["embedding"]
    np.testing.assert_array_equal(table[VOCAB:], torch.cat([first, second]).numpy())
    states = pipe.encode_prompt(params, pipe.prepare_inputs(["<cat-toy> by charturner"]))
    assert states.shape == (1, 77, width) and np.isfinite(states).all()


def test_errors(folders, tmp_path):
    theirs, folder = folders("sd1")
    pipe, params = StableDiffusion.from_pretrained(folder)
    width = pipe.text_encoder.config.hidden_size
    write(tmp_path / "a.safetensors", "diffusers.safetensors", torch.randn(1, width), "<a>")
    pipe, params = pipe.load_textual_inversion(params, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="already in the tokenizer"):
        pipe.load_textual_inversion(params, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="already in the tokenizer"):
        pipe.load_textual_inversion(params, tmp_path / "a.safetensors", token="photo")  # a word of the vocab
    write(tmp_path / "wide.safetensors", "diffusers.safetensors", torch.randn(1, width + 1), "<w>")
    with pytest.raises(ValueError, match=f"{width + 1} dimensions"):
        pipe.load_textual_inversion(params, tmp_path / "wide.safetensors")
    save_file({"clip_l": torch.randn(1, 768), "clip_g": torch.randn(1, 1280)}, tmp_path / "sdxl.safetensors")
    with pytest.raises(ValueError, match="SDXL"):
        pipe.load_textual_inversion(params, tmp_path / "sdxl.safetensors")


def test_new_parts_and_params_the_given_ones_unchanged(folders, tmp_path):
    _, folder = folders("sd1")
    pipe, params = StableDiffusion.from_pretrained(folder)
    width = pipe.text_encoder.config.hidden_size
    write(tmp_path / "a.safetensors", "diffusers.safetensors", torch.randn(2, width), "<a>")
    tokenizer, text_encoder, table = pipe.tokenizer, pipe.text_encoder, params["text_encoder"]
    vocab, config = tokenizer.get_vocab(), text_encoder.config
    parts, new_params = load_textual_inversion(vars(pipe), params, tmp_path / "a.safetensors")

    assert set(parts) == {"tokenizer", "text_encoder"}
    assert len(parts["tokenizer"]) == parts["text_encoder"].config.vocab_size == VOCAB + 2
    assert parts["tokenizer"].convert_tokens_to_ids(["<a>", "<a>_1"]) == [VOCAB, VOCAB + 1]
    assert tokenizer.get_vocab() == vocab and "<a>" not in tokenizer.get_vocab()  # the given tokenizer as it was
    assert text_encoder.config is config and config.vocab_size == VOCAB  # and the given module
    assert pipe.tokenizer is tokenizer and pipe.text_encoder is text_encoder
    assert params["text_encoder"] is table and table["embeddings_token_embedding"]["embedding"].shape[0] == VOCAB
    assert new_params["unet"] is params["unet"] and new_params["vae"] is params["vae"]


def test_zip_damage_in_an_a1111_embedding_is_one_line(tmp_path):
    """A damaged .pt was a BadZipFile or RuntimeError traceback (from the embedding's own zip reader, now the
    checkpoints' one)."""
    from sdflax.loading.files import CheckpointFileError
    from sdflax.loading.embeddings import read_embedding

    write(tmp_path / "good.pt", "a1111.pt", torch.arange(6.0).reshape(2, 3), "fox")
    data = (tmp_path / "good.pt").read_bytes()
    np.testing.assert_array_equal(read_embedding(tmp_path / "good.pt")[1], np.arange(6.0).reshape(2, 3))
    central = data.index(b"PK\x01\x02")  # data.pkl's central directory entry: set its "encrypted" flag
    encrypted = bytearray(data)
    encrypted[central + 8] |= 1
    damaged = {"truncated.pt": data[: len(data) // 2], "encrypted.pt": bytes(encrypted),
               "cut-directory.pt": data[:central] + data[central + 20:]}
    for name, content in damaged.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointFileError) as info:
            read_embedding(tmp_path / name)
        assert "\n" not in str(info.value) and name in str(info.value), str(info.value)
