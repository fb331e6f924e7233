"""A1111's prompt syntax (stable-diffusion-webui's "Original" emphasis), for CLIP text encoders.

`(word)` multiplies a word's weight by 1.1, `((word))` by 1.21, `(word:1.3)` by 1.3, `[word]` divides it by 1.1;
`\\(`, `\\)`, `\\[`, `\\]` and `\\\\` are the characters themselves; `BREAK` ends a chunk. A prompt is cut into chunks
of 75 tokens (at the last comma when one is within the chunk's last 20 tokens), each given `<|startoftext|>` and
`<|endoftext|>` and padded to 77, encoded alone and concatenated along the sequence; the weights then scale each
chunk's states, whose mean is restored: z * w, times mean(z) / mean(z * w).

On the host (`weighted_ids`): prompts -> ids and weights (B, 77 k), k the batch's chunk count (shorter prompts padded
with empty chunks, as A1111 pads a batch). In the program (`encode_chunks`): ids and weights -> states (B, 77 k, D).
A1111 takes the mean over the batch it encodes; here it is each prompt's own, so an image does not depend on the
prompts it is made with (a batch of one, A1111's usual, is the same).
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

from ..loading.embeddings import expand_prompts

ATTENTION = re.compile(r"""
\\\(|\\\)|\\\[|\\]|\\\\|\\|   # escaped brackets and backslashes, or a lone backslash
\(|\[|                        # opening brackets
:([+-]?[.\d]+)\)|             # the end of (text:weight)
\)|]|                         # closing brackets
[^\\()\[\]:]+|                # text
:
""", re.X)
BREAK_WORD = re.compile(r"\s*\bBREAK\b\s*", re.S)
BREAK = ("BREAK", -1.0)  # the marker a BREAK leaves in the parsed prompt (inside brackets it is a word again)
UP, DOWN = 1.1, 1 / 1.1  # ( ) and [ ]
COMMA_BACKTRACK = 20  # A1111's comma_padding_backtrack: a full chunk moves the words after a comma this near the end


def parse_prompt_attention(text: str) -> list[tuple[str, float]]:
    """A1111's prompt -> (text, weight) pieces, adjacent pieces of one weight merged; BREAK as `BREAK`.
    "a (house:1.3) [on]" -> [("a ", 1.0), ("house", 1.3), (" ", 1.0), ("on", 1 / 1.1)]."""
    pieces, round_open, square_open = [], [], []

    def scale(start, factor):  # every piece since an opening bracket
        for piece in pieces[start:]:
            piece[1] *= factor

    for match in ATTENTION.finditer(text):
        token, weight = match.group(0), match.group(1)
        if token.startswith("\\"):
            pieces.append([token[1:], 1.0])
        elif token == "(":
            round_open.append(len(pieces))
        elif token == "[":
            square_open.append(len(pieces))
        elif weight is not None and round_open:
            try:
                factor = float(weight)
            except ValueError:
                raise ValueError(f"prompts: {text!r:.80} gives the weight {weight!r}, not a number: write "
                                 "(words:1.2)") from None
            scale(round_open.pop(), factor)
        elif token == ")" and round_open:
            scale(round_open.pop(), UP)
        elif token == "]" and square_open:
            scale(square_open.pop(), DOWN)
        else:
            for i, words in enumerate(BREAK_WORD.split(token)):
                if i:
                    pieces.append(list(BREAK))
                pieces.append([words, 1.0])
    for start in round_open:  # unclosed brackets still count
        scale(start, UP)
    for start in square_open:
        scale(start, DOWN)
    merged = []
    for words, weight in pieces or [["", 1.0]]:
        if merged and merged[-1][1] == weight:
            merged[-1][0] += words
        else:
            merged.append([words, weight])
    return [tuple(piece) for piece in merged]


def prompt_chunks(tokenizer, text: str, length: int) -> list[tuple[list, list]]:
    """One prompt -> its chunks, each (ids, weights) of `length` tokens: <|startoftext|>, up to length - 2 of the
    prompt's tokens, <|endoftext|>, then the tokenizer's padding."""
    pieces = parse_prompt_attention(text)
    words = expand_prompts([piece for piece, _ in pieces], tokenizer)  # textual inversion's multi-vector tokens
    token_lists = [ids[1:-1] for ids in tokenizer(words).input_ids]  # without the start and end tokens
    comma, size = tokenizer.convert_tokens_to_ids(",</w>"), length - 2
    chunks, tokens, weights, last_comma = [], [], [], -1

    def close():
        nonlocal tokens, weights, last_comma
        padding = size - len(tokens)
        chunks.append(([tokenizer.bos_token_id, *tokens, tokenizer.eos_token_id] + [tokenizer.pad_token_id] * padding,
                       [1.0, *weights, 1.0] + [1.0] * padding))
        tokens, weights, last_comma = [], [], -1

    for ids, piece in zip(token_lists, pieces):
        if piece == BREAK:
            close()
            continue
        for token in ids:
            if token == comma:
                last_comma = len(tokens)
            elif len(tokens) == size and last_comma != -1 and size - last_comma <= COMMA_BACKTRACK:
                cut = last_comma + 1  # the words after the comma open the next chunk
                moved = tokens[cut:], weights[cut:]
                tokens, weights = tokens[:cut], weights[:cut]
                close()
                tokens, weights = map(list, moved)
            if len(tokens) == size:
                close()
            tokens.append(token)
            weights.append(piece[1])
    if tokens or not chunks:
        close()
    return chunks


def weighted_ids(tokenizer, prompts, length: int, chunks: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Prompts -> (ids int32, weights float32), each (B, length k): k the most chunks a prompt takes (at least
    `chunks`), the others padded with empty chunks (the empty prompt's ids, weight 1)."""
    rows = [prompt_chunks(tokenizer, prompt, length) for prompt in prompts]
    count = max([chunks, *map(len, rows)])
    empty = prompt_chunks(tokenizer, "", length)
    rows = [row + empty * (count - len(row)) for row in rows]
    ids = np.asarray([[i for chunk, _ in row for i in chunk] for row in rows], np.int32)
    weights = np.asarray([[w for _, chunk in row for w in chunk] for row in rows], np.float32)
    return ids, weights


def emphasized(states, weights):
    """A1111's emphasis: states (N, T, D) times their tokens' weights (N, T), rescaled to each row's mean before."""
    states = states.astype(jnp.float32)
    mean = states.mean(axis=(1, 2), keepdims=True)
    weighted = states * weights[..., None]
    return weighted * (mean / weighted.mean(axis=(1, 2), keepdims=True))


def encode_chunks(encode, ids, weights, length: int):
    """`encode` ((N, length) ids -> (states (N, length, D), *more)) on each chunk of ids (B, length k) alone:
    (states (B, length k, D) weighted by `weights` (B, length k) or None, *more of the first chunk: the pooled
    output)."""
    batch, chunks = ids.shape[0], ids.shape[-1] // length
    states, *more = encode(ids.reshape(batch * chunks, length))
    dtype = states.dtype
    if weights is not None:
        states = emphasized(states, weights.reshape(batch * chunks, length)).astype(dtype)
    first = [x.reshape(batch, chunks, *x.shape[1:])[:, 0] for x in more]
    return states.reshape(batch, chunks * length, states.shape[-1]), *first


def padded_chunks(ids, weights, empty, count: int):
    """ids (..., L k) and their weights (or None) padded to `count` chunks with the empty prompt's ids `empty`
    (L,) (SDXL's (2, L)) of weight 1: A1111's empty chunks."""
    length = empty.shape[-1]
    missing = count - ids.shape[-1] // length
    if missing <= 0:
        return ids, weights
    xp = np if isinstance(ids, np.ndarray) else jnp
    pad = xp.broadcast_to(np.tile(empty, missing).astype(ids.dtype), (*ids.shape[:-1], missing * length))
    ids = xp.concatenate([ids, pad], axis=-1)
    if weights is not None:
        weights = xp.concatenate([weights, xp.ones(pad.shape, weights.dtype)], axis=-1)
    return ids, weights
