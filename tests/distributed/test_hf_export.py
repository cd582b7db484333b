"""Streaming HF export of sharded / pipelined models: the directory equals the single-process export
tensor for tensor (bitwise, same dtypes), with the same config.json, and loads in transformers."""

import json
import os

import pytest
import torch

from tests.distributed.cases import debug_args
from tests.distributed.hf_export_cases import check_hf_export
from tests.distributed.launcher import Case, assert_passed, run_cases, selected_cases
from tests.parity.test_hf_parity import randomise
from tests.parity.test_hf_roundtrip import read_all
from titan_glm52 import GLM52Model, save_hf_model
from titan_glm52.hf_checkpoint import INDEX_NAME
from titan_glm52.hf_export import num_units


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The source checkpoint (fp32) and the single-process bf16 exports of it, with and without the
    MTP layer."""
    root = tmp_path_factory.mktemp("hf_export")
    model = GLM52Model(debug_args())
    model.init_weights()
    randomise(model, 7)
    save_hf_model(model, str(root / "src"), dtype=torch.float32)
    save_hf_model(model, str(root / "ref_mtp"), dtype=torch.bfloat16)
    model.mtp = None  # save_hf_model then writes num_nextn_predict_layers = 0
    save_hf_model(model, str(root / "ref_no_mtp"), dtype=torch.bfloat16)
    return root


LAYOUTS = {
    "fsdp2": (2, dict(dp_shard=2)),
    "ep2_fsdp2": (4, dict(dp_shard=4, ep=2)),
    "pp2": (2, dict(pp=2)),
    "pp2_fsdp2_no_mtp": (4, dict(pp=2, dp_shard=2, with_mtp=False)),
    "hsdp2x2_ep2": (4, dict(dp_replicate=2, dp_shard=2, ep=2)),
}


@pytest.fixture(scope="module")
def case_results(request, dirs):
    """The layouts' exports of ``dirs / "src"`` into ``dirs / "out_<layout>"``, grouped
    (``launcher.run_cases``)."""
    cases = {
        name: Case(
            check_hf_export,
            world,
            dict(kwargs, src_dir=str(dirs / "src"), out_dir=str(dirs / f"out_{name}")),
            180,
        )
        for name, (world, kwargs) in LAYOUTS.items()
    }
    return run_cases(selected_cases(request, cases), str(dirs / "rank_reports"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_distributed_export_equals_single_process(dirs, case_results, name):
    assert_passed(case_results, name)
    out, kwargs = dirs / f"out_{name}", LAYOUTS[name][1]
    with_mtp = kwargs.get("with_mtp", True)
    ref = dirs / ("ref_mtp" if with_mtp else "ref_no_mtp")
    got, want = read_all(str(out)), read_all(str(ref))
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
    assert (
        any(k.startswith(f"model.layers.{debug_args().num_hidden_layers}.") for k in got)
        == with_mtp
    )
    with open(out / "config.json") as f, open(ref / "config.json") as g:
        assert json.load(f) == json.load(g)
    with open(out / INDEX_NAME) as f:
        index = json.load(f)
    n = num_units(debug_args().replace(num_nextn_predict_layers=int(with_mtp)))
    assert sorted(set(index["weight_map"].values())) == [
        f"model-{u:05d}-of-{n:05d}.safetensors" for u in range(1, n + 1)
    ]
    assert sorted(os.listdir(out)) == sorted(
        [INDEX_NAME, "config.json", *set(index["weight_map"].values())]
    )
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in want.values()
    )

    from transformers import GlmMoeDsaForCausalLM

    hf, info = GlmMoeDsaForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    expected = GlmMoeDsaForCausalLM.from_pretrained(ref, dtype=torch.float32).state_dict()
    for key, t in hf.state_dict().items():
        assert torch.equal(t, expected[key]), key


def test_single_process_streamed_export_equals_save_hf_model(dirs, tmp_path):
    """Without a process group the streaming writer is the only rank: same tensors as
    ``save_hf_model``."""
    from titan_glm52 import load_hf_model
    from titan_glm52.hf_export import save_hf_distributed

    model = load_hf_model(str(dirs / "src"), dtype=torch.float32)
    save_hf_distributed([model], model.args, str(tmp_path), torch.bfloat16)
    got, want = read_all(str(tmp_path)), read_all(str(dirs / "ref_mtp"))
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
    with open(tmp_path / "config.json") as f, open(dirs / "ref_mtp" / "config.json") as g:
        assert json.load(f) == json.load(g)
