"""T5EncoderModel (SD 3.5's third text encoder) against transformers' on a small random T5 v1.1, from one file and
from shards, with padding and texts longer than the relative positions' max distance; the position buckets against
transformers' own function; and the T5 tokenizer against transformers' T5TokenizerFast on a small Unigram vocabulary."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from builders import T5_PIECES, t5_tokenizer_folder
from safetensors.numpy import load_file, save_file

from sdflax import T5EncoderModel
from sdflax.models.config import ConfigError
from sdflax.models.t5 import T5Config, relative_position_buckets
from sdflax.loading.tokenizers import T5Tokenizer

RTOL, ATOL = 1e-4, 1e-5
PIECES = T5_PIECES
SMALL_T5 = dict(vocab_size=len(PIECES), d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2,
                relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu")
PROMPTS = ["a photo of an astronaut riding a horse on mars", "", "  the   dog  on mars ", "café 123 naïve ünicode",
           "special in text: </s> and <pad> end", "a red cat, " * 12, "blue"]


@pytest.fixture(scope="module")
def theirs():
    from transformers import T5Config as TheirConfig
    from transformers import T5EncoderModel as Theirs

    torch.manual_seed(0)
    model = Theirs(TheirConfig(**SMALL_T5)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms start at 1: random ones show a missing or misplaced scale
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "relative_attention_bias" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def folders(theirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    theirs.save_pretrained(root / "single")
    theirs.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert os.path.isfile(root / "sharded" / "model.safetensors.index.json")
    # Some writers keep the tied embedding under encoder.embed_tokens.weight instead of shared.weight, some under
    # both (then shared.weight counts, as in transformers).
    tensors = load_file(root / "single" / "model.safetensors")
    shared = tensors.pop("shared.weight")
    for layout, extra in [("tied_copy", {"encoder.embed_tokens.weight": shared}),
                          ("tied_both", {"shared.weight": shared, "encoder.embed_tokens.weight": 0 * shared})]:
        (root / layout).mkdir()
        save_file({**tensors, **extra}, root / layout / "model.safetensors")
        (root / layout / "config.json").write_text((root / "single" / "config.json").read_text())
    return root


def token_ids():
    """Two rows of 160 tokens (past the 128 max distance): a long text, and a short one padded with <pad> (0)."""
    ids = np.zeros((2, 160), np.int64)
    ids[0, :150] = np.random.default_rng(0).integers(3, len(PIECES), 150)
    ids[0, 150] = 1
    ids[1, :20] = np.random.default_rng(1).integers(3, len(PIECES), 20)
    ids[1, 20] = 1
    return ids


@pytest.mark.parametrize("layout", ["single", "sharded", "tied_copy", "tied_both"])
def test_encoder_matches_transformers(theirs, folders, layout):
    model, params = T5EncoderModel.from_pretrained(folders / layout)
    assert model.config == T5Config(**SMALL_T5) and model.config.dense_act_fn == "gelu_new"
    assert params["encoder_block_0"]["layer_0_SelfAttention_relative_attention_bias"]["embedding"].shape == (32, 4)
    assert "layer_0_SelfAttention_relative_attention_bias" not in params["encoder_block_1"]
    ids = token_ids()
    mask = (np.arange(160)[None] <= np.array([[150], [20]])).astype(np.int64)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(ids)).last_hidden_state.numpy()
        expected_masked = theirs(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
    apply = jax.jit(model.apply)
    ours = apply(params, ids)
    assert ours.shape == (2, 160, 32) and ours.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(apply(params, ids, mask)), expected_masked.numpy(), rtol=RTOL, atol=ATOL)


def test_bfloat16_close_to_float32(folders):
    model, params = T5EncoderModel.from_pretrained(folders / "single", dtype=jnp.bfloat16)
    model32, params32 = T5EncoderModel.from_pretrained(folders / "single")
    ids = token_ids()
    ours = jax.jit(model.apply)(params, ids)
    reference = np.asarray(jax.jit(model32.apply)(params32, ids))
    assert ours.dtype == jnp.bfloat16
    assert np.abs(np.asarray(ours, np.float32) - reference).max() < 0.05 * np.abs(reference).max()


@pytest.mark.parametrize("buckets, max_distance", [(32, 128), (8, 20), (6, 7)])
def test_position_buckets_match_transformers(buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    positions = torch.arange(300)
    expected = T5Attention._relative_position_bucket(positions[None, :] - positions[:, None], True, buckets,
                                                     max_distance)
    np.testing.assert_array_equal(relative_position_buckets(300, 300, buckets, max_distance), expected.numpy())


def test_config_reads_transformers_files():
    assert T5Config.from_dict({"feed_forward_proj": "gated-gelu"}).dense_act_fn == "gelu_new"
    relu = T5Config.from_dict({})
    assert (relu.dense_act_fn, relu.is_gated_act) == ("relu", False)
    assert T5Config.from_dict({"feed_forward_proj": "gated-silu"}).dense_act_fn == "silu"
    assert T5Config.from_dict({"feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu"}).dense_act_fn == "gelu"
    for bad, message in [({"feed_forward_proj": "gated-swish-x"}, "is not '<activation>'"),
                         ({"feed_forward_proj": "dense-relu"}, "is not '<activation>'"),
                         ({"feed_forward_proj": "gated-tanh"}, "activation 'tanh'"),
                         ({"relative_attention_num_buckets": 2}, "need at least 4 buckets"),
                         ({"relative_attention_max_distance": 8}, "a distance over a quarter of them"),
                         ({"d_model": 0}, "d_model=0: sizes must be positive"),
                         ({"num_heads": 0}, "expected a positive value")]:
        with pytest.raises(ConfigError, match=message) as error:
            T5Config.from_dict(bad)
        assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    return t5_tokenizer_folder(tmp_path_factory.mktemp("tokenizer_3"))


@pytest.mark.parametrize("max_length", [16, 1, 64])
def test_tokenizer_ids_as_transformers(tokenizer_folder, max_length):
    from transformers import T5TokenizerFast

    theirs = T5TokenizerFast(tokenizer_file=str(tokenizer_folder / "tokenizer.json"))
    ours = T5Tokenizer.from_folder(tokenizer_folder)
    expected = theirs(PROMPTS, padding="max_length", max_length=max_length, truncation=True,
                      return_tensors="np").input_ids
    ids = ours(PROMPTS, max_length)
    assert ids.dtype == np.int32 and ids.shape == (len(PROMPTS), max_length)
    np.testing.assert_array_equal(ids, expected)
    assert len(theirs(PROMPTS[5]).input_ids) == 50  # truncated at 16 and 1, its </s> kept last; padded at 64
    assert ids[5, -1] == (1 if max_length < 50 else 0)
    np.testing.assert_array_equal(ours(PROMPTS[0], max_length), ids[:1])
    # transformers 5's from_pretrained rebuilds the pipeline, splitting on whitespace first (it drops a trailing
    # space's "▁" and one before a special token): the same ids for plain prompts.
    plain = [PROMPTS[0], PROMPTS[1], PROMPTS[5].strip(), PROMPTS[6]]
    from_folder = T5TokenizerFast.from_pretrained(tokenizer_folder)(
        plain, padding="max_length", max_length=max_length, truncation=True, return_tensors="np").input_ids
    np.testing.assert_array_equal(ours(plain, max_length), from_folder)


def test_tokenizer_bad_input(tokenizer_folder, tmp_path):
    ours = T5Tokenizer.from_folder(tokenizer_folder)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_length=.*positive int"):
            ours(["a cat"], bad)
    with pytest.raises(TypeError, match="a string or a list of strings"):
        ours([b"a cat"], 8)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        T5Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot build a tokenizer from it") as error:
        T5Tokenizer.from_folder(tmp_path)
    assert "\n" not in str(error.value)
    data = json.loads((tokenizer_folder / "tokenizer.json").read_text())
    data["added_tokens"] = []
    data["model"]["vocab"] = [piece for piece in data["model"]["vocab"] if piece[0] != "</s>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError) as error:  # the message named no file
        T5Tokenizer.from_folder(tmp_path)
    assert str(error.value) == (f"{tmp_path / 'tokenizer.json'} has no '</s>' token: not a T5 tokenizer (T5's "
                                "tokenizer.json holds '</s>' and '<pad>', as SD 3.5's tokenizer_3 ships it)")


def test_a_folder_without_t5s_tokenizer_json_names_it(tmp_path):
    """SD 3's tokenizer_3 is T5's: it needs tokenizer.json (vocab.json + merges.txt were asked for, CLIP's files);
    CLIP's tokenizer folders take either layout."""
    from sdflax.loading.folders import missing_pipeline_files

    for name in ("tokenizer", "tokenizer_3"):
        (tmp_path / name).mkdir()
        for file in ("vocab.json", "merges.txt"):
            (tmp_path / name / file).write_text("{}")
    missing = missing_pipeline_files(tmp_path, (), ("tokenizer", "tokenizer_3"), t5_tokenizers=("tokenizer_3",))
    assert missing[-1:] == ["tokenizer_3/tokenizer.json (T5's tokenizer, as transformers saves it)"]
    assert not [m for m in missing if m.startswith("tokenizer/")]


def test_relu_encoder_matches_transformers(tmp_path):
    """T5 v1.0's feed-forward: one `wi`, ReLU."""
    from transformers import T5Config as TheirConfig
    from transformers import T5EncoderModel as Theirs

    torch.manual_seed(2)
    theirs = Theirs(TheirConfig(**{**SMALL_T5, "feed_forward_proj": "relu", "num_layers": 1})).eval()
    theirs.save_pretrained(tmp_path)
    model, params = T5EncoderModel.from_pretrained(tmp_path)
    assert set(params["encoder_block_0"]) >= {"layer_1_DenseReluDense_wi", "layer_1_DenseReluDense_wo"}
    ids = token_ids()
    with torch.no_grad():
        expected = theirs(torch.from_numpy(ids)).last_hidden_state.numpy()
    np.testing.assert_allclose(np.asarray(jax.jit(model.apply)(params, ids)), expected, rtol=RTOL, atol=ATOL)
