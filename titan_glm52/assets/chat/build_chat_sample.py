"""Build the embedded chat sample (``chat.jsonl``, ``chat_val.jsonl``) from the embedded English
corpus.

Each conversation is made from one entry of ``../corpus.jsonl`` (``../corpus_val.jsonl`` for the
held-out file): a documented name (a standard-library function, class or module, or a
language-reference topic) and its first paragraphs. The questions are a few fixed phrasings; the
answers, tool results and reasoning are the documentation's own sentences. The kinds, chosen by a
hash of the entry:

* a question and its answer, with or without a system prompt;
* several turns: the answer, then "tell me more" follow-ups answered with the next paragraphs;
* a tool call: the assistant calls ``search_docs``, the tool returns the documentation, the
  assistant answers from it (and sometimes a follow-up asks for one sentence);
* an answer with ``reasoning_content`` (rendered in ``<think></think>`` by the template).

Deterministic (no randomness but sha1 of the entry ids), no network. Run from anywhere::

    python titan_glm52/assets/chat/build_chat_sample.py          # writes the two files
    python titan_glm52/assets/chat/build_chat_sample.py --check  # compares with the committed files
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(os.path.dirname(HERE), "corpus.jsonl")
CORPUS_VAL = os.path.join(os.path.dirname(HERE), "corpus_val.jsonl")
OUTPUTS = {"chat.jsonl": (CORPUS, 320), "chat_val.jsonl": (CORPUS_VAL, 24)}
MAX_PARAGRAPH = 360  # characters; longer paragraphs are cut at a sentence end

SYSTEM_PROMPTS = (
    "You are a concise assistant that answers questions about Python and its standard library.",
    "You are a helpful programming assistant. Answer from the Python documentation.",
    "Answer questions about Python precisely, in plain English.",
)
TOOL_SYSTEM = (
    "You are a Python documentation assistant. Use the search_docs tool to look things up."
)
QUESTIONS = (
    "What does {name} do?",
    "Can you explain {name}?",
    "I am reading about {name}. What is it for?",
    "Tell me about {name}.",
    "What should I know about {name}?",
)
FOLLOW_UPS = (
    "Tell me more.",
    "Is there anything else I should know?",
    "Go on, please.",
    "And then?",
)
TOOL_REQUESTS = (
    "Look up {name} in the documentation and tell me what it says.",
    "Please search the docs for {name}.",
    "Find the documentation of {name} for me.",
)
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the Python documentation and return the entry that matches the "
        "query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "A name or topic to look up."}
            },
            "required": ["query"],
        },
    },
}

_DOTTED = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def _hash(*parts: object) -> int:
    return int.from_bytes(hashlib.sha1("/".join(map(str, parts)).encode()).digest()[:8], "little")


def _pick(options: tuple, *parts: object):
    return options[_hash(*parts) % len(options)]


def _clean(paragraph: str) -> str:
    """A paragraph on one line, cut at a sentence end near ``MAX_PARAGRAPH``; a closing colon (it
    introduced an example left out here) becomes a full stop."""
    text = re.sub(r"[ \t]*\n[ \t]*", " ", paragraph.strip())
    text = text[:-1] + "." if text.endswith(":") else text
    if len(text) <= MAX_PARAGRAPH:
        return text
    cut = [m.start() for m in _SENTENCE_END.finditer(text) if m.start() <= MAX_PARAGRAPH]
    return text[: cut[-1]] if cut else text[:MAX_PARAGRAPH].rsplit(" ", 1)[0] + " ..."


def _prose(paragraph: str) -> bool:
    """Running text, not a grammar rule, a code block or a heading underline."""
    p = paragraph.strip()
    return (
        len(p) >= 60
        and not p.startswith(("   ", "*", "=", "-", ">>>", "..", "("))
        and "::=" not in p
    )


def entries(path: str) -> list[tuple[str, str, list[str]]]:
    """``(entry id, name, prose paragraphs)`` of every documented name in a corpus file, in file
    order."""
    out = []
    with open(path, encoding="utf-8") as f:
        docs = [json.loads(line) for line in f if line.strip()]
    for doc in docs:
        paragraphs = [p for p in re.split(r"\n\s*\n", doc["text"]) if p.strip()]
        if doc["id"].startswith("pydoc_topics/"):
            if doc["id"].endswith("#0"):  # later parts of a topic have no title to ask about
                title = paragraphs[0].split("\n")[0].strip()
                title = "the" + title[3:] if title.startswith("The ") else title
                body = [p for p in paragraphs[1:] if _prose(p)]
                if body:
                    out.append((doc["id"], title, body))
            continue
        name, body = None, []
        for p in paragraphs + ["\0"]:  # "\0" flushes the last entry
            if p == "\0" or ("\n" not in p.strip() and _DOTTED.fullmatch(p.strip())):
                if name and body:
                    out.append((f"{doc['id']}:{name}", f"`{name}`", body))
                name, body = (p.strip() if p != "\0" else None), []
            elif name and _prose(p):
                body.append(p)
    return out


def _first_sentences(text: str, n: int) -> str:
    parts = _SENTENCE_END.split(text)
    return " ".join(parts[:n]).strip()


def conversation(entry_id: str, name: str, paragraphs: list[str]) -> dict:
    """One conversation about an entry (see the module docstring for the kinds)."""
    paras = [_clean(p) for p in paragraphs[:4]]
    kind = _hash(entry_id, "kind") % 10
    system = [{"role": "system", "content": _pick(SYSTEM_PROMPTS, entry_id, "system")}]
    question = {"role": "user", "content": _pick(QUESTIONS, entry_id, "question").format(name=name)}
    if kind <= 3:  # a question, an answer; some without a system prompt
        messages = (system if kind <= 1 else []) + [
            question,
            {"role": "assistant", "content": paras[0]},
        ]
        return {"messages": messages}
    if kind <= 5:  # follow-ups answered with the next paragraphs
        messages = system + [question, {"role": "assistant", "content": paras[0]}]
        for k, p in enumerate(paras[1:3]):
            messages += [
                {"role": "user", "content": _pick(FOLLOW_UPS, entry_id, "follow", k)},
                {"role": "assistant", "content": p},
            ]
        return {"messages": messages}
    if kind <= 8:  # a tool call and an answer from its result
        query = name.strip("`")
        call = {
            "type": "function",
            "function": {"name": "search_docs", "arguments": {"query": query}},
        }
        messages = [
            {"role": "system", "content": TOOL_SYSTEM},
            {"role": "user", "content": _pick(TOOL_REQUESTS, entry_id, "tool").format(name=name)},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": paras[0]},
            {
                "role": "assistant",
                "content": "The documentation says: " + _first_sentences(paras[0], 2),
            },
        ]
        if kind == 8:
            messages += [
                {"role": "user", "content": "Can you say that in one sentence?"},
                {"role": "assistant", "content": _first_sentences(paras[0], 1)},
            ]
        return {"messages": messages, "tools": [SEARCH_TOOL]}
    reasoning = (
        f"The user asks about {name}. The documentation begins: {_first_sentences(paras[0], 1)} "
        f"I will answer with that paragraph."
    )
    return {
        "messages": system
        + [question, {"role": "assistant", "content": paras[0], "reasoning_content": reasoning}]
    }


def build(path: str, count: int) -> bytes:
    """``count`` conversations from evenly spaced entries of ``path``, as jsonl bytes."""
    found = entries(path)
    if len(found) < count:
        raise SystemExit(
            f"{path}: {len(found)} entries, fewer than the {count} conversations wanted"
        )
    step = len(found) / count
    chosen = [found[int(k * step)] for k in range(count)]
    lines = [json.dumps(conversation(*e), ensure_ascii=False) for e in chosen]
    return ("\n".join(lines) + "\n").encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the committed files; write nothing"
    )
    args = parser.parse_args()
    differ = []
    for name, (corpus, count) in OUTPUTS.items():
        data, path = build(corpus, count), os.path.join(HERE, name)
        if args.check:
            if not os.path.exists(path) or open(path, "rb").read() != data:
                differ.append(name)
        else:
            with open(path, "wb") as f:
                f.write(data)
        print(f"{name:16s} {len(data):>9,d} bytes  {count} conversations")
    if differ:
        print(f"differs from the committed files: {', '.join(differ)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
