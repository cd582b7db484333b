"""``build_dataloader``: the text or the chat loader of a dataset, by ``format``."""

from __future__ import annotations

from typing import Sequence

from titan_glm52.data.chat import ChatEncoder
from titan_glm52.data.chat_loader import ChatDataLoader
from titan_glm52.data.loader import PackedDataLoader
from titan_glm52.data.sources import DocumentSource, has_messages
from titan_glm52.data.tokenizer import Tokenizer, build_tokenizer

FORMATS = ("text", "chat", "auto")


def build_dataloader(
    tokenizer: str | Tokenizer,
    dataset: str,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int = 0,
    dp_world: int = 1,
    seed: int = 0,
    *,
    text_field: str = "text",
    split: str | None = "train",
    shuffle: bool = True,
    infinite: bool = True,
    txt_split: str = "paragraph",
    format: str = "text",
    messages_field: str = "messages",
    tools_field: str = "tools",
    chat_template: str | None = None,
    train_on: str = "assistant",
    overflow: str = "truncate",
    end_of_turn: Sequence[str] = (),
) -> PackedDataLoader:
    """The packed dataloader of dp rank ``dp_rank`` of ``dp_world`` over ``dataset``.

    ``tokenizer``: a ``Tokenizer``, an HF tokenizer directory / ``tokenizer.json`` path, or
        ``"embedded"``.
    ``dataset``: ``"embedded"`` (training split of the shipped corpus), ``"embedded_val"`` (its
    held-out split), ``"embedded_chat"`` / ``"embedded_chat_val"`` (the shipped chat sample), or a
    ``.txt``/``.jsonl``/``.parquet`` file, a directory of them, a glob, or a directory written by
    ``datasets.save_to_disk``. ``text_field`` names the jsonl key / column; ``split`` the
    DatasetDict split.

    ``format``: ``"text"`` (every token trained, documents cut across rows: ``PackedDataLoader``),
    ``"chat"`` (conversations in ``messages_field``, tools in ``tools_field``: ``ChatDataLoader``),
    or ``"auto"`` (chat when the dataset's first file has a ``messages_field`` column, or for jsonl
    a first row with that field: ``sources.has_messages``; else text). Chat only: ``chat_template``
    (``chat.find_chat_template``: ``None`` = the tokenizer directory's), ``train_on``
    (``"assistant"`` or ``"all"``), ``overflow`` (``"truncate"``, ``"drop"``, ``"split"`` or
    ``"error"``, see ``chat_loader``) and ``end_of_turn`` (more end-of-turn markers).
    """
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else build_tokenizer(tokenizer)
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if format == "auto":
        format = "chat" if has_messages(dataset, messages_field, split) else "text"
    # where this rank reads, in what order, how long
    place = dict(dp_rank=dp_rank, dp_world=dp_world, seed=seed, shuffle=shuffle, infinite=infinite)
    if format == "text":
        source = DocumentSource(dataset, text_field=text_field, split=split, txt_split=txt_split)
        return PackedDataLoader(source, tok, seq_len, local_batch_size, **place)
    source = DocumentSource(
        dataset,
        text_field=text_field,
        split=split,
        txt_split=txt_split,
        messages_field=messages_field,
        tools_field=tools_field,
    )
    encoder = ChatEncoder(tok, chat_template, train_on=train_on, end_of_turn=end_of_turn)
    return ChatDataLoader(
        source, tok, seq_len, local_batch_size, **place, encoder=encoder, overflow=overflow
    )
