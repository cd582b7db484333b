"""The resumable, data-parallel packed dataloader, and ``build_dataloader``.

Data-parallel sharding is by document: in every epoch the documents are numbered in the epoch's
order (see ``sources``) and document ``j`` belongs to dp rank ``j % dp_world``. Each rank tokenizes
only its own documents and packs them into its own rows, so the ranks' rows never share a document
of the same epoch, and together they cover every document of the epoch. (Every rank reads every
shard, but parses and tokenizes only its share.) The stream is infinite: after the last document of
epoch ``e`` comes the first of epoch ``e + 1``, re-shuffled with ``(seed, e + 1)``; the token stream
runs on across the epoch edge.

The position of a rank is ``(epoch, shard_pos, doc_pos, doc_counter, token_offset)``: the next token
to emit is ``token_offset`` into the ids+eos of document ``doc_pos`` of the ``shard_pos``-th shard
of the epoch, and ``doc_counter`` documents of the epoch come before that shard. It is plain ints,
so ``state_dict()`` is small, and resuming re-reads one shard and re-tokenizes one document.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from titan_glm52.data.packing import collate, pack_row
from titan_glm52.data.sources import DocumentSource
from titan_glm52.data.tokenizer import Tokenizer

_POSITION_KEYS = ("epoch", "shard_pos", "doc_pos", "doc_counter", "token_offset")


class PackedDataLoader:
    """Infinite iterator of packed batches for one dp rank (``torch.distributed.checkpoint``
    Stateful).

    Each ``next()`` returns ``{"input_ids", "labels", "positions": int64 [B, S], "cu_seqlens":
    int32}`` (see ``packing.collate``). The batches are a deterministic function of the dataset, the
    tokenizer, ``seq_len``, ``local_batch_size``, ``dp_rank``, ``dp_world``, ``seed`` and
    ``shuffle``; after ``load_state_dict(sd)`` the batches are exactly those that followed ``sd =
    state_dict()``. With ``infinite=False`` the iterator stops after one epoch (the unfinished last
    batch is dropped).
    """

    # what its state is a position in (a chat loader's state is refused, and vice versa)
    format = "text"

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        infinite: bool = True,
        tokenize_batch: int = 64,
    ):
        if seq_len < 1 or local_batch_size < 1 or tokenize_batch < 1:
            raise ValueError(
                f"seq_len ({seq_len}), local_batch_size ({local_batch_size}) and "
                f"tokenize_batch ({tokenize_batch}) must be >= 1"
            )
        if not 0 <= dp_rank < dp_world:
            raise ValueError(
                f"need 0 <= dp_rank < dp_world, got dp_rank={dp_rank}, dp_world={dp_world}"
            )
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.source, self.tokenizer = source, tokenizer
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.shuffle, self.infinite, self.tokenize_batch = shuffle, infinite, tokenize_batch
        self._set_position(dict.fromkeys(_POSITION_KEYS, 0), samples=0)

    # -----------------------------------------------------------------------------------------
    # iteration
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return collate([self._next_row() for _ in range(self.local_batch_size)])

    def _set_position(self, position: dict[str, int], samples: int) -> None:
        self._position = dict(position)
        self._samples = samples
        # The document stream restarts at the document the position points into; its first
        # ``token_offset`` tokens were already emitted.
        self._docs = self._documents(*(position[k] for k in _POSITION_KEYS[:4]))
        self._doc: tuple[int, ...] | None = None
        self._tokens: list[int] = []
        self._offset = position["token_offset"]

    def _next_row(self) -> dict[str, torch.Tensor]:
        need, pieces = self.seq_len + 1, []
        while need:
            if self._doc is None or self._offset >= len(self._tokens):
                first = self._doc is None
                self._doc, self._tokens = next(self._docs)  # StopIteration ends a finite loader
                if not first:
                    self._offset = 0
            take = min(need, len(self._tokens) - self._offset)
            if take > 0:
                pieces.append(self._tokens[self._offset : self._offset + take])
                self._offset += take
                need -= take
        self._samples += 1
        self._position = dict(zip(_POSITION_KEYS, (*self._doc, self._offset)))
        return pack_row(pieces, self.seq_len)

    def _documents(self, epoch: int, shard_pos: int, doc_pos: int, doc_counter: int):
        """Yield ``((epoch, shard_pos, doc_pos, doc_counter), ids + [eos])`` for this rank's
        documents."""
        rank, world, eos = self.dp_rank, self.dp_world, self.tokenizer.eos_id
        while True:
            fresh_epoch, emitted = (shard_pos, doc_pos) == (0, 0), False
            order = self.source.shard_order(epoch, self.seed, self.shuffle)
            for sp in range(shard_pos, len(order)):
                texts = self.source.load(order[sp])
                perm = self.source.document_order(
                    order[sp], len(texts), epoch, self.seed, self.shuffle
                )
                for chunk in self._own_chunks(len(texts), doc_pos, doc_counter):
                    ids = self.tokenizer.encode_batch([texts[perm[p]] for p in chunk])
                    for p, doc_ids in zip(chunk, ids):
                        emitted = True
                        yield (epoch, sp, p, doc_counter), doc_ids + [eos]
                doc_counter += len(texts)
                doc_pos = 0
            if fresh_epoch and not emitted:
                raise ValueError(
                    f"dp rank {rank} got no document in epoch {epoch}: dataset "
                    f"{self.source.spec!r} has {doc_counter} non-empty documents, "
                    f"fewer than dp_world={world}"
                )
            if not self.infinite:
                return
            epoch, shard_pos, doc_pos, doc_counter = epoch + 1, 0, 0, 0

    def _own_chunks(self, n: int, doc_pos: int, doc_counter: int) -> Iterator[range]:
        """This rank's indices among a shard's ``n`` documents from ``doc_pos`` on (every
        ``dp_world``-th of the epoch's count, ``doc_counter`` documents before this shard),
        ``tokenize_batch`` at a time."""
        first = doc_pos + (self.dp_rank - doc_counter - doc_pos) % self.dp_world
        own = range(first, n, self.dp_world)
        for a in range(0, len(own), self.tokenize_batch):
            yield own[a : a + self.tokenize_batch]

    # ---------------------------------------------------------------------------------------- state
    @property
    def _rank_key(self) -> str:
        return f"dp_rank_{self.dp_rank}"

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch returned, as plain ints.

        Keyed by dp rank (``{"dp_rank_<r>": {...}, "dp_world": W, "seed": s}``) so that a
        distributed checkpoint, which keeps one copy of identical keys, keeps every rank's position.
        """
        return {
            self._rank_key: {
                **self._position,
                "samples": self._samples,
                "num_shards": self.source.num_shards,
            },
            "dp_world": self.dp_world,
            "seed": self.seed,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a ``state_dict()`` of a loader with the same dataset, seed and dp layout.

        Raises ``ValueError`` when the state is for another dp_world, seed, dataset shape or data
        format, or lacks this rank: resuming data with a different data-parallel layout is not
        supported (start the data fresh instead, by not loading this state).
        """
        rank_state = self._checked_rank_state(state_dict)
        self._set_position(
            {k: rank_state[k] for k in _POSITION_KEYS}, samples=rank_state["samples"]
        )

    def _checked_rank_state(self, state_dict: dict[str, Any]) -> dict[str, int]:
        """This rank's entry of ``state_dict`` as ints, after checking that it fits this loader."""
        saved_format = state_dict.get("format", "text")
        if saved_format != self.format:
            raise ValueError(
                f"dataloader state is a {saved_format} loader's; this loader reads {self.format} "
                f"data (data.format)"
            )
        saved_world, saved_seed = (
            int(state_dict.get("dp_world", -1)),
            int(state_dict.get("seed", -1)),
        )
        if (saved_world, saved_seed) != (self.dp_world, self.seed):
            raise ValueError(
                f"dataloader state was saved with dp_world={saved_world}, seed={saved_seed}; "
                f"this loader has dp_world={self.dp_world}, seed={self.seed}"
            )
        if self._rank_key not in state_dict:
            raise ValueError(
                f"dataloader state has no entry {self._rank_key!r} (keys: {sorted(state_dict)})"
            )
        rank_state = {k: int(v) for k, v in state_dict[self._rank_key].items()}
        if rank_state["num_shards"] != self.source.num_shards:
            raise ValueError(
                f"dataloader state was saved for a dataset of {rank_state['num_shards']} shards; "
                f"{self.source.spec!r} now has {self.source.num_shards}"
            )
        return rank_state
