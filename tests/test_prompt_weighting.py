"""A1111's prompt syntax (`prepare_inputs(prompts, weighting="a1111")`) against A1111's algorithm, re-implemented
here on transformers' CLIP as its FrozenCLIPEmbedder runs it (modules/prompt_parser.py, sd_hijack_clip.py); the
pipelines' images with the weights against diffusers' given those states; `clip_skip` against diffusers'."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from builders import saved, torch_pipeline, torch_xl_pipeline

import jax

from sdflax import StableDiffusion, StableDiffusionXL
from sdflax.pipeline.prompt_weighting import parse_prompt_attention

STATES_TOL = 1e-5
IMAGE_ATOL = 1e-3
WORDS = "red, green, blue, (yellow:1.3), violet, [grey], black, white, a (big (old:1.2)) house on a hill"
PROMPTS = ["a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",  # nesting: A1111's own example
           "a \\(literal\\) \\[word\\] (kept) [out]",  # escapes
           "a red car BREAK (a blue sky:1.4)",  # BREAK ends a chunk
           "one two three four five " + ", ".join([WORDS] * 9)]  # 220 tokens: four chunks, cut at commas


# ---- A1111's algorithm, as its code runs it --------------------------------------------------------------------
A1111_ATTENTION = re.compile(r"\\\(|\\\)|\\\[|\\]|\\\\|\\|\(|\[|:([+-]?[.\d]+)\)|\)|]|[^\\()\[\]:]+|:")
A1111_BREAK = re.compile(r"\s*\bBREAK\b\s*", re.S)


def a1111_parse(text):
    res, round_brackets, square_brackets = [], [], []

    def multiply_range(start, multiplier):
        for p in range(start, len(res)):
            res[p][1] *= multiplier

    for m in A1111_ATTENTION.finditer(text):
        text, weight = m.group(0), m.group(1)
        if text.startswith("\\"):
            res.append([text[1:], 1.0])
        elif text == "(":
            round_brackets.append(len(res))
        elif text == "[":
            square_brackets.append(len(res))
        elif weight is not None and round_brackets:
            multiply_range(round_brackets.pop(), float(weight))
        elif text == ")" and round_brackets:
            multiply_range(round_brackets.pop(), 1.1)
        elif text == "]" and square_brackets:
            multiply_range(square_brackets.pop(), 1 / 1.1)
        else:
            for i, part in enumerate(re.split(A1111_BREAK, text)):
                if i > 0:
                    res.append(["BREAK", -1])
                res.append([part, 1.0])
    for pos in round_brackets:
        multiply_range(pos, 1.1)
    for pos in square_brackets:
        multiply_range(pos, 1 / 1.1)
    if not res:
        res = [["", 1.0]]
    i = 0
    while i + 1 < len(res):
        if res[i][1] == res[i + 1][1]:
            res[i][0] += res[i + 1][0]
            res.pop(i + 1)
        else:
            i += 1
    return res


def a1111_chunks(tokenizer, line, chunk_length=75, backtrack=20):
    """tokenize_line: [(tokens, multipliers)] of 77 each, padded with the end token (then the pad token after the
    first end token, as process_tokens does for SD 2)."""
    parsed = a1111_parse(line)
    tokenized = tokenizer([text for text, _ in parsed], truncation=False, add_special_tokens=False)["input_ids"]
    comma = tokenizer.get_vocab()[",</w>"]
    start, end, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    chunks, state = [], {"tokens": [], "mults": [], "last_comma": -1}

    def next_chunk():
        to_add = chunk_length - len(state["tokens"])
        tokens = [start] + state["tokens"] + [end] * max(to_add, 0) + [end]
        first_end = tokens.index(end)
        tokens = tokens[:first_end + 1] + [pad] * (len(tokens) - first_end - 1)
        chunks.append((tokens, [1.0] + state["mults"] + [1.0] * max(to_add, 0) + [1.0]))
        state.update(tokens=[], mults=[], last_comma=-1)

    for tokens, (text, weight) in zip(tokenized, parsed):
        if text == "BREAK" and weight == -1:
            next_chunk()
            continue
        for token in tokens:
            if token == comma:
                state["last_comma"] = len(state["tokens"])
            elif len(state["tokens"]) == chunk_length and state["last_comma"] != -1 and \
                    len(state["tokens"]) - state["last_comma"] <= backtrack:
                cut = state["last_comma"] + 1
                moved = state["tokens"][cut:], state["mults"][cut:]
                state["tokens"], state["mults"] = state["tokens"][:cut], state["mults"][:cut]
                next_chunk()
                state["tokens"], state["mults"] = list(moved[0]), list(moved[1])
            if len(state["tokens"]) == chunk_length:
                next_chunk()
            state["tokens"].append(token)
            state["mults"].append(weight)
    if state["tokens"] or not chunks:
        next_chunk()
    return chunks


def a1111_states(tokenizer, encode, line, chunks=None):
    """forward + process_tokens for one prompt: each chunk encoded, weighted, its mean restored; hstacked.
    `encode`: ids -> (states, pooled or None). Returns (states, pooled of the first chunk)."""
    made = a1111_chunks(tokenizer, line)
    made += [a1111_chunks(tokenizer, "")[0]] * ((chunks or len(made)) - len(made))  # A1111's empty chunks
    zs, pooled = [], None
    for tokens, multipliers in made:
        with torch.no_grad():
            z, pool = encode(torch.tensor([tokens]))
        pooled = pool if pooled is None else pooled
        original_mean = z.mean()
        z = z * torch.tensor([multipliers]).reshape(1, -1, 1).expand(z.shape)
        zs.append(z * (original_mean / z.mean()))
    return torch.hstack(zs).numpy()[0], pooled


# ---- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    return saved(torch_pipeline("sd1"), tmp_path_factory.mktemp("sd"), StableDiffusion)


@pytest.fixture(scope="module")
def xl(tmp_path_factory):
    return saved(torch_xl_pipeline(force_zeros_for_empty_prompt=False), tmp_path_factory.mktemp("xl"),
                 StableDiffusionXL)


def test_parse_is_a1111s():
    texts = [*PROMPTS, "(unbalanced", "(unnecessary)(parens)", "a BREAK BREAK b", "(a BREAK b)", "[[x]] (y:0.5)", ""]
    for text in texts:
        assert [list(piece) for piece in parse_prompt_attention(text)] == a1111_parse(text), text
    assert parse_prompt_attention("a (((house:1.3)) [on]") == [("a ", 1.0), ("house", 1.3 * 1.1 * 1.1), (" ", 1.1),
                                                                ("on", 1.0)]
    with pytest.raises(ValueError, match=r"gives the weight '1\.2\.3', not a number: write \(words:1\.2\)"):
        parse_prompt_attention("(a:1.2.3)")


def test_sd_states_are_a1111s(sd):
    """Each prompt's weighted states (its chunks; the batch's padding: A1111's empty chunks) at 1e-5, the ids and
    weights A1111's; the weights move them."""
    theirs, pipe, params = sd
    ids, weights = pipe.prepare_inputs(PROMPTS, weighting="a1111")
    counts = [len(a1111_chunks(theirs.tokenizer, p)) for p in PROMPTS]
    assert counts == [1, 1, 2, 4] and ids.shape == weights.shape == (4, 4 * 77)
    encode = jax.jit(pipe.encode_prompt)
    ours, plain = np.asarray(encode(params, ids, weights)), np.asarray(encode(params, ids, np.ones_like(weights)))
    for row, prompt in enumerate(PROMPTS):
        chunks = a1111_chunks(theirs.tokenizer, prompt) + [a1111_chunks(theirs.tokenizer, "")[0]] * (4 - counts[row])
        assert ids[row].tolist() == [t for tokens, _ in chunks for t in tokens]
        np.testing.assert_allclose(weights[row], [m for _, mults in chunks for m in mults], rtol=1e-7)
        expected, _ = a1111_states(theirs.tokenizer, lambda x: (theirs.text_encoder(x).last_hidden_state, None),
                                   prompt, chunks=4)
        np.testing.assert_allclose(ours[row], expected, rtol=STATES_TOL, atol=STATES_TOL)
    assert np.abs(ours - plain).max() > 1e-2
    # the comma rule: the long prompt's first chunk ends at its last comma, the words after it open the next
    assert ids[3, 69] == theirs.tokenizer.get_vocab()[",</w>"] and ids[3, 70] == theirs.tokenizer.eos_token_id


def test_sdxl_states_and_pooled_are_a1111s(xl):
    """SDXL: both encoders' penultimate states weighted apart and concatenated, the pooled output of the first
    chunk; a second prompt of fewer chunks is padded to the first's."""
    theirs, pipe, params = xl
    ids, weights = pipe.prepare_inputs(PROMPTS[3:], prompts_2=["a (blue:1.5) sky"], weighting="a1111")
    assert ids.shape == weights.shape == (1, 2, 4 * 77)
    states, pooled = jax.jit(pipe.encode_prompt)(params, ids, weights)

    def encoder(model):
        def encode(x):
            out = model(x, output_hidden_states=True)
            return out.hidden_states[-2], getattr(out, "text_embeds", None)
        return encode

    first, _ = a1111_states(theirs.tokenizer, encoder(theirs.text_encoder), PROMPTS[3])
    second, expected_pooled = a1111_states(theirs.tokenizer_2, encoder(theirs.text_encoder_2), "a (blue:1.5) sky", 4)
    np.testing.assert_allclose(states[0], np.concatenate([first, second], -1), rtol=STATES_TOL, atol=STATES_TOL)
    np.testing.assert_allclose(pooled[0], expected_pooled[0].numpy(), rtol=STATES_TOL, atol=STATES_TOL)


def test_images_are_diffusers_given_a1111s_states(sd):
    """The pipeline with ids and weights = diffusers given A1111's states as prompt_embeds (the negative prompt
    padded with empty chunks to the prompt's four); new weights reuse the program (a uniform factor would be undone
    by the mean)."""
    theirs, pipe, params = sd
    ids, weights = pipe.prepare_inputs(PROMPTS[3:], weighting="a1111")
    neg_ids, neg_weights = pipe.prepare_inputs(["(ugly:1.4), blurry"], weighting="a1111")
    key, latents = jax.random.PRNGKey(0), np.random.default_rng(0).standard_normal((1, 4, 16, 16), np.float32)
    common = dict(num_inference_steps=2, height=32, width=32, neg_prompt_ids=neg_ids, latents=latents)
    ours = pipe(ids, params, key, prompt_weights=weights, neg_prompt_weights=neg_weights, **common).images
    encode = lambda x: (theirs.text_encoder(x).last_hidden_state, None)  # noqa: E731
    states, neg_states = (torch.from_numpy(a1111_states(theirs.tokenizer, encode, text, 4)[0])[None]
                          for text in (PROMPTS[3], "(ugly:1.4), blurry"))  # 4 chunks each
    expected = theirs(prompt_embeds=states, negative_prompt_embeds=neg_states, num_inference_steps=2, height=32,
                      width=32, guidance_scale=7.5, latents=torch.from_numpy(latents),
                      output_type="np").images
    np.testing.assert_allclose(ours, expected, atol=IMAGE_ATOL)
    programs = pipe._jitted._cache_size()
    other = pipe(ids, params, key, prompt_weights=weights ** 3, neg_prompt_weights=neg_weights, **common).images
    assert pipe._jitted._cache_size() == programs and np.abs(other - ours).max() > 1e-2


@pytest.mark.parametrize("clip_skip", [1, 2])
def test_clip_skip_is_diffusers(sd, xl, clip_skip):
    """clip_skip as diffusers' (A1111's Clip skip N is N - 1): SD's states through the final layer norm, SDXL's
    both encoders' clip_skip layers before the penultimate; it moves them."""
    encoder = sd[0].text_encoder  # diffusers 0.39 reads transformers 4's text_model, which transformers 5 flattened
    encoder.text_model = SimpleNamespace(final_layer_norm=encoder.final_layer_norm)
    for theirs, pipe, params in (xl, sd):
        ids = pipe.prepare_inputs(["a photo of a cat"])
        with torch.no_grad():
            expected = theirs.encode_prompt(prompt="a photo of a cat", device="cpu", num_images_per_prompt=1,
                                            do_classifier_free_guidance=False, clip_skip=clip_skip)[0].numpy()
        ours = pipe.encode_prompt(params, ids, None, clip_skip)
        ours, plain = (out[0] if isinstance(out, tuple) else out for out in (ours, pipe.encode_prompt(params, ids)))
        np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)
        assert np.abs(np.asarray(ours) - np.asarray(plain)).max() > 1e-2
    with pytest.raises(ValueError, match=r"clip_skip=4: a whole number from 0 to 3"):
        sd[1].encode_prompt(sd[2], ids, None, 4)
