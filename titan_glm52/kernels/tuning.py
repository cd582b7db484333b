"""Launch-parameter overrides for benchmarks that compare variants of the kernels' launches.

The kernels launch with module constants chosen by measurement (each module's defaults); a
benchmark passes a variant explicitly, for the calls made inside a ``with`` block::

    from titan_glm52.kernels.tuning import launch_overrides

    variant = {"sparse_mla_ws": {"bwd_ps": {"stages": 4}}, "sparse_mla": {"bwd_grad": {"DC": 128}}}
    with launch_overrides(variant):
        out, lse = sparse_mla(q, kv, idx, scale, d_v)
        out.backward(grad)  # the backward's launches read the overrides when they run

``{module: {part: {key: value}}}``: ``module`` one of ``MODULES``, ``part`` and ``key`` among that
module's ``LAUNCH_KEYS``; a part's keys are laid over its defaults (a part need name only the keys
it changes). Anything else is refused with one line when the block is entered; a value a kernel
cannot run with is refused by the launch that would take it. Blocks nest (the inner one's keys
win) and hold for the whole process, so that autograd's backward threads see them too: a
benchmark's tool, not meant for concurrent callers. Nothing here reads the environment.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator, Mapping

MODULES = ("indexer_loss", "indexer_topk", "indexer_topk_ws", "sparse_mla", "sparse_mla_ws")

# module -> part -> key -> value; replaced (never changed in place) by launch_overrides only
_active: dict[str, dict[str, dict]] = {}


def _validated(overrides: Mapping) -> dict[str, dict[str, dict]]:
    """A copy of ``overrides`` once every module, part and key is found in ``LAUNCH_KEYS``."""
    if not isinstance(overrides, Mapping):
        raise TypeError(
            "launch_overrides takes {module: {part: {key: value}}}, got "
            f"{type(overrides).__name__}"
        )
    out: dict[str, dict[str, dict]] = {}
    for module, parts in overrides.items():
        if module not in MODULES:
            raise ValueError(
                f"launch_overrides: unknown kernel module {module!r}; tunable: {', '.join(MODULES)}"
            )
        known = importlib.import_module(f"{__package__}.{module}").LAUNCH_KEYS
        if not isinstance(parts, Mapping):
            raise TypeError(
                f"launch_overrides: {module} takes {{part: {{key: value}}}}, got {parts!r}"
            )
        for part, cfg in parts.items():
            if part not in known:
                raise ValueError(
                    f"launch_overrides: unknown part {part!r} of {module}; parts: "
                    f"{', '.join(known)}"
                )
            if not isinstance(cfg, Mapping):
                raise TypeError(
                    f"launch_overrides: {module} part {part!r} takes {{key: value}}, got {cfg!r}"
                )
            unknown = ", ".join(map(repr, sorted(set(cfg) - set(known[part]))))
            if unknown:
                raise ValueError(
                    f"launch_overrides: unknown key(s) {unknown} of {module} part "
                    f"{part!r}; keys: {', '.join(sorted(known[part]))}"
                )
            out.setdefault(module, {})[part] = dict(cfg)
    return out


@contextlib.contextmanager
def launch_overrides(overrides: Mapping) -> Iterator[None]:
    """Launches inside the block take ``overrides`` (``{module: {part: {key: value}}}``) over
    their defaults; validated on entry, undone on exit (nested blocks: the inner one's keys win)."""
    global _active
    checked = _validated(overrides)
    previous = _active
    merged = {m: {p: dict(c) for p, c in parts.items()} for m, parts in previous.items()}
    for module, parts in checked.items():
        for part, cfg in parts.items():
            merged.setdefault(module, {}).setdefault(part, {}).update(cfg)
    _active = merged
    try:
        yield
    finally:
        _active = previous


def parse(source: str) -> dict[str, dict[str, dict]]:
    """Overrides from a benchmark's argument: "" (none), a JSON object, or the path of a file
    holding one (as ``bench/kernels.py --tune-out`` writes); validated as ``launch_overrides``
    validates them."""
    if not source.strip():
        return {}
    if source.lstrip().startswith("{"):
        return _validated(json.loads(source))
    with open(source) as f:
        return _validated(json.load(f))


def overrides(module: str, part: str) -> dict:
    """The active overrides of one part of a module (a new dict; empty outside
    ``launch_overrides``)."""
    return dict(_active.get(module, {}).get(part, {}))


def active() -> dict[str, dict[str, dict]]:
    """Every active override (a copy), e.g. to record with a benchmark's results."""
    return {m: {p: dict(c) for p, c in parts.items()} for m, parts in _active.items()}


__all__ = ["MODULES", "launch_overrides", "parse", "overrides", "active"]
