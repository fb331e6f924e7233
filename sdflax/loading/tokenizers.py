"""The tokenizers, without transformers.

CLIP's tokenizer, built on the `tokenizers` library directly: the ids of transformers' `CLIPTokenizer` (the
tests hold it to them, prompt by prompt), without importing transformers, which takes longer than loading a small
model's weights.

It reads a tokenizer folder as hub Stable Diffusion repos ship it (`vocab.json` + `merges.txt`) or as transformers
5 saves it (`tokenizer.json`), with `tokenizer_config.json` for the special tokens and `model_max_length`. It has
the part of transformers' tokenizer API that pipelines and their users call: `tokenizer(texts, padding=
"max_length", max_length=77, truncation=True, return_tensors="np").input_ids`, `tokenize`, `add_tokens`,
`get_vocab`, `convert_tokens_to_ids`, `added_tokens_encoder` and the special tokens' ids. A transformers
tokenizer passed to a pipeline's constructor works as well.

T5's tokenizer (SD 3.5's `tokenizer_3`), built on the `tokenizers` library from the folder's `tokenizer.json`:
the ids of transformers' `T5TokenizerFast(padding="max_length", max_length=..., truncation=True)` without importing
transformers. The SentencePiece model beside it (`spiece.model`) is not read.
"""

from __future__ import annotations

import json
import os
import types

import numpy as np

# CLIP's pre-tokenizer pattern, as transformers' CLIPTokenizer and OpenAI's CLIP split text before BPE.
SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
SPECIAL = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
           "pad_token": "<|endoftext|>"}
MAX_FILE_BYTES = 64 << 20  # CLIP's vocabulary and merges are 1.5 MB, its tokenizer.json 3.6 MB, T5's 2.4 MB


class CLIPTokenizer:
    """CLIP's byte-level BPE tokenizer (see the module docstring); `from_folder` builds one."""

    def __init__(self, backend, model_max_length: int = 77, **special_tokens):
        from tokenizers import AddedToken, processors

        self.backend = backend
        self.model_max_length = model_max_length
        self.special_tokens = {**SPECIAL, **{k: v for k, v in special_tokens.items() if v is not None}}
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                    for token in dict.fromkeys(self.special_tokens.values())])
        for name, token in self.special_tokens.items():
            if backend.token_to_id(token) is None:
                raise ValueError(f"the tokenizer's {name} {token!r} has no id")
        backend.post_processor = processors.RobertaProcessing(  # <|startoftext|> ... <|endoftext|>
            (self.special_tokens["eos_token"], self.eos_token_id),
            (self.special_tokens["bos_token"], self.bos_token_id), trim_offsets=False, add_prefix_space=False)

    @classmethod
    def from_folder(cls, folder, **special_tokens):
        """The tokenizer of a folder (see the module docstring); `special_tokens` (e.g. `pad_token="!"`) override
        tokenizer_config.json's."""
        from tokenizers import Tokenizer

        config = _read_json(os.path.join(folder, "tokenizer_config.json"), {})
        if not isinstance(config, dict):
            raise ValueError("tokenizer_config.json is not a JSON object")
        vocab, merges = (os.path.join(folder, name) for name in ("vocab.json", "merges.txt"))
        if os.path.isfile(vocab) and os.path.isfile(merges):
            backend = bpe_tokenizer(vocab, merges)
        else:
            path = os.path.join(folder, "tokenizer.json")
            _check_size(path)
            backend = Tokenizer.from_file(path)
        tokens = {name: _token_text(config.get(name)) for name in SPECIAL}
        length = config.get("model_max_length", 77)
        if isinstance(length, bool) or not isinstance(length, (int, float)) or length < 1:
            raise ValueError(f"model_max_length {length!r} in tokenizer_config.json is not a positive number")
        return cls(backend, int(min(length, 2**31 - 1)), **{**tokens, **special_tokens})

    # ---- transformers' API ------------------------------------------------------------------------------------
    def __call__(self, text, padding=False, max_length=None, truncation=False, return_tensors=None):
        """`.input_ids` of one text (a list) or of a list of texts (a list of lists, or an int array with
        `return_tensors="np"`), with <|startoftext|> and <|endoftext|>; `truncation` keeps `max_length` ids
        (default model_max_length) with both, `padding="max_length"` pads to it with the pad token."""
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        length = max_length or self.model_max_length
        backend = self.backend
        if truncation:
            backend.enable_truncation(length)
        else:
            backend.no_truncation()
        if padding == "max_length":
            backend.enable_padding(length=length, pad_id=self.pad_token_id, pad_token=self.special_tokens["pad_token"])
        elif padding in (True, "longest"):
            backend.enable_padding(pad_id=self.pad_token_id, pad_token=self.special_tokens["pad_token"])
        elif padding in (False, "do_not_pad"):
            backend.no_padding()
        else:
            raise ValueError(f"padding={padding!r}: use False, True / 'longest' or 'max_length'")
        ids = [encoding.ids for encoding in backend.encode_batch(texts)]
        if return_tensors == "np":
            ids = np.asarray(ids, dtype=np.int64)
        elif return_tensors is not None:
            raise ValueError(f"return_tensors={return_tensors!r}: only 'np' (or None for lists)")
        return types.SimpleNamespace(input_ids=ids[0] if single else ids)

    def tokenize(self, text: str) -> list[str]:
        """The tokens of `text`, without <|startoftext|> and <|endoftext|>."""
        self.backend.no_truncation()
        self.backend.no_padding()
        return self.backend.encode(text, add_special_tokens=False).tokens

    def add_tokens(self, tokens) -> int:
        """Add tokens (textual inversion) to the vocabulary, matched whole before BPE; returns how many were new."""
        return self.backend.add_tokens([tokens] if isinstance(tokens, str) else list(tokens))

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._id(tokens)
        return [self._id(token) for token in tokens]

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {token.content: i for i, token in sorted(self.backend.get_added_tokens_decoder().items())}

    @property
    def bos_token_id(self) -> int:
        return self._id(self.special_tokens["bos_token"])

    @property
    def eos_token_id(self) -> int:
        return self._id(self.special_tokens["eos_token"])

    @property
    def pad_token_id(self) -> int:
        return self._id(self.special_tokens["pad_token"])

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _id(self, token):
        i = self.backend.token_to_id(token)
        return self._id(self.special_tokens["unk_token"]) if i is None else i


def bpe_tokenizer(vocab_file, merges_file):
    """A `tokenizers.Tokenizer` with CLIP's normalizer, pre-tokenizer, BPE and decoder (transformers builds the same)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    for path in (vocab_file, merges_file):
        _check_size(path)
    vocab, merges = BPE.read_file(vocab_file, merges_file)
    backend = Tokenizer(BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="</w>",
                            fuse_unk=False, unk_token=SPECIAL["unk_token"]))
    backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                               normalizers.Lowercase()])
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _check_size(path):
    if os.path.getsize(path) > MAX_FILE_BYTES:
        raise ValueError(f"{os.path.basename(path)} is {os.path.getsize(path)} bytes, more than a CLIP tokenizer's "
                         f"{MAX_FILE_BYTES} at most: not a tokenizer file")


def _read_json(path, default):
    if not os.path.isfile(path):
        return default
    _check_size(path)
    with open(path, "rb") as f:
        return json.loads(f.read())


def _token_text(value):
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken-like {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


EOS_TOKEN, PAD_TOKEN = "</s>", "<pad>"


class T5Tokenizer:
    """Texts -> int32 ids (B, max_length), each text's pieces then `</s>`, padded with `<pad>`; `from_folder`
    builds one."""

    def __init__(self, backend, source: str = "the tokenizer"):
        from tokenizers import processors

        self.backend = backend
        for token in (EOS_TOKEN, PAD_TOKEN):
            if backend.token_to_id(token) is None:
                raise ValueError(f"{source} has no {token!r} token: not a T5 tokenizer (T5's tokenizer.json holds "
                                 f"{EOS_TOKEN!r} and {PAD_TOKEN!r}, as SD 3.5's tokenizer_3 ships it)")
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
        return cls(backend, path)

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
