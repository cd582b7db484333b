"""Build the embedded default dataset and tokenizer under ``titan_glm52/assets/``.

Usage (from the repository root)::

    python tools/build_embedded_assets.py            # rebuild the assets in place
    python tools/build_embedded_assets.py --check    # rebuild in memory, fail if the committed
                                                     # files differ

The text is real English prose shipped with CPython itself, so no network is needed:

* ``pydoc_data.topics``: the Python Language Reference topics that ``help()`` shows;
* the docstrings of the pure-Python standard library (modules, classes, functions), read with
  ``ast`` (nothing is imported), with test packages, a few tool packages and the files that carry a
  license of their own left out.

Both are covered by the PSF License Agreement (copied to ``assets/LICENSE-PSF.txt``). The output
depends on the interpreter's standard library, so the assets are only byte-identical when rebuilt
with the Python version recorded in ``assets/README.md``; ``--check`` tells whether they are.

Outputs:

* ``corpus.jsonl``: training documents, one JSON object a line: ``{"id": ..., "text": ...}``;
* ``corpus_val.jsonl``: held-out documents (about 1 in ``VAL_EVERY``, chosen by a hash of the id);
* ``tokenizer/tokenizer.json`` + ``tokenizer/tokenizer_config.json``: byte-level BPE with exactly
  ``VOCAB_SIZE`` entries, trained on the training documents only; ``<|endoftext|>`` is id 0 (eos and
  pad);
* ``LICENSE-PSF.txt``: the CPython license text.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import sys
import sysconfig
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(REPO, "titan_glm52", "assets")

BUILT_WITH_PYTHON = (3, 11, 7)  # the stdlib these assets were built from (see assets/README.md)
VOCAB_SIZE = 2048  # the debug model flavor's vocab_size
EOS_TOKEN = "<|endoftext|>"
MAX_DOC_CHARS = 4000  # documents are cut at paragraph boundaries to about this size
MIN_DOCSTRING_CHARS = 200  # shorter docstrings are mostly one-liners
MIN_PARAGRAPH_DEDUP_CHARS = 100  # repeated paragraphs at least this long are kept once
VAL_EVERY = 25  # about 4% of the documents are held out

# Standard-library directories left out: tests (generated data, odd encodings), tools and vendored
# code.
SKIP_DIRS = {
    "__pycache__",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "ensurepip",
    "site-packages",
    "pydoc_data",
}
# A source file that grants its own license (permissive ones: logging, optparse, tarfile, xml.etree,
# ...) is left out, so that every document is covered by the PSF License alone.
OWN_LICENSE = re.compile(
    r"permission\s+to\s+use|redistribution\s+and\s+use|permission\s+is\s+hereby\s+granted"
    r"|licensed\s+under|two\s+licenses",
    re.IGNORECASE,
)


def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in text.split("\n\n") if p.strip()]


def _pack_paragraphs(units: list[str], limit: int) -> list[str]:
    """Join consecutive units with blank lines into chunks of at most ``limit`` characters.

    A unit longer than ``limit`` is first split at its paragraph boundaries; a single paragraph
    longer than ``limit`` stays whole.
    """
    pieces: list[str] = []
    for unit in units:
        pieces.extend([unit] if len(unit) <= limit else _paragraphs(unit))
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for piece in pieces:
        if current and size + 2 + len(piece) > limit:
            chunks.append("\n\n".join(current))
            current, size = [], 0
        current.append(piece)
        size += len(piece) + (2 if size else 0)
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def topic_documents(seen: set[str]) -> list[tuple[str, str]]:
    """(id, text) documents from the Python Language Reference topics, in sorted topic order."""
    import pydoc_data.topics

    docs = []
    for name in sorted(pydoc_data.topics.topics):
        kept = []
        for para in _paragraphs(pydoc_data.topics.topics[name]):
            if len(para) >= MIN_PARAGRAPH_DEDUP_CHARS:
                if para in seen:
                    continue
                seen.add(para)
            kept.append(para)
        for i, chunk in enumerate(_pack_paragraphs(kept, MAX_DOC_CHARS)):
            docs.append((f"pydoc_topics/{name}#{i}", chunk))
    return docs


def _docstrings_in_source_order(tree: ast.Module, module: str):
    """Yield (qualified name, docstring) for the module and its classes/functions, in source
    order."""
    doc = ast.get_docstring(tree)
    if doc:
        yield module, doc

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{node.name}"
                doc = ast.get_docstring(node)
                if doc:
                    yield name, doc
                yield from visit(node.body, name)

    yield from visit(tree.body, module)


def stdlib_documents(seen: set[str]) -> list[tuple[str, str]]:
    """(id, text) documents from standard-library docstrings, one module at a time in sorted path
    order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    docs = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(
            d for d in dirs if d not in SKIP_DIRS and not d.startswith(("test", "config-"))
        )
        for fname in sorted(files):
            if not fname.endswith(".py"):
                continue
            path = os.path.join(root, fname)
            rel = os.path.relpath(path, stdlib)
            module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
            try:
                with open(path, encoding="utf-8") as f:
                    source = f.read()
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue  # a handful of files are templates or use another encoding
            if OWN_LICENSE.search(source):
                continue
            units = []
            for name, doc in _docstrings_in_source_order(tree, module):
                if len(doc) < MIN_DOCSTRING_CHARS or doc in seen:
                    continue
                seen.add(doc)
                units.append(f"{name}\n\n{doc}")
            for i, chunk in enumerate(_pack_paragraphs(units, MAX_DOC_CHARS)):
                docs.append((f"stdlib/{rel}#{i}", chunk))
    return docs


def is_validation(doc_id: str) -> bool:
    """The held-out rule: a stable hash of the document id (independent of the document order)."""
    return int(hashlib.sha1(doc_id.encode()).hexdigest(), 16) % VAL_EVERY == 0


def _jsonl(docs: list[tuple[str, str]]) -> str:
    return "".join(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n" for i, t in docs)


def train_tokenizer(texts: list[str]):
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``VOCAB_SIZE`` entries, eos at id
    0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(
            f"trained vocab has {tok.get_vocab_size(with_added_tokens=True)} entries, "
            f"wanted {VOCAB_SIZE}: the corpus is too small"
        )
    if tok.token_to_id(EOS_TOKEN) != 0:
        raise RuntimeError(f"{EOS_TOKEN} is not id 0")
    return tok


def build() -> dict[str, bytes]:
    """Every asset file (path relative to ``assets/``) and its bytes."""
    seen: set[str] = set()
    docs = topic_documents(seen) + stdlib_documents(seen)
    train = [d for d in docs if not is_validation(d[0])]
    val = [d for d in docs if is_validation(d[0])]
    tok = train_tokenizer([t for _, t in train])
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(os.path.join(tmp, "tokenizer.json"), pretty=False)
        with open(os.path.join(tmp, "tokenizer.json"), "rb") as f:
            tok_json = f.read()
    tok_config = {
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "model_max_length": 1 << 20,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    license_path = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    with open(license_path, "rb") as f:
        license_text = f.read()
    return {
        "corpus.jsonl": _jsonl(train).encode(),
        "corpus_val.jsonl": _jsonl(val).encode(),
        "tokenizer/tokenizer.json": tok_json,
        "tokenizer/tokenizer_config.json": (json.dumps(tok_config, indent=2) + "\n").encode(),
        "LICENSE-PSF.txt": license_text,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the committed assets; write nothing"
    )
    parser.add_argument(
        "--out", default=ASSETS, help="output directory (default: titan_glm52/assets)"
    )
    args = parser.parse_args()
    if sys.version_info[:3] != BUILT_WITH_PYTHON:
        print(
            f"warning: the committed assets were built with Python "
            f"{'.'.join(map(str, BUILT_WITH_PYTHON))}; "
            f"this is {sys.version.split()[0]}, so the output may differ",
            file=sys.stderr,
        )
    files = build()
    differ = []
    for rel, data in files.items():
        path = os.path.join(args.out, rel)
        if args.check:
            if not os.path.exists(path) or open(path, "rb").read() != data:
                differ.append(rel)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    for rel, data in files.items():
        n_docs = data.count(b"\n") if rel.endswith(".jsonl") else None
        print(
            f"{rel:34s} {len(data):>9,d} bytes"
            + (f"  {n_docs} documents" if n_docs is not None else "")
        )
    if args.check and differ:
        print(f"differs from the committed assets: {', '.join(differ)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
