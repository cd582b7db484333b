"""Document sources: local files (or a saved HF dataset) split into shards of documents.

A source is an ordered list of *shards*; a shard is the unit that is read into memory at once:

* ``.txt``: one shard per file. A document is a run of text between blank lines (one or more empty
  or whitespace-only lines separate documents, as in BERT-style pretraining text files); with
  ``txt_split="file"`` the whole file is one document.
* ``.jsonl``: one JSON object a line, the text in ``text_field``; a file is cut into byte ranges of
  ``jsonl_chunk_bytes`` and a shard holds the lines that *start* in its range, so a huge file is
  never read whole.
* ``.parquet``: one shard per row group, reading only the ``text_field`` column.
* a directory written by ``datasets.save_to_disk`` (``Dataset`` or ``DatasetDict``, then ``split``):
  shards of ``hf_chunk_rows`` rows of the memory-mapped dataset.

Documents that are empty or whitespace only (or null) are dropped when a shard is read. A missing
field, a non-string text or undecodable UTF-8 raises, naming the file.

Chat rows (``messages_field`` set, see ``load_rows``): a row's ``messages`` (a list of ``{"role",
"content", ...}`` objects, or the JSON text of one) and optional ``tools`` (likewise) come out as a
``ChatRow``; a row without messages but with a text is a plain-text ``ChatRow``; rows with neither
(null or empty) are dropped.

Order: per epoch the shard order is a permutation seeded by ``(seed, epoch)`` and the documents
inside a shard by ``(seed, epoch, shard)`` (a two-level shuffle whose memory is one shard);
``shuffle=False`` keeps the file order. Both are deterministic functions of the seed, never of the
process or the machine.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass

import numpy as np

EMBEDDED_ASSETS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets"
)
EMBEDDED_DATASETS = {
    "embedded": os.path.join(EMBEDDED_ASSETS_DIR, "corpus.jsonl"),
    "embedded_val": os.path.join(EMBEDDED_ASSETS_DIR, "corpus_val.jsonl"),
    "embedded_chat": os.path.join(EMBEDDED_ASSETS_DIR, "chat", "chat.jsonl"),
    "embedded_chat_val": os.path.join(EMBEDDED_ASSETS_DIR, "chat", "chat_val.jsonl"),
}
SUFFIXES = (".txt", ".jsonl", ".parquet")
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
JSONL_CHUNK_BYTES = 64 << 20
HF_CHUNK_ROWS = 16384

_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


@dataclass(frozen=True)
class ChatRow:
    """One row of a chat dataset: a conversation (``messages``, optional ``tools``) or, for a row
    that has no messages, a plain ``text``. ``where`` names the row in errors (file and row or byte
    offset)."""

    messages: list[dict] | None
    tools: list[dict] | None
    text: str | None
    where: str


@dataclass(frozen=True)
class Shard:
    """A slice of one file: jsonl byte range [start, stop), parquet row group ``start``, hf rows
    [start, stop)."""

    kind: str  # "txt" | "jsonl" | "parquet" | "hf"
    path: str
    start: int = 0
    stop: int = 0


def _is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in HF_MARKERS)


def _files_under(path: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        found.extend(os.path.join(root, f) for f in files if f.endswith(SUFFIXES))
    return sorted(found)


def resolve_paths(spec: str) -> list[str]:
    """The files (or saved-HF-dataset directories) that ``spec`` names, sorted.

    ``spec`` is ``"embedded"``/``"embedded_val"``, a file, a directory (every
    ``.txt``/``.jsonl``/``.parquet`` below it, recursively, unless it is itself a saved HF dataset)
    or a glob pattern (``**`` allowed). Raises ``FileNotFoundError`` when nothing matches.
    """
    if spec in EMBEDDED_DATASETS:
        return [EMBEDDED_DATASETS[spec]]
    if _is_hf_dir(spec):
        return [spec]
    if os.path.isdir(spec):
        paths = _files_under(spec)
    elif os.path.isfile(spec):
        paths = [spec]
    else:
        paths = []
        for match in sorted(glob.glob(spec, recursive=True)):
            if _is_hf_dir(match):
                paths.append(match)
            elif os.path.isdir(match):
                paths.extend(_files_under(match))
            elif os.path.isfile(match):
                paths.append(match)
    bad = [p for p in paths if not (_is_hf_dir(p) or p.endswith(SUFFIXES))]
    if bad:
        raise ValueError(
            f"unsupported data file(s) {bad[:3]}: expected {', '.join(SUFFIXES)} "
            f"or a directory written by datasets.save_to_disk"
        )
    if not paths:
        raise FileNotFoundError(
            f"dataset {spec!r} matches no {'/'.join(SUFFIXES)} file, saved HF dataset "
            f"or embedded name ({', '.join(EMBEDDED_DATASETS)})"
        )
    return sorted(dict.fromkeys(paths))


def _rng(seed: int, *parts: object) -> np.random.Generator:
    """A generator seeded by a stable hash of (seed, *parts): no collisions between different
    tuples."""
    digest = hashlib.sha256("/".join(map(str, (seed, *parts))).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


def _jsonl_records(shard: Shard):
    """``(byte offset, parsed JSON)`` of every non-blank line that starts in the shard's byte
    range."""
    with open(shard.path, "rb") as f:
        if shard.start > 0:
            f.seek(shard.start - 1)
            # finish the line that started before this range (or the newline at start - 1)
            f.readline()
        while f.tell() < shard.stop:
            offset = f.tell()
            line = f.readline()
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{shard.path} at byte {offset}: not a JSON line ({e})") from e
            yield offset, record


def _json_list(value, field: str, where: str) -> list | None:
    """``value`` as a list: a list as is, the JSON text of a list parsed, None / empty as None."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except ValueError as e:
            raise ValueError(f"{where}: field {field!r} is text but not JSON ({e})") from e
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: field {field!r} holds {type(value).__name__}, not a list")
    return list(value)


def _drop_nulls(value):
    """``value`` without the dict entries whose value is null, at every depth."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_nulls(v) for v in value]
    return value


def _message(message, where: str, field: str) -> dict:
    """A message as a dict without its null entries: templates test whether a key is there (like
    transformers, which drops them too), and a null ``content`` or ``tool_calls`` means "none"."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise TypeError(
            f"{where}: every item of {field!r} must be an object with a text 'role', "
            f"got {str(message)[:80]!r}"
        )
    return {k: v for k, v in message.items() if v is not None}


def _chat_row(
    messages,
    tools,
    text,
    where: str,
    messages_field: str,
    tools_field: str,
    text_field: str,
    columnar: bool,
) -> ChatRow | None:
    """The ``ChatRow`` of one row's fields, or None for a row without messages or text.

    ``columnar`` (parquet, saved datasets): Arrow gives every struct of a column the same keys,
    filling the absent ones with null, so nulls are dropped at every depth (store JSON text to keep
    a null).
    """
    if columnar:
        messages, tools = _drop_nulls(messages), _drop_nulls(tools)
    messages = _json_list(messages, messages_field, where)
    if messages is None:
        if text is not None and not isinstance(text, str):
            raise TypeError(f"{where}: field {text_field!r} holds {type(text).__name__}, not text")
        return ChatRow(None, None, text, where) if text is not None and text.strip() else None
    tools = _json_list(tools, tools_field, where)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise TypeError(f"{where}: field {tools_field!r} must be a list of objects (JSON schemas)")
    return ChatRow([_message(m, where, messages_field) for m in messages], tools, None, where)


def has_messages(spec: str, messages_field: str = "messages", split: str | None = "train") -> bool:
    """Whether ``spec`` holds chat rows, judged by its first file (in ``resolve_paths`` order) that
    is not an empty jsonl file: a saved dataset or parquet file with a ``messages_field`` column, or
    a jsonl file whose first row has that field (``.txt``: never). One schema or one line is read,
    whatever the size of the dataset; a dataset that mixes chat and text files is read as chat with
    ``format="chat"``."""
    for path in resolve_paths(spec):
        if _is_hf_dir(path):
            import datasets

            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split] if split in ds else next(iter(ds.values()))
            names = ds.column_names
        elif path.endswith(".parquet"):
            import pyarrow.parquet as pq

            names = pq.ParquetFile(path).schema_arrow.names
        elif path.endswith(".jsonl"):
            first = next(_jsonl_records(Shard("jsonl", path, 0, os.path.getsize(path))), None)
            if first is None:
                continue  # no row to judge by
            names = list(first[1]) if isinstance(first[1], dict) else []
        else:
            names = []
        return messages_field in names
    return False


class DocumentSource:
    """Shards of documents from local files, with a deterministic per-epoch order."""

    def __init__(
        self,
        spec: str,
        text_field: str = "text",
        split: str | None = "train",
        txt_split: str = "paragraph",
        jsonl_chunk_bytes: int = JSONL_CHUNK_BYTES,
        hf_chunk_rows: int = HF_CHUNK_ROWS,
        *,
        messages_field: str | None = None,
        tools_field: str = "tools",
    ):
        """Index the shards of ``spec`` (see ``resolve_paths``); file contents are read later, per
        shard.

        ``text_field`` is the jsonl key / parquet column / HF column; ``split`` picks the split of a
        saved ``DatasetDict``; ``txt_split`` is ``"paragraph"`` (blank-line separated documents) or
        ``"file"``.
        ``messages_field`` (chat data, read with ``load_rows``): the key / column of the
        conversations; then a parquet file or saved dataset needs that column or ``text_field``, and
        ``tools_field`` is read where present. ``None``: text only, read with ``load``.
        """
        if txt_split not in ("paragraph", "file"):
            raise ValueError(f"txt_split must be 'paragraph' or 'file', got {txt_split!r}")
        if jsonl_chunk_bytes < 1 or hf_chunk_rows < 1:
            raise ValueError("jsonl_chunk_bytes and hf_chunk_rows must be >= 1")
        self.spec = spec
        self.text_field = text_field
        self.split = split
        self.txt_split = txt_split
        self.messages_field, self.tools_field = messages_field, tools_field
        self._hf: dict[str, object] = {}
        self.shards: list[Shard] = []
        for path in resolve_paths(spec):
            self.shards.extend(self._index(path, jsonl_chunk_bytes, hf_chunk_rows))
        if not self.shards:
            raise ValueError(f"dataset {spec!r} holds no data (every file is empty)")

    def _index(self, path: str, chunk_bytes: int, chunk_rows: int) -> list[Shard]:
        if _is_hf_dir(path):
            ds = self._hf_dataset(path)
            return [
                Shard("hf", path, a, min(a + chunk_rows, len(ds)))
                for a in range(0, len(ds), chunk_rows)
            ]
        if path.endswith(".txt"):
            return [Shard("txt", path)]
        if path.endswith(".jsonl"):
            size = os.path.getsize(path)
            return [
                Shard("jsonl", path, a, min(a + chunk_bytes, size))
                for a in range(0, size, chunk_bytes)
            ]
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path)
        # raises when the needed columns are missing
        self._columns_of(path, meta.schema_arrow.names)
        return [Shard("parquet", path, g, g + 1) for g in range(meta.num_row_groups)]

    def _columns_of(self, path: str, names: list[str]) -> list[str]:
        """The columns to read from a file with columns ``names``: the text, or the chat fields
        present."""
        if self.messages_field is None:
            if self.text_field not in names:
                raise KeyError(f"{path}: no column {self.text_field!r} (columns: {names})")
            return [self.text_field]
        wanted = [c for c in (self.messages_field, self.tools_field, self.text_field) if c in names]
        if self.messages_field not in wanted and self.text_field not in wanted:
            raise KeyError(
                f"{path}: no column {self.messages_field!r} or {self.text_field!r} "
                f"(columns: {names}); name them with messages_field / text_field"
            )
        return wanted

    def _hf_dataset(self, path: str):
        if path not in self._hf:
            import datasets

            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if self.split not in ds:
                    raise KeyError(f"{path}: no split {self.split!r} (splits: {list(ds)})")
                ds = ds[self.split]
            self._hf[path] = ds.select_columns(self._columns_of(path, ds.column_names))
        return self._hf[path]

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def load(self, index: int) -> list[str]:
        """The non-empty documents of shard ``index``, in file order."""
        shard = self.shards[index]
        if shard.kind == "txt":
            try:
                with open(shard.path, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError as e:
                raise ValueError(f"{shard.path}: not valid UTF-8 ({e})") from e
            docs = [text] if self.txt_split == "file" else _BLANK_LINES.split(text)
            return [d.strip() for d in docs if d.strip()]
        if shard.kind == "jsonl":
            texts = self._load_jsonl(shard)
        elif shard.kind == "parquet":
            import pyarrow.parquet as pq

            table = pq.ParquetFile(shard.path).read_row_group(
                shard.start, columns=[self.text_field]
            )
            texts = table.column(self.text_field).to_pylist()
        else:
            texts = self._hf_dataset(shard.path)[shard.start : shard.stop][self.text_field]
        for t in texts:
            if t is not None and not isinstance(t, str):
                raise TypeError(
                    f"{shard.path}: field {self.text_field!r} holds {type(t).__name__}, not text"
                )
        return [t for t in texts if t is not None and t.strip()]

    def _load_jsonl(self, shard: Shard) -> list[str]:
        texts = []
        for offset, record in _jsonl_records(shard):
            if not isinstance(record, dict) or self.text_field not in record:
                hint = (
                    " (it has 'messages': read chat data with format 'chat' or 'auto')"
                    if isinstance(record, dict) and "messages" in record
                    else ""
                )
                raise KeyError(f"{shard.path} at byte {offset}: no field {self.text_field!r}{hint}")
            texts.append(record[self.text_field])
        return texts

    def load_rows(self, index: int) -> list[ChatRow]:
        """The rows of shard ``index`` of a chat source, in file order (empty ones dropped).

        A row with ``messages_field`` is a conversation; one without it (or with it null) but with a
        non-empty ``text_field`` is a text row; ``.txt`` files hold text rows only.
        """
        if self.messages_field is None:
            raise ValueError(
                f"dataset {self.spec!r} was opened for text: give messages_field to read chat rows"
            )
        shard = self.shards[index]
        if shard.kind == "txt":
            texts = self.load(index)
            return [
                ChatRow(None, None, t, f"{shard.path} document {i}") for i, t in enumerate(texts)
            ]
        if shard.kind == "jsonl":
            raw = self._jsonl_chat_fields(shard)
        else:
            if shard.kind == "parquet":
                import pyarrow.parquet as pq

                meta = pq.ParquetFile(shard.path)
                columns = self._columns_of(shard.path, meta.schema_arrow.names)
                table = meta.read_row_group(shard.start, columns=columns)
                data = {c: table.column(c).to_pylist() for c in columns}
                where = f"{shard.path} row group {shard.start} row {{}}"
            else:
                data = self._hf_dataset(shard.path)[shard.start : shard.stop]
                where = f"{shard.path} row {{}}"
            n = len(next(iter(data.values())))
            fields = (self.messages_field, self.tools_field, self.text_field)
            raw = [
                (
                    *(data.get(f, [None] * n)[r] for f in fields),
                    where.format(r if shard.kind == "parquet" else shard.start + r),
                )
                for r in range(n)
            ]
        columnar = shard.kind in ("parquet", "hf")
        rows = [
            _chat_row(*r, self.messages_field, self.tools_field, self.text_field, columnar)
            for r in raw
        ]
        return [r for r in rows if r is not None]

    def _jsonl_chat_fields(self, shard: Shard) -> list[tuple]:
        """``(messages, tools, text, where)`` of every line of a jsonl shard."""
        raw = []
        for offset, record in _jsonl_records(shard):
            where = f"{shard.path} at byte {offset}"
            if not isinstance(record, dict) or (
                self.messages_field not in record and self.text_field not in record
            ):
                raise KeyError(f"{where}: no field {self.messages_field!r} or {self.text_field!r}")
            raw.append(
                (
                    record.get(self.messages_field),
                    record.get(self.tools_field),
                    record.get(self.text_field),
                    where,
                )
            )
        return raw

    def shard_order(self, epoch: int, seed: int, shuffle: bool) -> list[int]:
        """Shard indices in the order epoch ``epoch`` reads them."""
        if not shuffle:
            return list(range(self.num_shards))
        return _rng(seed, epoch, "shards").permutation(self.num_shards).tolist()

    @staticmethod
    def document_order(
        shard: int, num_docs: int, epoch: int, seed: int, shuffle: bool
    ) -> list[int]:
        """Indices into ``load(shard)`` in the order epoch ``epoch`` reads them."""
        if not shuffle:
            return list(range(num_docs))
        return _rng(seed, epoch, "docs", shard).permutation(num_docs).tolist()
