"""Prompt-to-prompt (Hertz et al. 2022): edit an image by editing its prompt, keeping its layout by giving the
edited prompt the source prompt's attention. The source and its edits are the rows of one batch, [source,
edit 1, ...]; in the conditional rows, for the first `cross_steps` (a fraction) of the evaluations each edit's
cross-attention probabilities become the source's, mapped to the edit's tokens, and for the first `self_steps`
its self-attention probabilities in the layers of at most 16 x 16 pixels become the source's:

    edit ← alpha ⊙ (source · mapper) + (1 − alpha) ⊙ edit,   then ⊙ weights      (per text token)

- replace (word swap, same token count): mapper the identity, alpha 1;
- refine (words added): mapper and alpha from aligning the two token sequences; new tokens keep their own maps;
- reweight: weights > 1 strengthen a word, < 1 weaken it (on top of a replace or refine).
`mapper`, `alpha`, `weights` and the two fractions are traced: a new edit of the same shape does not recompile.
"""

from __future__ import annotations

import difflib

import flax
import jax.numpy as jnp
import numpy as np

from ..models.layers import apply_probs, attention_probs
from .core import Hook, current_scope, refuse_on_mmdit

SELF_ATTENTION_MAX_TOKENS = 16 * 16  # P2P injects self-attention only in the low-resolution layers


@flax.struct.dataclass
class PromptToPrompt(Hook):
    mapper: jnp.ndarray  # (edits, S, S): source token s -> edit token j
    alpha: jnp.ndarray  # (edits, S): 1 where the edit token takes the source's map
    weights: jnp.ndarray  # (edits, S)
    cross_steps: float = 1.0
    self_steps: float = 0.0

    def check_model(self, denoiser):
        refuse_on_mmdit(denoiser, "prompt_to_prompt", "it gives the edits the source prompt's cross-attention "
                        "maps, mapped between CLIP's tokens, in a UNet's cross-attention layers")

    def attend(self, site, attend, q, k, v):
        cross = site.cross_attention
        if not (cross or site.self_attention and q.shape[1] <= SELF_ATTENTION_MAX_TOKENS):
            return attend(q, k, v)
        scope = current_scope()
        probs = attention_probs(q, k, site.module.upcast)  # (rows, heads, T, S)
        chunks = jnp.split(probs, site.chunks)
        cond = chunks[site.conditional_chunk]
        source, edits = cond[:1], cond[1:]
        if cross:
            mapped = jnp.einsum("bhts,bsj->bhtj", jnp.broadcast_to(source, edits.shape), self.mapper)
            a = self.alpha[:, None, None, :]
            new = (a * mapped + (1 - a) * edits) * self.weights[:, None, None, :]
            window = self.cross_steps
        else:
            new, window = jnp.broadcast_to(source, edits.shape), self.self_steps
        inject = scope.step < window * scope.num_evals
        chunks[site.conditional_chunk] = jnp.concatenate([source, jnp.where(inject, new, edits)])
        return apply_probs(jnp.concatenate(chunks), v)


def prompt_to_prompt(pipeline, source, edits, kind="replace", weights=None, cross_steps=0.8, self_steps=0.4):
    """The hook for a batch [source, *edits] (prompts): `kind` "replace" or "refine"; `weights` {word: w}
    reweights words of the edits (e.g. {"fluffy": 2.0}). Uses the pipeline's (first) tokenizer."""
    if kind not in ("replace", "refine"):
        raise ValueError(f"prompt_to_prompt kind={kind!r}: use 'replace' (a word swapped for one of as many tokens) "
                         "or 'refine' (words added)")
    edits = [edits] if isinstance(edits, str) else list(edits)
    ids = np.asarray(pipeline.prepare_inputs([source, *edits]))
    ids = ids[:, 0] if ids.ndim == 3 else ids  # SDXL: the first tokenizer's row
    length = ids.shape[-1]
    mappers, alphas, scales = [], [], []
    for edit, edit_ids in zip(edits, ids[1:]):
        mapper, alpha = (_replace if kind == "replace" else _refine)(ids[0], edit_ids, pipeline.tokenizer, edit)
        mappers.append(mapper)
        alphas.append(alpha)
        scale = np.ones(length, np.float32)
        for word, w in (weights or {}).items():
            scale[np.isin(edit_ids, pipeline.tokenizer(word).input_ids[1:-1])] = w
        scales.append(scale)
    f32 = lambda x: jnp.asarray(np.stack(x), jnp.float32)  # noqa: E731
    return PromptToPrompt(f32(mappers), f32(alphas), f32(scales), jnp.float32(cross_steps), jnp.float32(self_steps))


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
