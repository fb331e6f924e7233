"""T5's tokenizer (SD 3.5's `tokenizer_3`), built on the `tokenizers` library from the folder's `tokenizer.json`:
the ids of transformers' `T5TokenizerFast(padding="max_length", max_length=..., truncation=True)` without importing
transformers. The SentencePiece model beside it (`spiece.model`) is not read.
"""

from __future__ import annotations

import os

import numpy as np

EOS_TOKEN, PAD_TOKEN = "</s>", "<pad>"
MAX_FILE_BYTES = 64 << 20  # T5's tokenizer.json is 2.4 MB


class T5Tokenizer:
    """Texts -> int32 ids (B, max_length), each text's pieces then `</s>`, padded with `<pad>`; `from_folder`
    builds one."""

    def __init__(self, backend):
        from tokenizers import processors

        self.backend = backend
        for token in (EOS_TOKEN, PAD_TOKEN):
            if backend.token_to_id(token) is None:
                raise ValueError(f"the tokenizer has no {token!r} token: not a T5 tokenizer")
        # transformers' T5 tokenizer sets this post-processor whatever tokenizer.json holds.
        backend.post_processor = processors.TemplateProcessing(
            single=["$A", EOS_TOKEN], pair=["$A", EOS_TOKEN, "$B", EOS_TOKEN],
            special_tokens=[(EOS_TOKEN, self.eos_token_id)])

    @classmethod
    def from_folder(cls, folder):
        """The tokenizer of a folder holding transformers' `tokenizer.json` (SD 3.5's `tokenizer_3`)."""
        from tokenizers import Tokenizer

        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json in {folder}: a T5 tokenizer folder holds one")
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise ValueError(f"{path} is {os.path.getsize(path)} bytes, more than a T5 tokenizer's "
                             f"{MAX_FILE_BYTES} at most: not a tokenizer file")
        try:
            backend = Tokenizer.from_file(path)
        except Exception as e:  # the Rust tokenizers library raises bare Exceptions for damaged files
            detail = " ".join(str(e).split())[:200]
            raise ValueError(f"{path}: cannot build a tokenizer from it ({type(e).__name__}: {detail})") from None
        return cls(backend)

    def __call__(self, texts, max_length: int) -> np.ndarray:
        """int32 ids (B, max_length) of a text or a list of texts: a longer text keeps its first max_length - 1
        pieces and `</s>`, a shorter one is padded with `<pad>` after its `</s>`."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length={max_length!r}: give a positive int (SD 3.5 uses 256)")
        if not all(isinstance(text, str) for text in texts):
            raise TypeError("texts: give a string or a list of strings")
        self.backend.enable_truncation(max_length)
        self.backend.enable_padding(length=max_length, pad_id=self.pad_token_id, pad_token=PAD_TOKEN)
        return np.asarray([encoding.ids for encoding in self.backend.encode_batch(texts)], np.int32).reshape(
            len(texts), max_length)

    @property
    def eos_token_id(self) -> int:
        return self.backend.token_to_id(EOS_TOKEN)

    @property
    def pad_token_id(self) -> int:
        return self.backend.token_to_id(PAD_TOKEN)
