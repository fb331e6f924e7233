"""sdflax's CLIP tokenizer (on the `tokenizers` library) gives transformers' CLIPTokenizer's ids and tokens, for
both pad tokens (CLIP ViT-L's <|endoftext|>, OpenCLIP's "!"), both folder layouts (vocab.json + merges.txt, and
transformers 5's tokenizer.json), added tokens, and any text; and a pipeline never imports transformers."""

import json
import subprocess
import sys

import numpy as np
import pytest
from builders import REPO, TOKENIZER
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import CLIPTokenizer as Theirs

from sdflax.loading.folders import load_tokenizer
from sdflax.models.config import ConfigError

PROMPTS = [
    "a photo of an astronaut riding a horse on mars",
    "",
    "   leading and trailing   spaces\tand\ttabs\nand newlines  ",
    "UPPER lower MiXeD, punctuation!!! (brackets) [weights:1.2] {braces} <angles>",
    "it's they're we've I'm you'll he'd don't",
    "numbers 3.14159 and 2024-11-24, 1st 22nd",
    "accents: café naïve Ünïcode façade; CJK 山水画; emoji 🐴🚀✨",
    "special tokens in text: <|startoftext|> middle <|endoftext|> end",
    "a very long prompt, " * 40,
    "masterpiece, best quality, (ultra-detailed:1.3), 8k uhd, dslr, soft lighting, film grain, Fujifilm XT3",
]
CALL = dict(padding="max_length", max_length=77, truncation=True, return_tensors="np")


@pytest.fixture(scope="module", params=["<|endoftext|>", "!"], ids=["clip-pad", "openclip-pad"])
def pair(request):
    pad = {} if request.param == "<|endoftext|>" else {"pad_token": request.param}
    return load_tokenizer(str(TOKENIZER), **pad), Theirs.from_pretrained(TOKENIZER, **pad)


def test_ids_padded_and_truncated_as_transformers(pair):
    ours, theirs = pair
    expected = theirs(PROMPTS, **CALL).input_ids
    np.testing.assert_array_equal(ours(PROMPTS, **CALL).input_ids, expected)
    assert expected.shape == (len(PROMPTS), 77) and len(theirs(PROMPTS[8]).input_ids) > 77  # one row is truncated
    assert ours.pad_token_id == theirs.pad_token_id and ours.model_max_length == theirs.model_max_length == 77
    for text in PROMPTS:  # one text, no padding or truncation: plain lists
        assert ours(text).input_ids == theirs(text).input_ids
        assert ours.tokenize(text) == theirs.tokenize(text)


# no deadline and no health check on the time examples take to draw: a slow or busy machine is no failure
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=120), min_size=1, max_size=4))
def test_any_text_gives_the_same_ids(texts):
    ours, theirs = _clip_pair()
    np.testing.assert_array_equal(ours(texts, **CALL).input_ids, theirs(texts, **CALL).input_ids)
    assert ours.tokenize(texts[0]) == theirs.tokenize(texts[0])


_PAIR = []


def _clip_pair():
    if not _PAIR:
        _PAIR.append((load_tokenizer(str(TOKENIZER)), Theirs.from_pretrained(TOKENIZER)))
    return _PAIR[0]


def test_a_transformers_5_tokenizer_json_folder(tmp_path):
    theirs = Theirs.from_pretrained(TOKENIZER, pad_token="!")
    theirs.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file() and not (tmp_path / "vocab.json").exists()
    ours = load_tokenizer(str(tmp_path))
    np.testing.assert_array_equal(ours(PROMPTS, **CALL).input_ids, theirs(PROMPTS, **CALL).input_ids)
    assert ours.pad_token_id == 0  # "!" from tokenizer_config.json


def test_added_tokens_as_transformers():
    ours, theirs = load_tokenizer(str(TOKENIZER)), Theirs.from_pretrained(TOKENIZER)
    new = ["<Cat-Toy>", "<cat-toy>_1", "<cat-toy>_2", "photo</w>"]
    assert ours.add_tokens(new) == theirs.add_tokens(new)  # "photo</w>" is in CLIP's vocabulary already
    text = ["a <Cat-Toy> and <cat-toy>_1 <cat-toy>_2 on a <CAT-TOY>, photo style", "<cat-toy>_12 x"]
    np.testing.assert_array_equal(ours(text, **CALL).input_ids, theirs(text, **CALL).input_ids)
    assert ours.tokenize(text[0]) == theirs.tokenize(text[0])
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs) > 49408
    assert ours.added_tokens_encoder == theirs.added_tokens_encoder
    assert ours.convert_tokens_to_ids(new + ["not-a-token</w>"]) == theirs.convert_tokens_to_ids(
        new + ["not-a-token</w>"])


def test_damaged_or_oversized_files_are_one_config_error(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps({"a": 0}))
    (folder / "merges.txt").write_text("#version: 0.2\nq q q\n")
    with pytest.raises(ConfigError, match="cannot build a CLIP tokenizer"):
        load_tokenizer(str(folder))
    (folder / "merges.txt").write_text("")
    with open(folder / "vocab.json", "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: no disk used
    with pytest.raises(ConfigError, match="more than a CLIP tokenizer's"):
        load_tokenizer(str(folder))


IMPORTS = r"""
import sys
from sdflax import StableDiffusion
pipeline, params = StableDiffusion.from_pretrained(sys.argv[1])
ids = pipeline.prepare_inputs(["a photo"])
print(sorted(m for m in ("transformers", "torch") if m in sys.modules))
"""


def test_a_pipeline_never_imports_transformers(tmp_path):
    out = subprocess.run([sys.executable, "-c", IMPORTS, str(REPO / "weights" / "tiny-sd")], capture_output=True,
                         text=True, check=True, env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu",
                                                     "PYTHONPATH": str(REPO), "SDFLAX_CACHE_DIR": str(tmp_path)})
    assert out.stdout.strip().splitlines()[-1] == "[]"
