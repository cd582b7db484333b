"""kernels/tuning.py: launch overrides are explicit (a ``with`` block), validated, laid over the
defaults and undone; the kernels package reads no environment variable when it is imported."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from titan_glm52.kernels import tuning
from titan_glm52.kernels.tuning import launch_overrides

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
KERNELS = os.path.join(ROOT, "titan_glm52", "kernels")


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"sparse_mla_x": {}}, "unknown kernel module 'sparse_mla_x'"),
        ({"sparse_mla": {"bwd_gradd": {}}}, "unknown part 'bwd_gradd' of sparse_mla"),
        (
            {"sparse_mla": {"bwd_grad": {"DC": 64, "dc": 64}}},
            "unknown key.*'dc' of sparse_mla part",
        ),
        (
            {"indexer_topk": {"select": {"BN": 64}}},
            "unknown key.*'BN' of indexer_topk part 'select'",
        ),
        ({"indexer_loss": {"fwd": {"BH": 8}}}, "unknown key.*'BH'"),
    ],
)
def test_unknown_module_part_or_key_refused(bad, message):
    with pytest.raises(ValueError, match=message) as err:
        with launch_overrides(bad):
            pytest.fail("entered the block")
    assert "\n" not in str(err.value)
    assert tuning.active() == {}


def test_every_tunable_module_names_its_keys():
    for module in tuning.MODULES:
        keys = importlib.import_module(f"titan_glm52.kernels.{module}").LAUNCH_KEYS
        assert keys and all(isinstance(k, frozenset) and k for k in keys.values()), module


def test_overrides_nest_and_are_undone():
    outer = {"sparse_mla": {"fwd": {"BK": 32, "num_warps": 4}}}
    with launch_overrides(outer):
        with launch_overrides({"sparse_mla": {"fwd": {"BK": 16}, "bwd": {"scratch_bytes": 1024}}}):
            assert tuning.overrides("sparse_mla", "fwd") == {"BK": 16, "num_warps": 4}
            assert tuning.overrides("sparse_mla", "bwd") == {"scratch_bytes": 1024}
        assert tuning.active() == outer
        with pytest.raises(RuntimeError):
            with launch_overrides({"sparse_mla": {"fwd": {"BK": 64}}}):
                raise RuntimeError
        assert tuning.overrides("sparse_mla", "fwd") == {"BK": 32, "num_warps": 4}
    assert tuning.active() == {} and tuning.overrides("sparse_mla", "fwd") == {}


def test_parse_reads_json_or_a_file(tmp_path):
    text = '{"indexer_topk": {"score": {"BQ": 8}}}'
    path = tmp_path / "chosen.json"
    path.write_text(text)
    assert tuning.parse("") == {} and tuning.parse(text) == tuning.parse(str(path))
    assert tuning.parse(text) == {"indexer_topk": {"score": {"BQ": 8}}}
    with pytest.raises(ValueError, match="unknown key"):
        tuning.parse('{"indexer_topk": {"score": {"bq": 8}}}')


def test_triton_part_override_laid_over_the_defaults():
    """A part's override changes the keys it names; the shape's other launch parameters stay the
    defaults, and so do the other parts'."""
    from titan_glm52.kernels import sparse_mla as SM

    base, nw, ns = SM._config(64, 576, 512, "bwd_ps")
    fwd = SM._config(64, 576, 512, "fwd")
    with launch_overrides({"sparse_mla": {"bwd_ps": {"BK": 32, "num_stages": 2}}}):
        cfg, nw2, ns2 = SM._config(64, 576, 512, "bwd_ps")
        assert SM._config(64, 576, 512, "fwd") == fwd
    assert cfg == {**base, "BK": 32} and (nw2, ns2) == (nw, 2)
    assert SM._config(64, 576, 512, "bwd_ps") == (base, nw, ns)


def test_no_environment_read_in_the_kernels():
    """No module of the package reads the environment (the interpreter switch is triton's own, read
    by triton when it decorates a kernel; launch variants come from ``launch_overrides``)."""
    for name in sorted(os.listdir(KERNELS)):
        if name.endswith(".py"):
            with open(os.path.join(KERNELS, name)) as f:
                text = f.read()
            assert not any(s in text for s in ("os.environ", "getenv", "TITAN_DSA_TUNE_FILE")), name


_IMPORT_ALL = (
    "import os, torch; import titan_glm52.kernels as K; "
    "from titan_glm52.kernels import _triton_env as E, adam, cross_entropy, indexer_loss, "
    "indexer_topk, indexer_topk_ws, linear_fp32, moe_routing, scale, sparse_mla, sparse_mla_ws, "
    "swiglu, tuning; "
    "from triton.runtime import interpreter as I; "
    "fixed = lambda: bool(getattr(I.InterpreterBuilder.create_dot, '_titan_fixed', False)); "
)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    drop = ("TRITON_INTERPRET", "TITAN_DSA_TUNE_FILE")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL + code],
        cwd=ROOT,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_sets_nothing_and_a_cpu_tensor_needs_the_interpreter():
    """Without TRITON_INTERPRET importing every kernel module leaves the environment and the
    interpreter alone, and a CPU tensor is refused with one line."""
    code = (
        "assert 'TRITON_INTERPRET' not in os.environ and not fixed() and not E.interpreting(); "
        "x = torch.ones(4)\n"
        "try:\n    scale.scaled(x, torch.ones(()))\n"
        "except RuntimeError as e:\n    print('REFUSED', e)\n"
    )
    res = _python(code, TITAN_DSA_TUNE_FILE="/nonexistent.json")
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("REFUSED")]
    assert "need CUDA tensors" in line and "TRITON_INTERPRET=1" in line


def test_interpreter_fixes_applied_at_the_first_launch():
    """With TRITON_INTERPRET=1 set by the caller the fixes to the interpreter wait for the first
    launch, which then rounds fp32 -> bf16 to nearest even (as a compiled kernel does)."""
    code = (
        "assert E.interpreting() and not fixed(); "
        "x, g = torch.ones(3, dtype=torch.bfloat16), torch.tensor(1 + 2 ** -8 + 2 ** -10); "
        "out = scale.scaled(x, g); "  # truncating would give 1.0
        "assert fixed() and torch.equal(out, (x.float() * g).bfloat16()) and out[0] > 1, out; "
        "print('OK')"
    )
    res = _python(code, TRITON_INTERPRET="1")
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr
