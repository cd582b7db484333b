"""Data for training: tokenizer, local datasets, packing with document boundaries, resumable state.

The trainer needs two calls::

    tokenizer = build_tokenizer("embedded")               # or an HF tokenizer directory
    loader = build_dataloader(tokenizer, "embedded", seq_len, local_batch_size, dp_rank, dp_world, seed)
    batch = next(loader)  # input_ids/labels/positions [B, S] int64, cu_seqlens int32 over the B*S stream

and ``loader.state_dict()`` / ``loader.load_state_dict()`` for checkpoints. The modules:

* ``tokenizer``: ``Tokenizer`` over an HF ``tokenizer.json`` (eos/bos/pad from the config files);
* ``sources``: ``.txt``/``.jsonl``/``.parquet`` files, directories, globs, saved HF datasets, as shards of
  documents with a seeded per-epoch order;
* ``packing``: rows of ``seq_len + 1`` tokens with ``cu_seqlens``, ``positions`` and cross-document labels
  set to ``IGNORE_INDEX``;
* ``loader``: ``PackedDataLoader`` (dp sharding by document, infinite epochs, state) and the builder;
* ``prefetch``: ``Prefetcher``, the next batches made on a background thread with exact checkpoint state.

The embedded default (``"embedded"``, ``"embedded_val"``, tokenizer ``"embedded"``) lives in
``titan_glm52/assets/`` and is built by ``tools/build_embedded_assets.py``.
"""

from titan_glm52.data.loader import PackedDataLoader, build_dataloader
from titan_glm52.data.packing import IGNORE_INDEX, collate, pack_row
from titan_glm52.data.prefetch import Prefetcher
from titan_glm52.data.sources import EMBEDDED_DATASETS, DocumentSource, resolve_paths
from titan_glm52.data.tokenizer import EMBEDDED, Tokenizer, build_tokenizer

__all__ = [
    "EMBEDDED",
    "EMBEDDED_DATASETS",
    "IGNORE_INDEX",
    "DocumentSource",
    "PackedDataLoader",
    "Prefetcher",
    "Tokenizer",
    "build_dataloader",
    "build_tokenizer",
    "collate",
    "pack_row",
    "resolve_paths",
]
