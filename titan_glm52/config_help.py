"""``python train.py --help``: this project's options, section by section, with their documentation.

The job config's own sections come first, then torchtitan's; options the trainer refuses
(torchtitan's that it does not implement) are left out and named at the end, options of which only
the default runs are marked. Each option's text is the docstring under its field (the same text the
TOML user reads in ``config.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

WIDTH = 100
# This project's sections (its own, and torchtitan's it extends) first, then torchtitan's.
ORDER = (
    "model",
    "training",
    "data",
    "dsa",
    "moe",
    "mtp",
    "faults",
    "parallelism",
    "optimizer",
    "lr_scheduler",
    "activation_checkpoint",
    "compile",
    "checkpoint",
    "metrics",
    "profiling",
    "job",
    "debug",
)
# Options of which only the default value runs (``validate`` refuses any other, naming the fix).
DEFAULT_ONLY = (
    "parallelism.tensor_parallel_degree",
    "parallelism.expert_tensor_parallel_degree",
    "parallelism.expert_parallel_comm_backend",
    "training.dtype",
    "training.dataset_path",
    "training.enable_cpu_offload",
    "checkpoint.async_mode",
    "optimizer.early_step_in_backward",
    "model.tokenizer_path",
)


def _field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it, for ``cls`` and its bases (nearest class
    wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if hint is bool:
        return ""
    return getattr(hint, "__name__", str(hint).replace("typing.", "")).upper()


def _option_lines(
    section: str, name: str, hint, default, doc: str, default_only: bool
) -> list[str]:
    key = f"--{section}.{name}"
    flag = f"{key}, --{section}.no_{name}" if hint is bool else f"{key} {_type_name(hint)}"
    mark = "  NOT SUPPORTED: only the default runs" if default_only else ""
    lines = [f"  {flag}  (default: {default!r}){mark}"]
    first = doc.split("\n\n")[0] if doc else ""
    lines += textwrap.wrap(
        " ".join(first.split()), WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6
    )
    return lines


def help_text(job_config_cls: type, not_implemented: dict) -> str:
    """The help text of ``job_config_cls``; ``not_implemented``: section -> "*" or the field names
    left out."""
    out = [
        "usage: torchrun --nproc_per_node N train.py --job.config_file FILE [--section.key VALUE "
        "...]",
        "",
        "Options come from the TOML file's [section] tables (key = value), then from the command "
        "line, which",
        "wins. Booleans: --section.key / --section.no_key. Lists: the values one after another.",
        "",
    ]
    sections = {f.name: f for f in dataclasses.fields(job_config_cls)}
    left_out = []

    def emit(section: str, cls: type) -> None:
        """The options of ``[section]``, then those of the sections nested in it."""
        skip = not_implemented.get(section, ())
        if skip == "*":
            left_out.append(f"[{section}]")
            return
        hints, docs, default = typing.get_type_hints(cls), _field_docs(cls), cls()
        lines, nested = [], []
        for f in dataclasses.fields(cls):
            value = getattr(default, f.name)
            key = f"{section}.{f.name}"
            if dataclasses.is_dataclass(value):
                nested.append((key, type(value)))
                continue
            if f.name in skip or key in not_implemented:
                left_out.append(key)
                continue
            lines += _option_lines(
                section, f.name, hints.get(f.name), value, docs.get(f.name, ""), key in DEFAULT_ONLY
            )
        if lines:
            out.extend([f"[{section}]", *lines, ""])
        for key, nested_cls in nested:
            emit(key, nested_cls)

    for section in ORDER + tuple(s for s in sections if s not in ORDER):
        if section not in sections:
            continue
        field = sections[section]
        emit(
            section,
            field.type if isinstance(field.type, type) else type(field.default_factory()),
        )
    out += textwrap.wrap(
        "Not listed: torchtitan options this trainer does not implement (setting one is "
        "refused, naming it): " + ", ".join(left_out) + ".",
        WIDTH,
    )
    return "\n".join(out)


def print_help(job_config_cls: type, not_implemented: dict) -> None:
    print(help_text(job_config_cls, not_implemented))
