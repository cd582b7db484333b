"""Tokenizer: a thin wrapper around a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

The special tokens come from the directory's ``special_tokens_map.json`` and
``tokenizer_config.json`` (the former wins where both name a token, as in ``transformers``). Without
them, eos falls back to a well-known end token found in the vocabulary; pad falls back to eos; bos
may be absent (``None``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

EMBEDDED = "embedded"
EMBEDDED_TOKENIZER_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tokenizer"
)

# Tried in order when no config file names the eos token.
_EOS_FALLBACKS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


def _token_content(value: Any) -> str | None:
    """The token string of a config entry: a plain string, an ``AddedToken`` dict, or ``None``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unrecognised special-token entry {value!r}")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


class Tokenizer:
    """Text <-> token ids with the special-token ids a trainer needs.

    ``encode`` never adds special tokens (no bos/eos from a post-processor): the packer adds eos
    itself. Note that, as with any Hugging Face tokenizer, a special token written literally in the
    text (for example ``"<|endoftext|>"``) is encoded as that special token.
    """

    def __init__(self, path: str):
        """Load from a directory holding ``tokenizer.json``, the path of a ``tokenizer.json``, or
        ``"embedded"``."""
        from tokenizers import Tokenizer as HFTokenizer

        if path == EMBEDDED:
            path = EMBEDDED_TOKENIZER_DIR
        if os.path.isdir(path):
            directory, file = path, os.path.join(path, "tokenizer.json")
        else:
            directory, file = os.path.dirname(path), path
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"no tokenizer.json at {file!r} (give an HF tokenizer directory, "
                f"the path of a tokenizer.json, or {EMBEDDED!r})"
            )
        self.path = file
        self._tok = HFTokenizer.from_file(file)
        self._tok.no_padding()
        self._tok.no_truncation()

        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        special = _read_json(os.path.join(directory, "special_tokens_map.json"))
        tokens = {}
        for name in ("eos_token", "bos_token", "pad_token"):
            value = _token_content(special.get(name))
            tokens[name] = value if value is not None else _token_content(config.get(name))

        eos = tokens["eos_token"]
        if eos is None:
            eos = next((t for t in _EOS_FALLBACKS if self._tok.token_to_id(t) is not None), None)
            if eos is None:
                raise ValueError(
                    f"{file}: no eos token in tokenizer_config.json/special_tokens_map.json and "
                    f"none of {_EOS_FALLBACKS} is in the vocabulary"
                )
        self.eos_token: str = eos
        self.eos_id: int = self._id_of(eos, "eos")
        self.bos_token: str | None = tokens["bos_token"]
        self.bos_id: int | None = (
            None if self.bos_token is None else self._id_of(self.bos_token, "bos")
        )
        self.pad_token: str = tokens["pad_token"] if tokens["pad_token"] is not None else eos
        self.pad_id: int = self._id_of(self.pad_token, "pad")

    def _id_of(self, token: str, role: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.path}: the {role} token {token!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included): every id is <
        vocab_size."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any added bos/eos."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, computed in parallel by the ``tokenizers`` library."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; special tokens are kept unless ``skip_special_tokens``."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.path!r}, vocab_size={self.vocab_size}, "
            f"eos={self.eos_token!r}:{self.eos_id}, "
            f"bos={self.bos_token!r}:{self.bos_id}, pad={self.pad_token!r}:{self.pad_id})"
        )


def build_tokenizer(path: str = EMBEDDED) -> Tokenizer:
    """The tokenizer at ``path`` (HF tokenizer directory or ``tokenizer.json``), or the embedded
    one.

    ``"embedded"`` is the byte-level BPE shipped in ``titan_glm52/assets/tokenizer`` (vocab 2048,
    ``<|endoftext|>`` = id 0 = eos = pad, no bos).
    """
    return Tokenizer(path)
