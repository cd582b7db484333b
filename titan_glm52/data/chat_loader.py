"""``ChatDataLoader``: whole conversations packed into rows, labels only on trained tokens.

Rows. A row holds ``seq_len + 1`` tokens, as in ``packing``: conversations (their ids, ending with
eos, from ``chat.ChatEncoder``) back to back, then padding. A conversation is never cut across rows:
when the next one does not fit in what is left of the row, the rest of the row is padding and the
conversation opens the next row. So, per row (``S = seq_len``):

* ``cu_seqlens`` starts every conversation and the padding (its own document: attention never
  reaches it from a conversation, nor a conversation from it); ``positions`` restart at 0 at each;
* ``labels[i] = t[i + 1]`` where ``t[i + 1]`` is a trained token of the conversation holding input
  ``i`` (an assistant token with ``train_on="assistant"``, any token with ``"all"``), else
  ``IGNORE_INDEX``: at the last input of each conversation (its eos), at padding, at every untrained
  token. So the labels that are not ``IGNORE_INDEX`` are exactly the trained tokens, and the loss
  normalised by their global count is the mean over trained tokens;
* a conversation of exactly ``S + 1`` tokens fills a row, its eos being the row's label-only last
  token.

A conversation longer than ``S + 1`` tokens is handled by ``overflow``:

* ``"truncate"`` (the default): its first ``S + 1`` tokens fill a row; the rest is not trained.
  Counted in ``stats`` and logged (the 1st, 10th, 100th, ... time, with the totals). Why the
  default: a large SFT set nearly always holds a few conversations longer than the context, and a
  run should neither stop on row 900,000 nor drop them unseen; their heads (the system prompt, the
  question, the start of the answer) train the model correctly, and the count says how much was
  lost;
* ``"drop"``: the conversation is skipped (counted and logged likewise);
* ``"error"``: ``ValueError`` naming the row (to check a dataset against a context length);
* ``"split"``: the conversation runs on across rows like a text document (see ``packing``): it
  begins in what is left of the current row and continues in the next ones, each piece a document of
  its own, so a later piece trains its assistant tokens without the earlier context.

Rows without messages in a chat dataset (text rows) are trained on every token and packed as the
text loader packs documents: they fill the rest of a row and run on into the next. A conversation
without a trained token (no assistant message, or none left after truncation) is skipped and
counted: it would cost compute and give no loss.

Sharding, order, epochs and state are the text loader's (``loader``): row ``j`` of the epoch order
(after empty rows are dropped) belongs to dp rank ``j % dp_world``; the position ``(epoch,
shard_pos, doc_pos, doc_counter, token_offset)`` points at the conversation to place next and, in
``"split"`` mode, how many of its tokens are already placed. ``state_dict()`` adds the ``stats``
counters (plain ints) and
``"format": "chat"``; after ``load_state_dict(sd)`` the batches are exactly those that followed
    ``sd``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from titan_glm52.data.chat import ChatEncoder, Encoded
from titan_glm52.data.loader import _POSITION_KEYS, PackedDataLoader
from titan_glm52.data.packing import pack_row
from titan_glm52.data.sources import DocumentSource
from titan_glm52.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

OVERFLOW = ("truncate", "drop", "split", "error")
STAT_KEYS = (
    "conversations",  # conversations placed in rows
    "text_rows",  # rows without messages placed in rows
    # their trained tokens (the labels that are not IGNORE_INDEX, row edges aside)
    "trained_tokens",
    "truncated",  # conversations truncated to seq_len + 1 tokens ("truncate")
    "truncated_tokens",  # the tokens cut off them
    "split",  # conversations longer than seq_len + 1 placed across rows ("split")
    "dropped_long",  # conversations skipped for their length ("drop")
    "dropped_untrained",  # conversations skipped for holding no trained token
    "padding_tokens",  # padding tokens in rows
)


@dataclass
class _Item:
    """A conversation of this rank: its position (epoch, shard_pos, doc_pos, doc_counter), its
    tokens, and how it is placed: ``"ok"`` (whole), ``"split"`` or ``"text"`` (across rows),
    ``"truncated"`` (``cut`` tokens fewer), or not at all: ``"dropped_long"``,
    ``"dropped_untrained"``."""

    where: tuple[int, int, int, int]
    encoded: Encoded
    status: str
    cut: int = 0


class ChatDataLoader(PackedDataLoader):
    """Infinite iterator of packed chat batches for one dp rank (``torch.distributed.checkpoint``
    Stateful); batches as ``PackedDataLoader``'s, rows as the module docstring says."""

    format = "chat"

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
        *,
        encoder: ChatEncoder | None = None,
        overflow: str = "truncate",
    ):
        """``source`` must be opened with ``messages_field``; ``encoder`` defaults to
        ``ChatEncoder(tokenizer)`` (the tokenizer directory's template, assistant masks)."""
        if source.messages_field is None:
            raise ValueError(
                f"dataset {source.spec!r} was opened for text: open it with messages_field"
            )
        if overflow not in OVERFLOW:
            raise ValueError(f"overflow must be one of {OVERFLOW}, got {overflow!r}")
        self.encoder = encoder if encoder is not None else ChatEncoder(tokenizer)
        if self.encoder.tokenizer is not tokenizer:
            raise ValueError("the encoder must use the loader's tokenizer")
        self.overflow = overflow
        super().__init__(
            source,
            tokenizer,
            seq_len,
            local_batch_size,
            dp_rank=dp_rank,
            dp_world=dp_world,
            seed=seed,
            shuffle=shuffle,
            infinite=infinite,
            tokenize_batch=tokenize_batch,
        )

    # ----------------------------------------------------------------------------------------- rows
    def _set_position(
        self, position: dict[str, int], samples: int, stats: dict[str, int] | None = None
    ) -> None:
        self._position = dict(position)
        self._samples = samples
        self.stats = (
            dict.fromkeys(STAT_KEYS, 0) if stats is None else {k: stats[k] for k in STAT_KEYS}
        )
        self._items = self._conversations(*(position[k] for k in _POSITION_KEYS[:4]))
        self._item: _Item | None = None
        self._offset = position["token_offset"]  # kept for the first item pulled (the resumed one)

    def _current(self) -> _Item:
        """The conversation to place next: pulls past finished and skipped ones (counting the
        skips)."""
        while self._item is None or self._offset >= len(self._item.encoded.ids):
            first = self._item is None
            self._item = next(self._items)  # StopIteration ends a finite loader
            if not first:
                self._offset = 0
            if self._item.status.startswith("dropped"):
                self.stats[self._item.status] += 1
                if self._item.status == "dropped_long":
                    self._log_overflow("dropped_long", "skipped")
                self._offset = len(self._item.encoded.ids)  # nothing of it is placed
        return self._item

    def _next_row(self) -> dict[str, torch.Tensor]:
        budget, pieces, targets = self.seq_len + 1, [], []
        while budget:
            item = self._current()
            n = len(item.encoded.ids)
            if self._offset == 0 and n <= self.seq_len + 1 and item.status != "text":
                if n > budget:
                    break  # it opens the next row; the rest of this one is padding
                take = n
            else:
                take = min(budget, n - self._offset)  # "split" and text rows run on across rows
            if self._offset == 0:
                self._count_placed(item)
            pieces.append(item.encoded.ids[self._offset : self._offset + take])
            targets.append(item.encoded.targets[self._offset : self._offset + take])
            self._offset += take
            budget -= take
        self._position = dict(zip(_POSITION_KEYS, (*self._item.where, self._offset)))
        if budget:
            pieces.append([self.tokenizer.pad_id] * budget)
            targets.append(np.zeros(budget, dtype=bool))
            self.stats["padding_tokens"] += budget
        self._samples += 1
        return pack_row(pieces, self.seq_len, targets)

    def _count_placed(self, item: _Item) -> None:
        self.stats["text_rows" if item.status == "text" else "conversations"] += 1
        self.stats["trained_tokens"] += int(item.encoded.targets[1:].sum())
        if item.status == "split":
            self.stats["split"] += 1
        elif item.status == "truncated":
            self.stats["truncated"] += 1
            self.stats["truncated_tokens"] += item.cut
            self._log_overflow("truncated", "truncated")

    def _log_overflow(self, key: str, verb: str) -> None:
        """Logs the 1st, 10th, 100th, ... conversation that overflowed, with the totals so far."""
        count = self.stats[key]
        if count == 1 or (count % 10 == 0 and str(count).rstrip("0") == "1"):
            seen = (
                self.stats["conversations"]
                + self.stats["dropped_long"]
                + self.stats["dropped_untrained"]
            )
            lost = f", {self.stats['truncated_tokens']:,} tokens cut" if key == "truncated" else ""
            logger.warning(
                "chat data (dp rank %d): %d of %d conversations so far were longer than "
                "seq_len + 1 = %d tokens and were %s%s (%s is the latest; data.chat_overflow = "
                "'truncate' | 'drop' | 'split' | 'error' chooses)",
                self.dp_rank,
                count,
                seen,
                self.seq_len + 1,
                verb,
                lost,
                self._item.encoded.where,
            )

    # -------------------------------------------------------------------------------- conversations
    def _conversations(
        self, epoch: int, shard_pos: int, doc_pos: int, doc_counter: int
    ) -> Iterator[_Item]:
        """This rank's conversations from the given position on, encoded ``tokenize_batch`` at a
        time, with their overflow status; as ``PackedDataLoader._documents`` for the order and
        sharding."""
        rank, world = self.dp_rank, self.dp_world
        while True:
            fresh_epoch, usable = (shard_pos, doc_pos) == (0, 0), False
            order = self.source.shard_order(epoch, self.seed, self.shuffle)
            for sp in range(shard_pos, len(order)):
                rows = self.source.load_rows(order[sp])
                perm = self.source.document_order(
                    order[sp], len(rows), epoch, self.seed, self.shuffle
                )
                for chunk in self._own_chunks(len(rows), doc_pos, doc_counter):
                    for p, encoded in zip(
                        chunk, self.encoder.encode([rows[perm[p]] for p in chunk])
                    ):
                        item = self._overflow(
                            _Item((epoch, sp, p, doc_counter), encoded, "ok"),
                            is_text=rows[perm[p]].messages is None,
                        )
                        usable |= not item.status.startswith("dropped")
                        yield item
                doc_counter += len(rows)
                doc_pos = 0
            if fresh_epoch and not usable:
                raise ValueError(
                    f"dp rank {rank} got no trainable conversation in epoch {epoch}: dataset "
                    f"{self.source.spec!r} has {doc_counter} rows, fewer than dp_world={world} "
                    f"or none with a trained token that fits (see overflow / train_on)"
                )
            if not self.infinite:
                return
            epoch, shard_pos, doc_pos, doc_counter = epoch + 1, 0, 0, 0

    def _overflow(self, item: _Item, is_text: bool) -> _Item:
        """``item`` with its overflow status (and tokens truncated under ``"truncate"``)."""
        enc, limit = item.encoded, self.seq_len + 1
        if not enc.targets[1:].any():
            item.status = "dropped_untrained"
        elif is_text:
            item.status = "text"
        elif len(enc.ids) <= limit:
            pass
        elif self.overflow == "split":
            item.status = "split"
        elif self.overflow == "error":
            raise ValueError(
                f"{enc.where}: a conversation of {len(enc.ids)} tokens is longer than "
                f"seq_len + 1 = {limit}; set data.chat_overflow to 'truncate', 'drop' or "
                f"'split', or raise seq_len"
            )
        elif self.overflow == "drop":
            item.status = "dropped_long"
        else:
            item.cut = len(enc.ids) - limit
            item.encoded = Encoded(enc.ids[:limit], enc.targets[:limit], enc.where)
            item.status = "truncated" if enc.targets[1:limit].any() else "dropped_untrained"
        return item

    # ---------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The text loader's state, plus ``stats`` in this rank's entry and ``"format": "chat"``."""
        state = super().state_dict()
        state[self._rank_key].update(self.stats)
        state["format"] = self.format
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``PackedDataLoader.load_state_dict``; also refuses a text loader's state."""
        rank_state = self._checked_rank_state(state_dict)
        missing = [k for k in STAT_KEYS if k not in rank_state]
        if missing:
            raise ValueError(
                f"dataloader state has no chat counters {missing}: it is not a chat loader's state"
            )
        self._set_position(
            {k: rank_state[k] for k in _POSITION_KEYS},
            samples=rank_state["samples"],
            stats=rank_state,
        )
