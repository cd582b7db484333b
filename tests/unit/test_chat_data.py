"""Tests for chat data: templates, loss masks, packing whole conversations, overflow, sources,
resume, dp.

The masks are checked against derivations that share no code with ``titan_glm52.data.chat``: for the
shipped GLM-style template, character spans from renderings made with jinja2 directly, mapped to
tokens through their bytes; for a ChatML-like template written here, transformers' ``{% generation
%}`` tracking (``return_assistant_tokens_mask``); and literal strings written out by hand.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil

import jinja2
import jinja2.sandbox
import numpy as np
import pytest
import torch

from titan_glm52.data import (
    EMBEDDED_DATASETS,
    IGNORE_INDEX,
    ChatDataLoader,
    ChatEncoder,
    ChatRow,
    ChatTemplateError,
    DocumentSource,
    PackedDataLoader,
    Prefetcher,
    build_dataloader,
    build_tokenizer,
    collate,
    find_chat_template,
    has_messages,
    pack_row,
)
from titan_glm52.data.chat import EMBEDDED_TEMPLATE_FILE, ChatRenderError
from titan_glm52.packed import doc_positions

GLM_MARKERS = ("<|user|>", "<|observation|>")

# A ChatML-like template: other role markers, the turn closed by <|im_end|>, and {% generation %}
# around exactly what should be trained (the assistant's text, its tool calls and its <|im_end|>,
# not the newline).
CHATML = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n<tools>' + tools | tojson + '</tools><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set text = m.content | trim if m.content is string else '' -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- text -}}"
    "{%- for call in m.tool_calls | default([]) -%}"
    "{{- '<tool_call>' + call.function | tojson + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + text + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# -------------------------------------------------------------------------------------------
# helpers
@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("embedded")


@pytest.fixture(scope="module")
def sample_rows():
    src = DocumentSource("embedded_chat", messages_field="messages")
    return [r for i in range(src.num_shards) for r in src.load_rows(i)]


def write_template(tmp_path, text: str, name: str = "template.jinja") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def write_chat_jsonl(path, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def as_dict(row: ChatRow) -> dict:
    return {"messages": row.messages, **({"tools": row.tools} if row.tools else {})}


def tagged(rows: list[ChatRow], n: int) -> list[dict]:
    """``n`` conversations from ``rows``, each made unique by its number in the first user
    message."""
    out = []
    for k in range(n):
        d = json.loads(json.dumps(as_dict(rows[k % len(rows)])))
        user = next(m for m in d["messages"] if m["role"] == "user")
        user["content"] = f"[{k}] " + user["content"]
        out.append(d)
    return out


def jinja_render(template: str, messages, tools=None, add_generation_prompt=False) -> str:
    """A rendering with jinja2 itself (transformers' environment settings, its JSON filter)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)

    def fail(message):
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = fail
    return env.from_string(template).render(
        messages=messages,
        tools=tools,
        eos_token="<|endoftext|>",
        add_generation_prompt=add_generation_prompt,
    )


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's character -> byte table: printable bytes stand for themselves, the other
    bytes for the characters from 256 on, in byte order."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_byte_ends(tok, ids: list[int]) -> np.ndarray:
    """The end (exclusive) of each token's bytes in the UTF-8 text the ids spell."""
    from tokenizers import Tokenizer as HF

    hf, table = HF.from_file(tok.path), _byte_decoder()
    return np.cumsum([len(bytes(table[c] for c in hf.id_to_token(i))) for i in ids])


def glm_expected_targets(tok, messages, tools, n_ids: int) -> np.ndarray:
    """The trained tokens of a conversation under the shipped template, from character spans: after
    the generation prompt to the end of the message, then the next message's <|user|> /
    <|observation|>, or after the last message the eos."""
    template = open(EMBEDDED_TEMPLATE_FILE).read()
    renders = [jinja_render(template, messages[:j], tools) for j in range(len(messages) + 1)]
    full = renders[-1]
    spans = []
    for j, m in enumerate(messages):
        if m["role"] != "assistant" or j == 0:
            continue
        start = len(jinja_render(template, messages[:j], tools, add_generation_prompt=True))
        stop = len(renders[j + 1])
        following = full[stop:] if j + 1 < len(messages) else "<|endoftext|>"
        stop += next(
            (len(k) for k in (*GLM_MARKERS, "<|endoftext|>") if following.startswith(k)), 0
        )
        spans.append(
            (
                len(full[:start].encode()),
                len(full[: min(stop, len(full))].encode()),
                stop > len(full),
            )
        )
    ids = tok.encode(full) + [tok.eos_id]
    assert len(ids) == n_ids
    ends = token_byte_ends(tok, ids)
    starts = np.r_[0, ends[:-1]]
    targets = np.zeros(n_ids, dtype=bool)
    for a, b, with_eos in spans:
        targets[:-1] |= (starts[:-1] >= a) & (ends[:-1] <= b)
        targets[-1] |= with_eos
    return targets


def chatml_expected_targets(tok, messages, tools) -> tuple[list[int], np.ndarray]:
    """Ids and trained tokens from transformers' {% generation %} tracking of the ChatML
    template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_file=tok.path, eos_token=tok.eos_token, chat_template=CHATML
    )
    out = hf.apply_chat_template(
        messages, tools=tools, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = list(out["input_ids"]), np.array(out["assistant_masks"], dtype=bool)
    return ids + [tok.eos_id], np.append(mask, False)


def trained_runs(tok, ids, targets) -> list[str]:
    """The texts of the maximal runs of trained tokens."""
    runs, start = [], None
    for i, t in enumerate(list(targets) + [False]):
        if t and start is None:
            start = i
        elif not t and start is not None:
            runs.append(tok.decode(ids[start:i]))
            start = None
    return runs


def take(loader, n: int) -> list[dict]:
    return [next(loader) for _ in range(n)]


def assert_batches_equal(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def check_rows(
    batch: dict, seq_len: int, convs: dict[tuple, np.ndarray], pad_id: int
) -> list[list[tuple]]:
    """Checks every promise of packed chat rows; ``convs`` maps a conversation's ids to its expected
    targets. Returns the conversations (id tuples) of each row."""
    ids, labels, pos, cu = (
        batch["input_ids"],
        batch["labels"],
        batch["positions"],
        batch["cu_seqlens"],
    )
    b_size = ids.shape[0]
    total = b_size * seq_len
    assert cu[0] == 0 and cu[-1] == total and bool((cu[1:] > cu[:-1]).all())
    assert torch.equal(pos.flatten(), doc_positions(cu, total))
    bounds = cu.tolist()
    rows = []
    for b in range(b_size):
        starts = [c - b * seq_len for c in bounds if b * seq_len <= c < (b + 1) * seq_len] + [
            seq_len
        ]
        row_convs = []
        for a, e in zip(starts[:-1], starts[1:]):
            doc = ids[b, a:e].tolist()
            # padding: its own document, no label
            if set(doc) == {pad_id} and tuple(doc) not in convs:
                assert e == seq_len and bool((labels[b, a:e] == IGNORE_INDEX).all())
                continue
            # a whole conversation, or one ending at the row edge with its last token as the label
            # of position seq_len - 1 (only the label-only token is missing from the inputs)
            match = [
                k
                for k in convs
                if list(k[: e - a]) == doc
                and (len(k) == e - a or (e == seq_len and len(k) == e - a + 1))
            ]
            assert len(match) == 1, (b, a, e)
            k = match[0]
            target = convs[k]
            want = [
                k[i + 1] if i + 1 < len(k) and target[i + 1] else IGNORE_INDEX for i in range(e - a)
            ]
            assert labels[b, a:e].tolist() == want
            row_convs.append(k)
        rows.append(row_convs)
    return rows


# ------------------------------------------------------------------------------ templates and masks
def test_shipped_template_masks_literally(tok):
    enc = ChatEncoder(tok)  # the embedded tokenizer: the shipped template, found by default
    assert enc.template.source == open(EMBEDDED_TEMPLATE_FILE).read()
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "zip"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is zip?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "zip() pairs items."},
        {"role": "tool", "content": "It stops at the shortest input."},
        {"role": "assistant", "content": "It pairs items of iterables."},
        {"role": "user", "content": "  Shortest?  "},
        {
            "role": "assistant",
            "content": "Yes, the shortest.",
            "reasoning_content": "Check the docs.",
        },
    ]
    e = enc.encode([ChatRow(messages, None, None, "literal")])[0]
    assert tok.decode(e.ids) == (
        "[gMASK]<sop><|system|>\nBe brief.\n<|user|>\nWhat is zip?\n<|assistant|>\n"
        '<tool_call>{"name": "lookup", "arguments": {"q": "zip"}}</tool_call>\n<|observation|>\n'
        "<tool_response>\nzip() pairs items.\n</tool_response>\n<tool_response>\n"
        "It stops at the shortest input.\n</tool_response>\n<|assistant|>\nIt pairs items of "
        "iterables.\n"
        "<|user|>\nShortest?\n<|assistant|>\n"
        "<think>Check the docs.</think>\nYes, the shortest.\n<|endoftext|>"
    )
    assert trained_runs(tok, e.ids, e.targets) == [
        '<tool_call>{"name": "lookup", "arguments": {"q": "zip"}}</tool_call>\n<|observation|>',
        "It pairs items of iterables.\n<|user|>",
        "<think>Check the docs.</think>\nYes, the shortest.\n<|endoftext|>",
    ]
    # the role markers are ordinary tokens of the embedded vocabulary (several each)
    assert len(tok.encode("<|user|>")) > 1 and len(tok.encode("<|observation|>")) > 1


def test_shipped_template_masks_match_jinja_spans(tok, sample_rows):
    enc = ChatEncoder(tok)
    rows = sample_rows[::3]
    for row, e in zip(rows, enc.encode(rows)):
        expected = glm_expected_targets(tok, row.messages, row.tools, len(e.ids))
        assert np.array_equal(e.targets, expected), row.where
    roles = {m["role"] for r in rows for m in r.messages}
    assert roles == {"system", "user", "assistant", "tool"}


def test_chatml_template_masks_match_generation_tracking(tmp_path, tok, sample_rows):
    enc = ChatEncoder(tok, write_template(tmp_path, CHATML), end_of_turn=["<|im_end|>"])
    rows = sample_rows[::3]
    for row, e in zip(rows, enc.encode(rows)):
        ids, expected = chatml_expected_targets(tok, row.messages, row.tools)
        assert e.ids == ids and np.array_equal(e.targets, expected), row.where
    literal = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye!"},
    ]
    e = enc.encode([ChatRow(literal, None, None, "literal")])[0]
    assert trained_runs(tok, e.ids, e.targets) == ["Hello.<|im_end|>", "Bye!<|im_end|>"]
    # without <|im_end|> as a marker, everything after the generation prompt is trained, the newline
    # too, and the last turn, not closed by a marker, runs on to the conversation's eos
    e = ChatEncoder(tok, write_template(tmp_path, CHATML)).encode(
        [ChatRow(literal, None, None, "x")]
    )[0]
    assert trained_runs(tok, e.ids, e.targets) == [
        "Hello.<|im_end|>\n",
        "Bye!<|im_end|>\n<|endoftext|>",
    ]


def glm_special_tokenizer(tmp_path, tok) -> str:
    """The embedded tokenizer plus GLM's role tokens as special tokens, and a generation_config.json
    that names the stop tokens by id, as the published checkpoint does."""
    from tokenizers import Tokenizer as HF

    directory = tmp_path / "glm_tok"
    directory.mkdir()
    hf = HF.from_file(tok.path)
    hf.add_special_tokens(
        ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
    )
    hf.save(str(directory / "tokenizer.json"))
    shutil.copy(os.path.join(os.path.dirname(tok.path), "tokenizer_config.json"), directory)
    stops = [hf.token_to_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    # published GLM layout: no newline between a message's text and the next role token
    (directory / "chat_template.jinja").write_text(
        "[gMASK]<sop>{% for m in messages %}<|{{ m.role if m.role != 'tool' else 'observation' "
        "}}|>\n"
        "{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    return str(directory)


def test_glm_role_tokens_and_generation_config(tmp_path, tok):
    glm = build_tokenizer(glm_special_tokenizer(tmp_path, tok))
    # the directory's chat_template.jinja; stop tokens from generation_config.json
    enc = ChatEncoder(glm)
    messages = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "tool", "content": "t"},
        {"role": "assistant", "content": "Done."},
    ]
    e = enc.encode([ChatRow(messages, None, None, "x")])[0]
    assert trained_runs(glm, e.ids, e.targets) == ["Hello.<|observation|>", "Done.<|endoftext|>"]
    observation = glm.encode("<|observation|>")
    assert len(observation) == 1 and observation[0] in e.ids


def test_non_prefix_templates_are_refused(tmp_path, tok):
    # the last assistant message gets a think block that later turns take away (a common published
    # form)
    dropping = (
        "{% for m in messages %}<|{{ m.role }}|>\n"
        "{% if m.role == 'assistant' and loop.last %}<think></think>{% endif %}{{ m.content }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    path = write_template(tmp_path, dropping, "dropping.jinja")
    with pytest.raises(ChatTemplateError, match="dropping.jinja.*does not render as a prefix"):
        ChatEncoder(tok, path)
    # eos after the whole conversation only
    closing = (
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}{{ eos_token }}"
    )
    with pytest.raises(ChatTemplateError, match="closing.jinja"):
        ChatEncoder(tok, write_template(tmp_path, closing, "closing.jinja"))
    # renders as a prefix, but a token spans two messages: refused on the row, naming it
    glued = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}{% endif %}"
    )
    enc = ChatEncoder(tok, write_template(tmp_path, glued, "glued.jinja"))
    row = ChatRow(
        [{"role": "user", "content": "th"}, {"role": "assistant", "content": "e"}],
        None,
        None,
        "data.jsonl at byte 0",
    )
    with pytest.raises(
        ChatTemplateError, match="glued.jinja.*tokenize as a prefix.*data.jsonl at byte 0"
    ):
        enc.encode([row])
    # train_on="all" needs no prefix property
    assert ChatEncoder(tok, path, train_on="all").encode([row])[0].targets.all()


def test_template_without_generation_prompt_warns(tmp_path, tok, caplog):
    bare = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    with caplog.at_level("WARNING"):
        enc = ChatEncoder(tok, write_template(tmp_path, bare, "bare.jinja"))
    assert "bare.jinja writes nothing for add_generation_prompt" in caplog.text
    row = ChatRow(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], None, None, ""
    )
    e = enc.encode([row])[0]
    assert trained_runs(tok, e.ids, e.targets) == ["<|assistant|>\nYo\n<|endoftext|>"]


def test_template_lookup(tmp_path, tok):
    directory = tmp_path / "tok"
    directory.mkdir()
    shutil.copy(tok.path, directory)
    config = json.load(open(os.path.join(os.path.dirname(tok.path), "tokenizer_config.json")))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        find_chat_template(build_tokenizer(str(directory)))
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "A"}))
    assert find_chat_template(build_tokenizer(str(directory))).source == "A"
    named = [{"name": "default", "template": "B"}, {"name": "tool_use", "template": "C"}]
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert find_chat_template(build_tokenizer(str(directory))).source == {
        "default": "B",
        "tool_use": "C",
    }
    (directory / "chat_template.jinja").write_text("D")  # the .jinja file wins, as in transformers
    assert find_chat_template(build_tokenizer(str(directory))).source == "D"
    assert find_chat_template(tok, str(directory)).source == "D"
    assert (
        find_chat_template(tok, str(directory / "tokenizer_config.json")).source["tool_use"] == "C"
    )
    assert find_chat_template(tok, "embedded").end_of_turn == GLM_MARKERS
    with pytest.raises(FileNotFoundError, match="no such file"):
        find_chat_template(tok, str(tmp_path / "missing.jinja"))


def test_render_errors_name_the_row(tmp_path, tok):
    enc = ChatEncoder(tok)
    row = ChatRow([{"role": "developer", "content": "x"}], None, None, "d.jsonl at byte 7")
    with pytest.raises(
        ChatRenderError, match=r"embedded .*d.jsonl at byte 7.*unknown role \"developer\""
    ):
        enc.encode([row])
    # a template that cannot render the tool probes is not refused for that: the data decides
    no_tools = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif "
        "%}"
        "<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}{% if add_generation_prompt "
        "%}<|assistant|>\n"
        "{% endif %}"
    )
    ChatEncoder(tok, write_template(tmp_path, no_tools))


# ------------------------------------------------------------------------------------------ packing
@pytest.mark.parametrize("template", ["shipped", "chatml"])
def test_rows_label_exactly_the_assistant_tokens(tmp_path, tok, sample_rows, template):
    convs = tagged(sample_rows, 60)
    path = write_chat_jsonl(tmp_path / "c.jsonl", convs)
    kwargs = (
        {}
        if template == "shipped"
        else {"chat_template": write_template(tmp_path, CHATML), "end_of_turn": ["<|im_end|>"]}
    )
    expected = {}
    for d in convs:
        if template == "shipped":
            ids = tok.encode(
                jinja_render(open(EMBEDDED_TEMPLATE_FILE).read(), d["messages"], d.get("tools"))
            )
            ids.append(tok.eos_id)
            expected[tuple(ids)] = glm_expected_targets(
                tok, d["messages"], d.get("tools"), len(ids)
            )
        else:
            ids, targets = chatml_expected_targets(tok, d["messages"], d.get("tools"))
            expected[tuple(ids)] = targets
    seq_len = 1024
    loader = build_dataloader(
        tok, path, seq_len, 2, format="chat", shuffle=False, infinite=False, **kwargs
    )
    seen, multi = [], 0
    for batch in loader:
        for row in check_rows(batch, seq_len, expected, tok.pad_id):
            seen += row
            multi += len(row) > 1
    assert multi > 5  # several conversations per row
    assert seen == list(expected)[: len(seen)] and len(seen) > 45  # in order, none cut, none lost
    assert loader.stats["truncated"] == loader.stats["split"] == 0


def test_padding_and_exact_fit(tmp_path, tok):
    enc = ChatEncoder(tok)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    n = len(enc.encode([ChatRow(msgs, None, None, "")])[0].ids)
    path = write_chat_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}] * 3)
    # seq_len + 1 == n: each conversation fills a row, its eos the label-only last token
    batch = next(build_dataloader(tok, path, n - 1, 3, format="chat", shuffle=False))
    assert batch["cu_seqlens"].tolist() == [0, n - 1, 2 * (n - 1), 3 * (n - 1)]
    assert bool((batch["labels"][:, -1] == tok.eos_id).all())
    # seq_len == n + 3: one conversation and 4 tokens of padding (3 inputs, their own document)
    batch = next(build_dataloader(tok, path, n + 3, 1, format="chat", shuffle=False))
    assert batch["cu_seqlens"].tolist() == [0, n, n + 3]
    assert batch["positions"][0, n:].tolist() == [0, 1, 2]
    assert bool((batch["labels"][0, n - 1 :] == IGNORE_INDEX).all())
    assert batch["input_ids"][0, n:].tolist() == [tok.pad_id] * 3


# ----------------------------------------------------------------------------------------- overflow
def expected_rows(items, seq_len: int, pad_id: int, n_rows: int) -> list[dict]:
    """Rows by the documented policy, from ``(ids, targets, runs_on)`` items in stream order: an
    item that does not run on goes whole into a row where it fits, else the row is padded; one that
    runs on fills the rest of the row and continues in the next."""
    rows, pieces, targets, budget, k, offset = [], [], [], seq_len + 1, 0, 0
    while len(rows) < n_rows:
        ids, tg, runs_on = items[k]
        if not runs_on and offset == 0 and len(ids) > budget:
            pieces.append([pad_id] * budget)
            targets.append(np.zeros(budget, dtype=bool))
            budget = 0
        else:
            n = min(budget, len(ids) - offset)
            pieces.append(ids[offset : offset + n])
            targets.append(tg[offset : offset + n])
            budget, offset = budget - n, offset + n
            if offset == len(ids):
                k, offset = k + 1, 0
        if budget == 0:
            rows.append(pack_row(pieces, seq_len, targets))
            pieces, targets, budget = [], [], seq_len + 1
    return rows


@pytest.mark.parametrize("overflow", ["truncate", "drop", "split", "error"])
def test_overflow_modes(tmp_path, tok, overflow, caplog):
    short = [
        [
            {"role": "user", "content": f"Question {k}?"},
            {"role": "assistant", "content": f"Answer {k}."},
        ]
        for k in range(2)
    ]
    long = [
        {"role": "user", "content": "Tell me everything."},
        {"role": "assistant", "content": " ".join(f"word{k}" for k in range(120))},
    ]
    path = write_chat_jsonl(
        tmp_path / "o.jsonl", [{"messages": m} for m in (short[0], long, short[1])]
    )
    s0, lg, s1 = ChatEncoder(tok).encode(
        [ChatRow(m, None, None, "") for m in (short[0], long, short[1])]
    )
    seq_len = 96
    assert len(lg.ids) > 3 * (seq_len + 1) and len(s0.ids) + len(s1.ids) <= seq_len + 1
    loader = build_dataloader(
        tok, path, seq_len, 1, format="chat", shuffle=False, overflow=overflow
    )
    if overflow == "error":
        with pytest.raises(
            ValueError, match=r"o.jsonl at byte \d+: a conversation of \d+ tokens is longer"
        ):
            take(loader, 3)
        return
    with caplog.at_level("WARNING"):
        rows = [b for b in take(loader, 8)]
    head = (lg.ids[: seq_len + 1], lg.targets[: seq_len + 1], False)
    epoch = {
        "truncate": [(s0.ids, s0.targets, False), head, (s1.ids, s1.targets, False)],
        "drop": [(s0.ids, s0.targets, False), (s1.ids, s1.targets, False)],
        "split": [
            (s0.ids, s0.targets, False),
            (lg.ids, lg.targets, True),
            (s1.ids, s1.targets, False),
        ],
    }
    expected = expected_rows(epoch[overflow] * 12, seq_len, tok.pad_id, 8)
    assert_batches_equal(rows, [collate([r]) for r in expected])
    if overflow == "truncate":
        assert (
            loader.stats["truncated_tokens"]
            == loader.stats["truncated"] * (len(lg.ids) - seq_len - 1)
            > 0
        )
        assert "were truncated" in caplog.text and "data.chat_overflow" in caplog.text
    elif overflow == "drop":
        assert loader.stats["dropped_long"] >= 2 and "were skipped" in caplog.text
    else:
        assert loader.stats["split"] >= 1 and loader.stats["truncated"] == 0


def test_text_rows_and_train_on_all(tmp_path, tok):
    text = "A plain document among conversations."
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    path = write_chat_jsonl(tmp_path / "m.jsonl", [{"text": text}, {"messages": conv}] * 3)
    # "auto" looks at a jsonl file's first row: this one reads as text
    assert not has_messages(path)
    with pytest.raises(KeyError, match="format 'chat' or 'auto'"):
        next(build_dataloader(tok, path, 256, 1, format="auto"))
    t, c = ChatEncoder(tok).encode([ChatRow(None, None, text, ""), ChatRow(conv, None, None, "")])
    assert t.ids == tok.encode(text) + [tok.eos_id] and t.targets.all()
    seq_len = 40  # text rows run on across rows, conversations stay whole
    items = [(t.ids, t.targets, True), (c.ids, c.targets, False)] * 3 * 4  # 4 epochs of the file
    rows = take(build_dataloader(tok, path, seq_len, 1, format="chat", shuffle=False), 4)
    assert_batches_equal(rows, [collate([r]) for r in expected_rows(items, seq_len, tok.pad_id, 4)])
    everything = next(
        build_dataloader(tok, path, 256, 1, format="chat", shuffle=False, train_on="all")
    )
    cu = everything["cu_seqlens"].tolist()
    # the row ends with padding
    assert set(everything["input_ids"][0, cu[-2] :].tolist()) == {tok.pad_id}
    ends = {c - 1 for c in cu[1:]}
    for i in range(cu[-2]):  # every label but each document's last input
        assert (everything["labels"][0, i] == IGNORE_INDEX) == (i in ends)


def test_conversations_without_trained_tokens_are_skipped(tmp_path, tok):
    rows = [
        {"messages": [{"role": "user", "content": "Nobody answers."}]},
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
    ]
    loader = build_dataloader(
        tok, write_chat_jsonl(tmp_path / "u.jsonl", rows), 64, 1, format="chat"
    )
    next(loader)
    assert loader.stats["dropped_untrained"] >= 1 and loader.stats["conversations"] >= 1
    only = write_chat_jsonl(tmp_path / "only.jsonl", rows[:1])
    with pytest.raises(ValueError, match="no trainable conversation"):
        next(build_dataloader(tok, only, 64, 1, format="chat"))


# ---------------------------------------------------------------------------------- sources, auto
def test_auto_detection(tmp_path, tok, sample_rows):
    chat = write_chat_jsonl(tmp_path / "chat.jsonl", [as_dict(r) for r in sample_rows[:10]])
    text = write_chat_jsonl(
        tmp_path / "text.jsonl", [{"text": f"document number {k}"} for k in range(10)]
    )
    assert has_messages(chat) and not has_messages(text) and has_messages("embedded_chat")
    assert not has_messages("embedded")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.jsonl").write_text("\n")  # no row: the next file decides
    shutil.copy(chat, tmp_path / "dir" / "b.jsonl")
    assert has_messages(str(tmp_path / "dir"))
    assert isinstance(build_dataloader(tok, chat, 128, 1, format="auto"), ChatDataLoader)
    auto_text = build_dataloader(tok, text, 32, 2, format="auto")
    assert type(auto_text) is PackedDataLoader
    assert_batches_equal(take(auto_text, 3), take(build_dataloader(tok, text, 32, 2), 3))
    with pytest.raises(KeyError, match="format 'chat' or 'auto'"):
        # chat rows read as text: the error says what to do
        next(build_dataloader(tok, chat, 128, 1))
    with pytest.raises(ValueError, match="format must be one of"):
        build_dataloader(tok, chat, 128, 1, format="sft")


def test_parquet_and_saved_dataset_give_the_same_batches(tmp_path, tok, sample_rows):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    convs = [as_dict(r) for r in sample_rows[:40]]
    jsonl = write_chat_jsonl(tmp_path / "c.jsonl", convs)
    # columnar: tools as JSON text (their schemas differ), messages as structs (absent keys become
    #     null)
    columns = {
        "messages": [c["messages"] for c in convs],
        "tools": [json.dumps(c["tools"]) if "tools" in c else None for c in convs],
    }
    pq.write_table(pa.table(columns), tmp_path / "c.parquet", row_group_size=7)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns)}).save_to_disk(
        str(tmp_path / "hf")
    )
    sources = [
        DocumentSource(p, messages_field="messages")
        for p in (jsonl, str(tmp_path / "c.parquet"), str(tmp_path / "hf"))
    ]
    loaded = [[as_dict(r) for i in range(s.num_shards) for r in s.load_rows(i)] for s in sources]
    assert loaded[0] == convs and loaded[1] == convs and loaded[2] == convs
    assert sources[1].num_shards == 6
    batches = [
        take(build_dataloader(tok, p, 256, 2, format="auto", shuffle=False), 6)
        for p in (jsonl, str(tmp_path / "c.parquet"), str(tmp_path / "hf"))
    ]
    assert_batches_equal(batches[0], batches[1])
    assert_batches_equal(batches[0], batches[2])


def test_bad_rows_are_refused_with_their_place(tmp_path, tok):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"content": "no role"}]}) + "\n")
    with pytest.raises(
        TypeError, match=r"bad.jsonl at byte 0: every item of 'messages' must be an object"
    ):
        DocumentSource(str(path), messages_field="messages").load_rows(0)
    path.write_text(json.dumps({"messages": "not json"}) + "\n")
    with pytest.raises(
        ValueError, match="bad.jsonl at byte 0: field 'messages' is text but not JSON"
    ):
        DocumentSource(str(path), messages_field="messages").load_rows(0)
    path.write_text(json.dumps({"other": 1}) + "\n")
    with pytest.raises(KeyError, match="no field 'messages' or 'text'"):
        DocumentSource(str(path), messages_field="messages").load_rows(0)


# -------------------------------------------------------------------------------- resume and dp
def chat_loader(path, tok, rank=0, world=1, **kw):
    # several shards
    src = DocumentSource(path, messages_field="messages", jsonl_chunk_bytes=20_000)
    return ChatDataLoader(src, tok, 200, 2, rank, world, seed=4, encoder=ChatEncoder(tok), **kw)


@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, tok, sample_rows, overflow):
    path = write_chat_jsonl(tmp_path / "c.jsonl", tagged(sample_rows, 50))
    for rank in range(2):
        reference = take(chat_loader(path, tok, rank, 2, overflow=overflow), 40)  # several epochs
        loader = chat_loader(path, tok, rank, 2, overflow=overflow)
        for n in (0, 1, 7, 23):
            while loader._samples < 2 * n:
                next(loader)
            state = json.loads(json.dumps(loader.state_dict()))
            assert state["format"] == "chat" and state[f"dp_rank_{rank}"]["conversations"] >= 0
            resumed = chat_loader(path, tok, rank, 2, overflow=overflow)
            resumed.load_state_dict(state)
            assert resumed.state_dict() == state
            assert_batches_equal(take(resumed, 12), reference[n : n + 12])
            assert resumed.stats == chat_loader_stats_after(path, tok, rank, overflow, n + 12)


def chat_loader_stats_after(path, tok, rank, overflow, n):
    loader = chat_loader(path, tok, rank, 2, overflow=overflow)
    take(loader, n)
    return loader.stats


def test_prefetcher_and_distributed_checkpoint(tmp_path, tok, sample_rows):
    import torch.distributed.checkpoint as dcp

    path = write_chat_jsonl(tmp_path / "c.jsonl", tagged(sample_rows, 30))
    reference = take(chat_loader(path, tok), 12)
    pre = Prefetcher(chat_loader(path, tok), 3)
    assert_batches_equal(take(pre, 5), reference[:5])
    dcp.save({"dataloader": pre.state_dict()}, checkpoint_id=str(tmp_path / "ckpt"))
    pre.close()
    resumed = chat_loader(path, tok)
    state = {"dataloader": resumed.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    other = Prefetcher(resumed, 2)
    other.load_state_dict(state["dataloader"])
    assert_batches_equal(take(other, 7), reference[5:])
    other.close()


def test_state_of_the_other_format_is_refused(tmp_path, tok, sample_rows):
    path = write_chat_jsonl(tmp_path / "c.jsonl", tagged(sample_rows, 10))
    text = build_dataloader(tok, "embedded", 64, 1)
    with pytest.raises(ValueError, match="chat loader's; this loader reads text"):
        text.load_state_dict(chat_loader(path, tok).state_dict())
    with pytest.raises(ValueError, match="text loader's; this loader reads chat"):
        chat_loader(path, tok).load_state_dict(text.state_dict())


def test_dp_ranks_cover_every_conversation_once(tmp_path, tok, sample_rows):
    """Over one epoch the ranks' rows hold every conversation once: rank r's first conversations
    (those of epoch 0, whose number is known) are read in order from its rows."""
    convs = tagged(sample_rows, 41)
    path = write_chat_jsonl(tmp_path / "c.jsonl", convs)
    world, seen = 3, []
    for rank in range(world):
        own = len(range(rank, len(convs), world))
        loader = build_dataloader(tok, path, 1024, 1, rank, world, seed=7, format="chat")
        tags: list[int] = []
        while len(tags) < own:
            text = tok.decode(next(loader)["input_ids"][0].tolist())
            tags += [int(t) for t in re.findall(r"\n\[(\d+)\] ", text)]
        assert len(set(tags[:own])) == own
        seen.append(set(tags[:own]))
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    assert set.union(*seen) == set(range(len(convs)))


# ------------------------------------------------------------------------------------- embedded
def test_embedded_chat_sample(tmp_path, tok, sample_rows):
    assets = os.path.dirname(EMBEDDED_DATASETS["embedded_chat"])
    size = sum(os.path.getsize(os.path.join(assets, f)) for f in os.listdir(assets))
    assert size < 500_000
    val = DocumentSource("embedded_chat_val", messages_field="messages")
    val_rows = [r for i in range(val.num_shards) for r in val.load_rows(i)]
    assert len(sample_rows) >= 300 and len(val_rows) >= 20
    assert {m["role"] for r in sample_rows for m in r.messages} == {
        "system",
        "user",
        "assistant",
        "tool",
    }
    assert sum(r.tools is not None for r in sample_rows) > 50
    assert not {json.dumps(as_dict(r)) for r in sample_rows} & {
        json.dumps(as_dict(r)) for r in val_rows
    }
    # the committed files are what the build script writes
    script = os.path.join(assets, "build_chat_sample.py")
    built = runpy.run_path(script)
    for name, (corpus, count) in built["OUTPUTS"].items():
        assert built["build"](corpus, count) == open(os.path.join(assets, name), "rb").read()
    loader = build_dataloader(
        "embedded", "embedded_chat", 512, 2, dp_rank=1, dp_world=2, format="auto"
    )
    for batch in take(loader, 4):
        labels = batch["labels"]
        assert 0 < int((labels != IGNORE_INDEX).sum()) < labels.numel() // 2
        assert bool((batch["input_ids"] < 2048).all())
