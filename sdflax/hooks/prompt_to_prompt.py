"""Prompt-to-prompt (Hertz et al. 2022): edit an image by editing its prompt, keeping its layout by giving the
edited prompt the source prompt's attention. The source and its edits are the rows of one batch, [source,
edit 1, ...]; in the conditional rows, for the first `cross_steps` (a fraction) of the evaluations each edit's
cross-attention probabilities become the source's, mapped to the edit's tokens, and for the first `self_steps`
its self-attention probabilities in the layers of at most 16 x 16 pixels become the source's:

    edit ← alpha ⊙ (source · mapper) + (1 − alpha) ⊙ edit,   then ⊙ weights      (per text token)

- replace (word swap, same token count): mapper the identity, alpha 1;
- refine (words added): mapper and alpha from aligning the two token sequences; new tokens keep their own maps;
- reweight: weights > 1 strengthen a word, < 1 weaken it (on top of a replace or refine).

A transformer (SD 3.x, Flux.1) has no cross-attention: its text tokens are keys of the joint attention, and the
edit is the same map on the image queries' probabilities over the text keys, in every joint attention (Flux.1's
single-stream blocks too); the text keys are CLIP's tokens then T5's for SD 3.x, T5's for Flux.1, each aligned
with its own tokenizer. Its image-to-image attention is left alone (`self_steps` is a UNet's).
`mapper`, `alpha`, `weights` and the two fractions are traced: a new edit of the same shape does not recompile.
"""

from __future__ import annotations

import difflib

import flax
import jax
import jax.numpy as jnp
import numpy as np

from ..models.layers import apply_probs, attention_probs
from .core import Hook, current_scope

SELF_ATTENTION_MAX_TOKENS = 16 * 16  # P2P injects self-attention only in the low-resolution layers
UNET_SELF_STEPS = 0.4


@flax.struct.dataclass
class PromptToPrompt(Hook):
    mapper: jnp.ndarray  # (edits, S, S): source token s -> edit token j
    alpha: jnp.ndarray  # (edits, S): 1 where the edit token takes the source's map
    weights: jnp.ndarray  # (edits, S)
    cross_steps: float = 1.0
    self_steps: float = 0.0

    def check_model(self, denoiser):
        if denoiser.component != "unet" and not isinstance(self.self_steps, jax.core.Tracer) and float(
                self.self_steps) > 0:
            raise ValueError(f"prompt_to_prompt self_steps={float(self.self_steps):g}: a transformer has no "
                             "self-attention layers of its own (the edit acts on its joint attention's image-to-text "
                             "probabilities); give self_steps=0")

    def attend(self, site, attend, q, k, v):
        joint, cross = site.joint_attention, site.cross_attention
        low = site.self_attention and not site.mmdit and q.shape[1] <= SELF_ATTENTION_MAX_TOKENS
        if not (joint or cross or low):
            return attend(q, k, v)
        scope = current_scope()
        probs = attention_probs(q, k, site.module.upcast)  # (rows, heads, T, S)
        chunks = jnp.split(probs, site.chunks)
        cond = chunks[site.conditional_chunk]
        self.check_rows(cond.shape[0])
        source, edits = cond[:1], cond[1:]
        if joint:  # the image's queries over the text's keys
            n = site.image_tokens
            self.check_tokens(k.shape[1] - n)
            new, window = edits.at[:, :, :n, n:].set(self.edited(source[:, :, :n, n:], edits[:, :, :n, n:])), \
                self.cross_steps
        elif cross:
            self.check_tokens(k.shape[1])
            new, window = self.edited(source, edits), self.cross_steps
        else:
            new, window = jnp.broadcast_to(source, edits.shape), self.self_steps
        inject = scope.step < window * scope.num_evals
        chunks[site.conditional_chunk] = jnp.concatenate([source, jnp.where(inject, new, edits)])
        return apply_probs(jnp.concatenate(chunks), v)

    def edited(self, source, edits):
        """The edits' probabilities over the text tokens (edits, heads, T, S): the source's mapped, then weighted."""
        mapped = jnp.einsum("bhts,bsj->bhtj", jnp.broadcast_to(source, edits.shape), self.mapper)
        a = self.alpha[:, None, None, :]
        return (a * mapped + (1 - a) * edits) * self.weights[:, None, None, :]

    def check_rows(self, rows):
        """The rows one program sees (under pmap or generate_sharded: one device's) are one [source, *edits] group:
        split over devices, the edit would not see its source and come out unedited."""
        group = 1 + self.mapper.shape[0]
        if rows != group:
            raise ValueError(f"prompt_to_prompt edits a group of {group} rows [source, {group - 1} edit(s)] and "
                             f"{rows} reach it: give each call one group of prompts, and under pmap or "
                             "generate_sharded each device its own (e.g. np.tile(ids, (devices, 1)), latents alike)")

    def check_tokens(self, text_tokens):
        if self.mapper.shape[-1] != text_tokens:
            raise ValueError(f"prompt_to_prompt was made for {self.mapper.shape[-1]} text tokens, the denoiser attends "
                             f"to {text_tokens}: make it with prompt_to_prompt(pipeline, ...) and the call's prompt "
                             "options (max_sequence_length)")


def prompt_to_prompt(pipeline, source, edits, kind="replace", weights=None, cross_steps=0.8, self_steps=None,
                     **prompt_options):
    """The hook for a batch [source, *edits] (prompts): `kind` "replace" or "refine"; `weights` {word: w}
    reweights words of the edits (e.g. {"fluffy": 2.0}); `self_steps` (a UNet's) 0.4 by default; `prompt_options`
    as the call's prepare_inputs takes them (SD 3.x's and Flux.1's max_sequence_length). Aligns the tokens with
    the pipeline's first tokenizer (a UNet's), or with each tokenizer whose tokens the joint attention sees."""
    if kind not in ("replace", "refine"):
        raise ValueError(f"prompt_to_prompt kind={kind!r}: use 'replace' (a word swapped for one of as many tokens) "
                         "or 'refine' (words added)")
    unet = pipeline.denoiser.component == "unet"
    self_steps = (UNET_SELF_STEPS if unet else 0.0) if self_steps is None else self_steps
    edits = [edits] if isinstance(edits, str) else list(edits)
    ids = np.asarray(pipeline.prepare_inputs([source, *edits], **prompt_options))
    if unet:
        texts = [("tokenizer", ids[:, 0] if ids.ndim == 3 else ids)]  # SDXL: the first tokenizer's row
    else:
        texts = pipeline.spec.text.joint_text(ids)
    mappers, alphas, scales = [], [], []
    for e, edit in enumerate(edits, 1):
        parts = [edit_part(getattr(pipeline, name), text[0], text[e], kind, weights, edit) for name, text in texts]
        sizes = [len(alpha) for _, alpha, _ in parts]
        mapper = np.zeros((sum(sizes),) * 2, np.float32)
        for (block, _, _), start, size in zip(parts, np.cumsum([0, *sizes]), sizes):  # each tokenizer's own
            mapper[start:start + size, start:start + size] = block
        mappers.append(mapper)
        alphas.append(np.concatenate([alpha for _, alpha, _ in parts]))
        scales.append(np.concatenate([scale for _, _, scale in parts]))
    f32 = lambda x: jnp.asarray(np.stack(x), jnp.float32)  # noqa: E731
    return PromptToPrompt(f32(mappers), f32(alphas), f32(scales), jnp.float32(cross_steps), jnp.float32(self_steps))


def edit_part(tokenizer, source_ids, edit_ids, kind, weights, edit):
    """(mapper, alpha, weights) of one tokenizer's tokens; a T5 left out (its states zeros) maps position-wise."""
    n = len(source_ids)
    if tokenizer is None:
        return np.eye(n, dtype=np.float32), np.ones(n, np.float32), np.ones(n, np.float32)
    mapper, alpha = (_replace if kind == "replace" else _refine)(source_ids, edit_ids, tokenizer, edit)
    scale = np.ones(n, np.float32)
    for word, w in (weights or {}).items():
        scale[np.isin(edit_ids, word_ids(tokenizer, word))] = w
    return mapper, alpha, scale


def word_ids(tokenizer, word) -> list:
    """A word's token ids, without the special ones: CLIP's start and end, T5's end."""
    if hasattr(tokenizer, "bos_token_id"):  # CLIP's
        return tokenizer(word).input_ids[1:-1]
    ids = list(tokenizer(word, max_length=64)[0])  # T5's: its pieces, then </s>
    return ids[:ids.index(tokenizer.eos_token_id)]


def _tokens(ids, tokenizer):
    return int(np.sum(ids != tokenizer.pad_token_id)) + 1  # the words, the start and end tokens


def _replace(source_ids, edit_ids, tokenizer, edit):
    if _tokens(source_ids, tokenizer) != _tokens(edit_ids, tokenizer):
        raise ValueError(f"prompt_to_prompt replace: {edit!r} has another number of tokens than the source; swap "
                         "words of as many tokens, or use kind='refine'")
    return np.eye(len(source_ids), dtype=np.float32), np.ones(len(source_ids), np.float32)


def _refine(source_ids, edit_ids, tokenizer, edit):
    """Each edit token that also appears, in order, in the source takes that token's map (difflib's alignment);
    the padding maps onto the padding."""
    n = len(source_ids)
    mapper, alpha = np.zeros((n, n), np.float32), np.zeros(n, np.float32)
    a, b = _tokens(source_ids, tokenizer), _tokens(edit_ids, tokenizer)
    matcher = difflib.SequenceMatcher(a=list(source_ids[:a]), b=list(edit_ids[:b]), autojunk=False)
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            mapper[block.a + i, block.b + i], alpha[block.b + i] = 1, 1
    for j in range(b, n):  # padding: position-wise from the source's end
        mapper[min(a + j - b, n - 1), j], alpha[j] = 1, 1
    for j in np.flatnonzero(alpha == 0):
        mapper[j if j < n else n - 1, j] = 1  # unused (alpha 0): keeps the matrix well-formed
    return mapper, alpha
