"""Chat data: a conversation -> its token ids and which of them are trained (the loss mask).

The template. A conversation is rendered to text by a Jinja chat template through transformers'
own ``apply_chat_template(..., tokenize=False)`` (the public entry point, the same in transformers
4.4x and 5.x), then tokenized by the loader's ``Tokenizer`` (special tokens written by the
template, such as GLM's ``<|user|>``, become their ids). The template is found as transformers
finds it (``find_chat_template``): ``chat_template.jinja`` (and
``additional_chat_templates/*.jinja``) beside ``tokenizer.json``, else the ``chat_template`` entry
of ``tokenizer_config.json``; or a file or directory named by ``chat_template``; or
``"embedded"``, the GLM-style template shipped in ``titan_glm52/assets/chat/`` (the default for
the embedded tokenizer, whose 2048-token vocabulary has no role tokens: there ``<|user|>`` is 6
ordinary tokens). The template sees ``messages``, ``tools``, ``add_generation_prompt`` and the
tokenizer's ``eos_token`` / ``bos_token`` / ``pad_token``.

The turns. Message ``j``'s tokens are found without knowing the template: render the first ``j`` and
the first ``j + 1`` messages; the tokens of the longer rendering past the shorter one are message
``j``'s. That needs a template that renders a prefix of a conversation as a prefix of its rendering,
and a tokenization that keeps it a prefix; both are checked, on probe conversations when the encoder
is made and on every conversation, and a template that fails is refused (``ChatTemplateError``, one
line naming the template). An assistant message's trained tokens begin after its *generation
prompt*: the rendering of the messages before it with ``add_generation_prompt=True``
(``<|assistant|>`` and its newline: what a server writes before the model speaks); everything after
that, up to the turn's end, is what the model must produce.

The end of an assistant turn. Generation stops at an *end-of-turn marker*: the tokenizer's eos, the
ids in ``generation_config.json``'s ``eos_token_id`` beside ``tokenizer.json`` (GLM-5.2:
``<|endoftext|>``, ``<|user|>``, ``<|observation|>``), the embedded template's ``<|user|>`` and
``<|observation|>``, and any given as ``end_of_turn``. Then:

* the template closes the turn itself (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``): the
  message's tokens end with a marker followed only by whitespace tokens. The marker is trained;
  the whitespace after it is not (the model stops at the marker and never writes it);
* GLM-style: nothing closes the turn but the next role token. The message's tokens are all
  trained, and so is the marker that follows them: the next message's ``<|user|>`` or
  ``<|observation|>`` (all of its tokens where it is several), or, after the last message, the eos
  that ends the conversation. A turn followed by a role that is no marker (``<|system|>``, another
  ``<|assistant|>``) trains no end token;
* otherwise every token after the generation prompt is trained.

A conversation's tokens end with eos (appended unless the template's rendering ends with it): eos is
the document separator of the packed rows, as for text. An assistant message that opens a
conversation has no generation prompt to find (transformers renders no empty conversation) and is
not trained (logged once). ``train_on="all"`` trains every token and needs no prefix property (one
rendering per conversation). Rows without messages (text rows of a mixed dataset) are trained on
every token, like the text loader.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from titan_glm52.data.sources import EMBEDDED_ASSETS_DIR, ChatRow
from titan_glm52.data.tokenizer import EMBEDDED_TOKENIZER_DIR, Tokenizer

logger = logging.getLogger(__name__)

EMBEDDED_TEMPLATE = "embedded"
EMBEDDED_TEMPLATE_FILE = os.path.join(EMBEDDED_ASSETS_DIR, "chat", "chat_template.jinja")
EMBEDDED_END_OF_TURN = ("<|user|>", "<|observation|>")
TRAIN_ON = ("assistant", "all")

# Small conversations that exercise every role: a template must render their prefixes as prefixes.
_TOOL = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the documentation.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}
_PROBES: tuple[tuple[list[dict], list[dict] | None], ...] = (
    (
        [
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
        ],
        None,
    ),
    (
        [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "6."},
        ],
        None,
    ),
    (
        [
            {"role": "system", "content": "You may call tools."},
            {"role": "user", "content": "What does len do?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "search_docs", "arguments": {"query": "len"}},
                    }
                ],
            },
            {"role": "tool", "content": "len(s) returns the number of items of s."},
            {"role": "assistant", "content": "It returns the number of items."},
        ],
        [_TOOL],
    ),
)


class ChatTemplateError(ValueError):
    """A chat template that cannot give loss masks: a prefix does not render or tokenize as a
    prefix."""


class ChatRenderError(ValueError):
    """A chat template that fails on a conversation (its ``raise_exception``, an undefined name,
    ...)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template (one text, or named texts as transformers keeps them), where it came
    from, and the end-of-turn markers it declares (the embedded template's role markers)."""

    source: str | dict[str, str]
    name: str
    end_of_turn: tuple[str, ...] = field(default=())


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _named_templates(value: Any, path: str) -> str | dict[str, str]:
    """A ``chat_template`` config entry: a text, or a list of ``{"name", "template"}`` objects."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(t, dict) and {"name", "template"} <= set(t) for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ChatTemplateError(
        f"{path}: 'chat_template' must be a text or a list of {{name, template}} objects"
    )


def _template_in_dir(directory: str) -> ChatTemplate | None:
    """The template of a tokenizer directory, with transformers' precedence: the ``.jinja`` files,
    then ``tokenizer_config.json``, then a legacy ``chat_template.json``."""
    jinja = os.path.join(directory, "chat_template.jinja")
    extra_dir = os.path.join(directory, "additional_chat_templates")
    named = {}
    if os.path.isfile(jinja):
        named["default"] = _read(jinja)
    if os.path.isdir(extra_dir):
        for entry in sorted(os.listdir(extra_dir)):
            if entry.endswith(".jinja"):
                named[entry[: -len(".jinja")]] = _read(os.path.join(extra_dir, entry))
    if named:
        source = named["default"] if list(named) == ["default"] else named
        return ChatTemplate(source, jinja if os.path.isfile(jinja) else extra_dir)
    for config_name in ("tokenizer_config.json", "chat_template.json"):
        path = os.path.join(directory, config_name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            if isinstance(config, dict) and config.get("chat_template") is not None:
                return ChatTemplate(_named_templates(config["chat_template"], path), path)
    return None


def embedded_chat_template() -> ChatTemplate:
    """The GLM-style template shipped with the embedded chat sample
    (``assets/chat/chat_template.jinja``)."""
    return ChatTemplate(
        _read(EMBEDDED_TEMPLATE_FILE),
        f"{EMBEDDED_TEMPLATE} ({EMBEDDED_TEMPLATE_FILE})",
        EMBEDDED_END_OF_TURN,
    )


def find_chat_template(
    tokenizer: Tokenizer, chat_template: str | ChatTemplate | None = None
) -> ChatTemplate:
    """The template to render conversations with.

    ``None``: the tokenizer directory's (see ``_template_in_dir``); for the embedded tokenizer,
    which has none, the embedded template. ``"embedded"``: the embedded template. A path: a
    ``.jinja`` file (its text), a ``.json`` file (its ``chat_template`` entry), or a tokenizer
    directory. A ``ChatTemplate`` is returned as is.
    """
    if isinstance(chat_template, ChatTemplate):
        return chat_template
    if chat_template == EMBEDDED_TEMPLATE:
        return embedded_chat_template()
    if chat_template is None:
        directory = os.path.dirname(os.path.abspath(tokenizer.path))
        found = _template_in_dir(directory)
        if found is None and directory == os.path.abspath(EMBEDDED_TOKENIZER_DIR):
            found = embedded_chat_template()
        if found is None:
            raise ChatTemplateError(
                f"{directory}: no chat template (no chat_template.jinja, no "
                f"'chat_template' in tokenizer_config.json); name a template file with "
                f"data.chat_template"
            )
        return found
    if os.path.isdir(chat_template):
        found = _template_in_dir(chat_template)
        if found is None:
            raise ChatTemplateError(
                f"{chat_template}: no chat_template.jinja and no 'chat_template' in "
                f"tokenizer_config.json"
            )
        return found
    if not os.path.isfile(chat_template):
        raise FileNotFoundError(
            f"chat template {chat_template!r}: no such file or directory (give a .jinja "
            f"file, a tokenizer_config.json, a tokenizer directory or "
            f"{EMBEDDED_TEMPLATE!r})"
        )
    if chat_template.endswith(".json"):
        with open(chat_template, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict) or config.get("chat_template") is None:
            raise ChatTemplateError(f"{chat_template}: no 'chat_template' entry")
        return ChatTemplate(_named_templates(config["chat_template"], chat_template), chat_template)
    return ChatTemplate(_read(chat_template), chat_template)


class ChatRenderer:
    """Renders conversations to text with transformers' ``apply_chat_template`` (no tokenization).

    The transformers tokenizer is built from the same ``tokenizer.json`` with the same eos/bos/pad,
    so a template sees what it would see under transformers; a dict of named templates is chosen
    from as transformers chooses (``"tool_use"`` when there are tools and it exists, else
    ``"default"``).
    """

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer):
        from transformers import PreTrainedTokenizerFast

        special = {
            name: value
            for name, value in (
                ("eos_token", tokenizer.eos_token),
                ("bos_token", tokenizer.bos_token),
                ("pad_token", tokenizer.pad_token),
            )
            if value is not None
        }
        self.template = template
        self._hf = PreTrainedTokenizerFast(
            tokenizer_file=tokenizer.path, chat_template=template.source, **special
        )

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        where: str = "",
    ) -> str:
        """The text of ``messages``; a template error is re-raised naming the template and
        ``where``."""
        try:
            return self._hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        # a template's raise_exception, an undefined name, a type error inside it
        except Exception as e:
            raise ChatRenderError(
                f"chat template {self.template.name} failed on the conversation at "
                f"{where or '(no place given)'}: {type(e).__name__}: {e}"
            ) from e


@dataclass
class Encoded:
    """A conversation (or text row) as ``ids`` (ending with eos) and ``targets``: one bool per id,
    True where the id is trained (it becomes the label of the position before it)."""

    ids: list[int]
    targets: np.ndarray
    where: str


class ChatEncoder:
    """Rows -> ``Encoded``: rendering, tokenization, the loss mask (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: ChatTemplate | str | None = None,
        train_on: str = "assistant",
        end_of_turn: Sequence[str] = (),
    ):
        """``template``: a ``ChatTemplate`` or what ``find_chat_template`` takes. ``end_of_turn``:
        more end-of-turn markers (texts). Refuses a template that fails the prefix checks on probe
        conversations (only with ``train_on="assistant"``, which relies on them)."""
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
        self.tokenizer, self.train_on = tokenizer, train_on
        self.template = find_chat_template(tokenizer, template)
        self.renderer = ChatRenderer(self.template, tokenizer)
        self.markers = self._end_markers([*self.template.end_of_turn, *end_of_turn])
        self._whitespace: dict[int, bool] = {}
        self._warned_leading_assistant = False
        if train_on == "assistant":
            self._probe()

    # ----------------------------------------------------------------------------------- markers
    def _end_markers(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """Id sequences of the end-of-turn markers, longest first (so the longest one matches)."""
        tok = self.tokenizer
        markers = {(tok.eos_id,)}
        gen_config = os.path.join(
            os.path.dirname(os.path.abspath(tok.path)), "generation_config.json"
        )
        if os.path.isfile(gen_config):
            with open(gen_config, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
            for i in eos if isinstance(eos, list) else [] if eos is None else [eos]:
                if isinstance(i, int) and 0 <= i < tok.vocab_size:
                    markers.add((i,))
        for text in texts:
            ids = tuple(tok.encode(text))
            if not ids:
                raise ValueError(f"end_of_turn marker {text!r} tokenizes to nothing")
            markers.add(ids)
        return sorted(markers, key=lambda m: (-len(m), m))

    def _is_whitespace(self, token_id: int) -> bool:
        if token_id not in self._whitespace:
            self._whitespace[token_id] = self.tokenizer.decode([token_id]).strip() == ""
        return self._whitespace[token_id]

    def _marker_ending_at(self, ids: list[int], end: int, start: int) -> int:
        """Length of a marker that ends exactly at ``end`` and starts at or after ``start``; 0 if
        none."""
        for m in self.markers:
            if end - len(m) >= start and tuple(ids[end - len(m) : end]) == m:
                return len(m)
        return 0

    def _marker_starting_at(self, ids: list[int], start: int) -> int:
        """Length of a marker that starts exactly at ``start``; 0 if none."""
        for m in self.markers:
            if tuple(ids[start : start + len(m)]) == m:
                return len(m)
        return 0

    def turn_end(self, ids: list[int], start: int, stop: int) -> int:
        """The end (exclusive) of the trained tokens of an assistant turn whose tokens after its
        generation prompt are ``ids[start:stop]`` (``ids`` goes on with what follows the turn)."""
        closed = stop
        while closed > start and self._is_whitespace(ids[closed - 1]):
            closed -= 1
        if self._marker_ending_at(ids, closed, start):
            # the template closed the turn: train its marker, not the whitespace after it
            return closed
        # GLM-style: the next role token ends the turn
        return stop + self._marker_starting_at(ids, stop)

    # ---------------------------------------------------------------------------------- encoding
    def encode(self, rows: Sequence[ChatRow]) -> list[Encoded]:
        """The ``Encoded`` of every row, in order (one batched tokenization for all of them)."""
        plans = [self._plan(row) for row in rows]
        ids = self.tokenizer.encode_batch([t for texts, _ in plans for t in texts])
        out, k = [], 0
        for row, (texts, turns) in zip(rows, plans):
            out.append(self._assemble(row, turns, ids[k : k + len(texts)]))
            k += len(texts)
        return out

    def _plan(self, row: ChatRow) -> tuple[list[str], list[int]]:
        """The texts to tokenize for a row, and its trained assistant messages. The texts: its text,
        its whole rendering, or (assistant masks) the rendering of messages 1..j for every j, then
        the generation prompt before each trained assistant message, checked to be prefixes as
        text."""
        if row.messages is None:
            return [row.text], []
        if self.train_on == "all":
            return [self.renderer.render(row.messages, row.tools, where=row.where)], []
        msgs, turns = row.messages, self._assistant_turns(row)
        prefixes = [
            self.renderer.render(msgs[:j], row.tools, where=row.where)
            for j in range(1, len(msgs) + 1)
        ]
        prompts = [
            self.renderer.render(msgs[:j], row.tools, add_generation_prompt=True, where=row.where)
            for j in turns
        ]
        self._check_text_prefixes(row, turns, prefixes, prompts)
        return prefixes + prompts, turns

    def _assistant_turns(self, row: ChatRow) -> list[int]:
        """Indices of the assistant messages that have a generation prompt (all but a leading
        one)."""
        turns = [j for j, m in enumerate(row.messages) if m["role"] == "assistant"]
        if turns and turns[0] == 0:
            if not self._warned_leading_assistant:
                logger.warning(
                    "chat data: %s opens with an assistant message; an opening assistant "
                    "message has no prompt and is not trained (logged once)",
                    row.where,
                )
                self._warned_leading_assistant = True
            turns = turns[1:]
        return turns

    def _refuse(self, row: ChatRow, j: int, what: str) -> ChatTemplateError:
        return ChatTemplateError(
            f"chat template {self.template.name}: {what} (messages 1..{j} and 1..{j + 1} of the "
            "conversation "
            f"at {row.where or 'a probe conversation'}); assistant loss masks need a template "
            "whose rendering "
            f"only grows as messages are added: give another with data.chat_template, or "
            "train_on='all'"
        )

    def _check_text_prefixes(
        self, row: ChatRow, turns: list[int], prefixes: list[str], prompts: list[str]
    ) -> None:
        for j in range(1, len(prefixes)):
            if not prefixes[j].startswith(prefixes[j - 1]):
                raise self._refuse(
                    row, j, "a prefix of the conversation does not render as a prefix"
                )
        for j, prompt in zip(turns, prompts):
            if not (prompt.startswith(prefixes[j - 1]) and prefixes[j].startswith(prompt)):
                raise self._refuse(
                    row,
                    j,
                    f"the generation prompt before message {j + 1} is not a prefix "
                    f"of that message's rendering",
                )

    def _assemble(self, row: ChatRow, turns: list[int], ids: list[list[int]]) -> Encoded:
        eos = self.tokenizer.eos_id
        if row.messages is None or self.train_on == "all":
            tokens = ids[0] + (
                [eos] if row.messages is None or not ids[0] or ids[0][-1] != eos else []
            )
            return Encoded(tokens, np.ones(len(tokens), dtype=bool), row.where)
        n = len(row.messages)
        prefixes, prompts = ids[:n], ids[n:]
        full = prefixes[-1]
        bounds = [0] + [len(p) for p in prefixes]
        for j in range(1, n):
            if bounds[j] > bounds[j + 1] or prefixes[j - 1] != full[: bounds[j]]:
                raise self._refuse(
                    row,
                    j,
                    "a prefix of the conversation does not tokenize as a prefix "
                    "(a token spans the boundary of two messages)",
                )
        tokens = full + ([eos] if not full or full[-1] != eos else [])
        targets = np.zeros(len(tokens), dtype=bool)
        for j, prompt in zip(turns, prompts):
            start = len(prompt)
            if not bounds[j] <= start <= bounds[j + 1] or prompt != full[:start]:
                raise self._refuse(
                    row,
                    j,
                    f"the generation prompt before message {j + 1} does not "
                    f"tokenize as a prefix of that message",
                )
            targets[start : self.turn_end(tokens, start, bounds[j + 1])] = True
        return Encoded(tokens, targets, row.where)

    def _probe(self) -> None:
        """Refuse a template that fails the prefix checks on small conversations of every role. A
        probe that the template cannot render (roles it does not support, say) is skipped: data will
        tell."""
        for k, (messages, tools) in enumerate(_PROBES):
            roles = ", ".join(m["role"] for m in messages)
            try:
                self.encode(
                    [ChatRow(messages, tools, None, f"probe conversation {k + 1} ({roles})")]
                )
            except ChatRenderError:
                continue
        opening = _PROBES[0][0][:1]
        if self.renderer.render(opening, add_generation_prompt=True) == self.renderer.render(
            opening
        ):
            logger.warning(
                "chat template %s writes nothing for add_generation_prompt: each assistant "
                "message is trained from its first token on, its role header included",
                self.template.name,
            )
