"""Data for training: tokenizer, local datasets, packing with document boundaries, resumable state.

The trainer needs two calls::

    tokenizer = build_tokenizer("embedded")               # or an HF tokenizer directory
    loader = build_dataloader(
        tokenizer, "embedded", seq_len, local_batch_size, dp_rank, dp_world, seed
    )
    # input_ids/labels/positions [B, S] int64, cu_seqlens int32 over the B*S stream
    batch = next(loader)

and ``loader.state_dict()`` / ``loader.load_state_dict()`` for checkpoints. Chat data (conversations
in a ``messages`` field, labels only on the assistant's tokens) goes through the same call with
``format="chat"`` (or ``"auto"``) and the chat arguments (``chat_template``, ``train_on``,
``overflow``). The modules:

* ``tokenizer``: ``Tokenizer`` over an HF ``tokenizer.json`` (eos/bos/pad from the config files);
* ``sources``: ``.txt``/``.jsonl``/``.parquet`` files, directories, globs, saved HF datasets, as
  shards of documents with a seeded per-epoch order;
* ``packing``: rows of ``seq_len + 1`` tokens with ``cu_seqlens``, ``positions`` and cross-document
  labels set to ``IGNORE_INDEX``;
* ``loader``: ``PackedDataLoader`` (dp sharding by document, infinite epochs, state);
* ``build``: ``build_dataloader``, the text or the chat loader by ``format``;
* ``chat``: chat templates (found as transformers finds them, rendered by transformers), and
  ``ChatEncoder``: a conversation's ids and which are trained, from the renderings of its prefixes;
* ``chat_loader``: ``ChatDataLoader``, whole conversations per row with padding, overflow handling;
* ``prefetch``: ``Prefetcher``, the next batches made on a background thread with exact checkpoint
  state.

The embedded default (``"embedded"``, ``"embedded_val"``, tokenizer ``"embedded"``) lives in
``titan_glm52/assets/`` and is built by ``tools/build_embedded_assets.py``; the embedded chat sample
(``"embedded_chat"``, ``"embedded_chat_val"``) and its GLM-style template are in ``assets/chat/``.
"""

from titan_glm52.data.build import FORMATS, build_dataloader
from titan_glm52.data.chat import (
    ChatEncoder,
    ChatRenderError,
    ChatTemplate,
    ChatTemplateError,
    find_chat_template,
)
from titan_glm52.data.chat_loader import OVERFLOW, ChatDataLoader
from titan_glm52.data.loader import PackedDataLoader
from titan_glm52.data.packing import IGNORE_INDEX, collate, pack_row
from titan_glm52.data.prefetch import Prefetcher
from titan_glm52.data.sources import (
    EMBEDDED_DATASETS,
    ChatRow,
    DocumentSource,
    has_messages,
    resolve_paths,
)
from titan_glm52.data.tokenizer import EMBEDDED, Tokenizer, build_tokenizer

__all__ = [
    "EMBEDDED",
    "EMBEDDED_DATASETS",
    "FORMATS",
    "IGNORE_INDEX",
    "OVERFLOW",
    "ChatDataLoader",
    "ChatEncoder",
    "ChatRenderError",
    "ChatRow",
    "ChatTemplate",
    "ChatTemplateError",
    "DocumentSource",
    "PackedDataLoader",
    "Prefetcher",
    "Tokenizer",
    "build_dataloader",
    "build_tokenizer",
    "collate",
    "find_chat_template",
    "has_messages",
    "pack_row",
    "resolve_paths",
]
