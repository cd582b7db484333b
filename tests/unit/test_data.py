"""Tests for titan_glm52.data: tokenizer, file formats, packing, dp sharding, determinism, resume,
embedded."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from titan_glm52.data import (
    EMBEDDED_DATASETS,
    IGNORE_INDEX,
    DocumentSource,
    PackedDataLoader,
    Tokenizer,
    build_dataloader,
    build_tokenizer,
    collate,
    pack_row,
)
from titan_glm52.packed import doc_positions

EOS = "<eos>"


# -------------------------------------------------------------------------------------------
# helpers
def word_docs(n: int, seed: int = 0, max_words: int = 12) -> list[str]:
    """Documents whose words are all distinct: every token id names one (document, word) pair."""
    rng = random.Random(seed)
    return [" ".join(f"d{d}w{k}" for k in range(rng.randint(1, max_words))) for d in range(n)]


def write_word_tokenizer(
    directory, docs: list[str], config: dict | None = None, eos: str = EOS
) -> str:
    """A word-level tokenizer over the words of ``docs`` (special token ``eos`` = id 0), saved as an
    HF dir."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    words = sorted({w for d in docs for w in d.split()})
    vocab = {eos: 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([eos])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    if config is not None:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
    return str(directory)


def write_jsonl(path, docs: list[str], field: str = "text") -> str:
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({field: d, "other": 1}) + "\n")
    return str(path)


@pytest.fixture
def word_setup(tmp_path):
    docs = word_docs(41)
    tok = Tokenizer(write_word_tokenizer(tmp_path / "tok", docs, {"eos_token": EOS}))
    return docs, tok, write_jsonl(tmp_path / "docs.jsonl", docs)


def take(loader, n: int) -> list[dict]:
    return [next(loader) for _ in range(n)]


def assert_batches_equal(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def all_docs(source: DocumentSource) -> list[str]:
    return [d for i in range(source.num_shards) for d in source.load(i)]


# -----------------------------------------------------------------------------------------
# tokenizer
def test_embedded_tokenizer_round_trip():
    tok = build_tokenizer("embedded")
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.bos_id) == (2048, 0, 0, None)
    assert tok.eos_token == "<|endoftext|>"
    text = (
        "The quick brown fox jumps over the lazy dog.\n\n"
        "  def f(x):\n\treturn x ** 2  # café, naïve, 漢字"
    )
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids) and tok.eos_id not in ids
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "a b"]) == [ids, tok.encode("a b")]
    assert tok.decode(ids + [tok.eos_id]) == text + "<|endoftext|>"
    assert tok.decode(ids + [tok.eos_id], skip_special_tokens=True) == text


def test_tokenizer_special_tokens_from_config_files(tmp_path):
    docs = ["<s> a b", "</s> <pad>"]
    path = write_word_tokenizer(
        tmp_path / "t", docs, {"eos_token": "b", "bos_token": {"content": "<s>"}, "pad_token": None}
    )
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": {"content": "</s>", "lstrip": False}, "pad_token": "<pad>"}, f)
    tok = Tokenizer(path)  # special_tokens_map.json wins over tokenizer_config.json
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == ("</s>", "<s>", "<pad>")
    vocab = {t: tok.encode(t)[0] for t in ("</s>", "<s>", "<pad>")}
    assert (tok.eos_id, tok.bos_id, tok.pad_id) == (vocab["</s>"], vocab["<s>"], vocab["<pad>"])
    # the file path works too
    assert Tokenizer(os.path.join(path, "tokenizer.json")).eos_token == "</s>"


def test_tokenizer_fallbacks_and_errors(tmp_path):
    # no config: eos from known names
    tok = Tokenizer(write_word_tokenizer(tmp_path / "a", ["x </s>"]))
    assert tok.eos_token == "</s>" and tok.pad_id == tok.eos_id and tok.bos_id is None
    with pytest.raises(ValueError, match="no eos token"):
        # not a known eos name
        Tokenizer(write_word_tokenizer(tmp_path / "b", ["x y"], eos="<end>"))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        Tokenizer(write_word_tokenizer(tmp_path / "c", ["x"], {"eos_token": "<|nope|>"}))
    with pytest.raises(FileNotFoundError):
        Tokenizer(str(tmp_path / "missing"))


# -------------------------------------------------------------------------------------------
# sources
def test_txt_paragraph_and_file_split(tmp_path):
    (tmp_path / "a.txt").write_text(
        "First doc line one.\nline two.\n\n\n  \nSecond doc.\n \t\nThird.\n"
    )
    src = DocumentSource(str(tmp_path / "a.txt"))
    assert all_docs(src) == ["First doc line one.\nline two.", "Second doc.", "Third."]
    src = DocumentSource(str(tmp_path / "a.txt"), txt_split="file")
    assert all_docs(src) == ["First doc line one.\nline two.\n\n\n  \nSecond doc.\n \t\nThird."]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 50, 1 << 20])
def test_jsonl_byte_range_shards_read_every_line_once(tmp_path, chunk_bytes):
    docs = word_docs(23) + ["ünïcødé ☃ text", "line\nwith newline"]
    path = write_jsonl(tmp_path / "d.jsonl", docs, field="body")
    with open(path, "a") as f:
        # dropped
        f.write("\n" + json.dumps({"body": "   "}) + "\n" + json.dumps({"body": None}) + "\n")
    src = DocumentSource(path, text_field="body", jsonl_chunk_bytes=chunk_bytes)
    assert all_docs(src) == docs
    with pytest.raises(KeyError, match="no field 'text'"):
        all_docs(DocumentSource(path, jsonl_chunk_bytes=chunk_bytes))


def test_parquet_row_groups_and_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = word_docs(10)
    pq.write_table(
        pa.table({"content": docs, "n": list(range(10))}), tmp_path / "d.parquet", row_group_size=3
    )
    src = DocumentSource(str(tmp_path / "d.parquet"), text_field="content")
    assert src.num_shards == 4 and all_docs(src) == docs
    with pytest.raises(KeyError, match="no column 'text'"):
        DocumentSource(str(tmp_path / "d.parquet"))


def test_saved_hf_dataset_and_dataset_dict(tmp_path):
    import datasets

    docs = word_docs(8)
    datasets.Dataset.from_dict({"t": docs, "n": list(range(8))}).save_to_disk(str(tmp_path / "ds"))
    src = DocumentSource(str(tmp_path / "ds"), text_field="t", hf_chunk_rows=3)
    assert src.num_shards == 3 and all_docs(src) == docs
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": docs[:5]}),
            "validation": datasets.Dataset.from_dict({"text": docs[5:]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert all_docs(DocumentSource(str(tmp_path / "dd"))) == docs[:5]
    assert all_docs(DocumentSource(str(tmp_path / "dd"), split="validation")) == docs[5:]
    with pytest.raises(KeyError, match="no split 'test'"):
        DocumentSource(str(tmp_path / "dd"), split="test")


def test_directory_and_glob_are_sorted_and_typed(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "b.jsonl", ["from b"])
    (tmp_path / "a.txt").write_text("from a\n\nfrom a again\n")
    pq.write_table(pa.table({"text": ["from c"]}), tmp_path / "sub" / "c.parquet")
    (tmp_path / "notes.md").write_text("ignored in a directory")
    assert all_docs(DocumentSource(str(tmp_path))) == ["from a", "from a again", "from b", "from c"]
    assert all_docs(DocumentSource(str(tmp_path / "**" / "*.parquet"))) == ["from c"]
    assert all_docs(DocumentSource(str(tmp_path / "*.jsonl"))) == ["from b"]
    with pytest.raises(FileNotFoundError):
        DocumentSource(str(tmp_path / "*.nothing"))
    with pytest.raises(ValueError, match="unsupported"):
        DocumentSource(str(tmp_path / "notes.md"))


# -------------------------------------------------------------------------------------------
# packing
def test_pack_row_exact():
    # seq_len 8: 9 tokens = tail of a doc [1, 2, eos], a whole doc [3, 4, 5, eos], the head of a doc
    # [6, 7].
    row = pack_row([[1, 2, 0], [3, 4, 5, 0], [6, 7]], seq_len=8)
    assert row["input_ids"].tolist() == [1, 2, 0, 3, 4, 5, 0, 6]
    assert row["labels"].tolist() == [2, 0, IGNORE_INDEX, 4, 5, 0, IGNORE_INDEX, 7]
    assert row["positions"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert row["cu_seqlens"].tolist() == [0, 3, 7, 8] and row["cu_seqlens"].dtype == torch.int32
    # A document ending on the last input: its eos's label would be the next doc's first token.
    row = pack_row([[1, 2, 0], [3]], seq_len=3)
    assert row["labels"].tolist() == [2, 0, IGNORE_INDEX] and row["cu_seqlens"].tolist() == [0, 3]
    # A document whose eos is the label-only token: no boundary inside the inputs, every label
    # valid.
    row = pack_row([[1, 2, 3, 0]], seq_len=3)
    assert row["labels"].tolist() == [2, 3, 0] and row["cu_seqlens"].tolist() == [0, 3]
    batch = collate([pack_row([[1, 2, 0], [3, 4]], 4), pack_row([[5], [0, 6, 7, 8]], 4)])
    assert batch["cu_seqlens"].tolist() == [0, 3, 4, 5, 8]
    with pytest.raises(ValueError):
        pack_row([[1, 2]], seq_len=2)


def check_batch(batch: dict, seq_len: int, batch_size: int, eos_id: int) -> None:
    """Every invariant a batch promises (documents never hold a literal eos here)."""
    ids, labels, pos, cu = (
        batch["input_ids"],
        batch["labels"],
        batch["positions"],
        batch["cu_seqlens"],
    )
    assert ids.shape == labels.shape == pos.shape == (batch_size, seq_len)
    assert ids.dtype == labels.dtype == pos.dtype == torch.int64 and cu.dtype == torch.int32
    total = batch_size * seq_len
    assert cu[0] == 0 and cu[-1] == total and bool((cu[1:] > cu[:-1]).all())
    assert set(range(0, total, seq_len)) <= set(cu.tolist())  # every row start is a boundary
    # what the model derives from cu_seqlens
    assert torch.equal(pos.flatten(), doc_positions(cu, total))
    boundaries = set(cu.tolist())
    for b in range(batch_size):
        for i in range(seq_len):
            is_eos = bool(ids[b, i] == eos_id)
            # no loss from a doc's eos into the next doc
            assert (labels[b, i] == IGNORE_INDEX) == is_eos
            if i + 1 < seq_len:
                assert ((b * seq_len + i + 1) in boundaries) == is_eos
                if not is_eos:
                    assert labels[b, i] == ids[b, i + 1]


def expected_rank_stream(
    source: DocumentSource,
    tok: Tokenizer,
    rank: int,
    world: int,
    seed: int,
    shuffle: bool,
    epochs: int,
) -> list[int]:
    """The documented stream: in each epoch, document j of the epoch order belongs to rank j %
    world."""
    stream, j = [], 0
    for epoch in range(epochs):
        j = 0
        for shard in source.shard_order(epoch, seed, shuffle):
            texts = source.load(shard)
            for p in source.document_order(shard, len(texts), epoch, seed, shuffle):
                if j % world == rank:
                    stream += tok.encode(texts[p]) + [tok.eos_id]
                j += 1
    return stream


@pytest.mark.parametrize("world,shuffle", [(1, False), (3, True)])
def test_loader_rows_follow_the_documented_stream(tmp_path, word_setup, world, shuffle):
    docs, tok, path = word_setup
    seq_len, bsz = 7, 2
    for rank in range(world):
        src = DocumentSource(path, jsonl_chunk_bytes=97)  # several shards
        loader = PackedDataLoader(src, tok, seq_len, bsz, rank, world, seed=5, shuffle=shuffle)
        stream = expected_rank_stream(src, tok, rank, world, 5, shuffle, epochs=3)
        n_batches = len(stream) // ((seq_len + 1) * bsz) - 1  # runs well into the third epoch
        assert n_batches > 3
        for k, batch in enumerate(take(loader, n_batches)):
            check_batch(batch, seq_len, bsz, tok.eos_id)
            for b in range(bsz):
                row = stream[(k * bsz + b) * (seq_len + 1) : (k * bsz + b + 1) * (seq_len + 1)]
                assert batch["input_ids"][b].tolist() == row[:-1]
                assert batch["labels"][b, -1] in (row[-1], IGNORE_INDEX)


def test_dp_ranks_disjoint_and_covering(word_setup):
    docs, tok, path = word_setup
    world, seq_len = 3, 5
    seen = []
    for rank in range(world):  # one epoch each; every token id names one (document, word)
        loader = build_dataloader(tok, path, seq_len, 1, rank, world, seed=11, infinite=False)
        ids = set()
        for batch in loader:
            ids |= set(batch["input_ids"].flatten().tolist()) | set(
                batch["labels"].flatten().tolist()
            )
        seen.append(ids - {tok.eos_id, IGNORE_INDEX})
    for a in range(world):
        for b in range(a + 1, world):
            assert not seen[a] & seen[b]
    all_ids = {i for d in docs for i in tok.encode(d)}
    missing = all_ids - set.union(*seen)
    # Only each rank's unfinished last row and first tokens hidden behind a row-edge eos may be
    # unseen.
    assert len(missing) <= world * (seq_len + 1) + len(docs) // 4
    assert {tuple(tok.encode(d)) for d in docs if not set(tok.encode(d)) & set.union(*seen)} <= {
        tuple(tok.encode(d)) for d in docs if len(tok.encode(d)) <= seq_len + 1
    }


def test_too_few_documents_for_dp_world(tmp_path, word_setup):
    docs, tok, _ = word_setup
    path = write_jsonl(tmp_path / "two.jsonl", docs[:2])
    loader = build_dataloader(tok, path, 4, 1, dp_rank=2, dp_world=3)
    with pytest.raises(ValueError, match="fewer than dp_world=3"):
        next(loader)


# ------------------------------------------------------------------------------ determinism, resume
def test_same_seed_same_batches_other_seed_other_batches(word_setup):
    _, tok, path = word_setup
    a = take(build_dataloader(tok, path, 6, 2, 1, 2, seed=3), 20)
    assert_batches_equal(a, take(build_dataloader(tok, path, 6, 2, 1, 2, seed=3), 20))
    b = take(build_dataloader(tok, path, 6, 2, 1, 2, seed=4), 20)
    assert any(not torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))


@pytest.mark.parametrize("n_before", [0, 1, 13, 40])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, word_setup, n_before):
    _, tok, path = word_setup

    def make(rank):
        return PackedDataLoader(
            DocumentSource(path, jsonl_chunk_bytes=131), tok, 6, 3, rank, 2, seed=9
        )

    for rank in range(2):
        reference = take(make(rank), n_before + 15)  # 40 + 15 batches cross several epoch edges
        loader = make(rank)
        take(loader, n_before)
        state = json.loads(json.dumps(loader.state_dict()))  # plain ints survive any serialisation
        take(loader, 2)  # the state is a snapshot, not a live view
        resumed = make(rank)
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
        assert_batches_equal(take(resumed, 15), reference[n_before:])


def test_resume_after_every_row(word_setup):
    """Resuming after each of 60 rows, including rows that end exactly on a document's eos."""
    _, tok, path = word_setup
    reference = take(build_dataloader(tok, path, 4, 1, 0, 1, seed=2), 64)
    loader = build_dataloader(tok, path, 4, 1, 0, 1, seed=2)
    for n in range(60):
        resumed = build_dataloader(tok, path, 4, 1, 0, 1, seed=2)
        resumed.load_state_dict(loader.state_dict())
        assert_batches_equal(take(resumed, 4), reference[n : n + 4])
        next(loader)


def test_state_round_trips_through_distributed_checkpoint(tmp_path, word_setup):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.stateful import Stateful

    _, tok, path = word_setup
    loader = build_dataloader(tok, path, 6, 2, 0, 2, seed=1)
    assert isinstance(loader, Stateful)
    take(loader, 7)
    dcp.save({"dataloader": loader.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    reference = take(loader, 5)
    resumed = build_dataloader(tok, path, 6, 2, 0, 2, seed=1)
    state = {"dataloader": resumed.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    resumed.load_state_dict(state["dataloader"])
    assert_batches_equal(take(resumed, 5), reference)


def test_load_state_dict_refuses_another_layout(word_setup):
    _, tok, path = word_setup
    state = build_dataloader(tok, path, 6, 2, 0, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="dp_world=2"):
        build_dataloader(tok, path, 6, 2, 0, 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="no entry 'dp_rank_1'"):
        build_dataloader(tok, path, 6, 2, 1, 2, seed=1).load_state_dict(state)


# ------------------------------------------------------------------------------------------
# embedded
def test_embedded_default_is_real_text_and_packs():
    assets = os.path.dirname(EMBEDDED_DATASETS["embedded"])
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(assets) for f in fs)
    assert size < 3 << 20
    train, val = DocumentSource("embedded"), DocumentSource("embedded_val")
    train_docs, val_docs = all_docs(train), all_docs(val)
    assert len(train_docs) > 300 and len(val_docs) > 8 and not set(train_docs) & set(val_docs)
    text = " ".join(train_docs)
    words = text.split()
    assert len(text) > 1_000_000 and sum(
        w.lower() in ("the", "of", "is", "a", "to") for w in words
    ) > 0.05 * len(words)

    tok = build_tokenizer("embedded")
    for name in ("embedded", "embedded_val"):
        loader = build_dataloader("embedded", name, 128, 2, dp_rank=1, dp_world=2, seed=0)
        for batch in take(loader, 3):
            check_batch(batch, 128, 2, tok.eos_id)
            assert bool((batch["input_ids"] < 2048).all())
            decoded = tok.decode(batch["input_ids"][0].tolist())
            assert sum(c.isalpha() or c.isspace() for c in decoded) > 0.7 * len(decoded)
