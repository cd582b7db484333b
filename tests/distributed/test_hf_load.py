"""Loading the published-format HF checkpoint (bf16 / fp32, and block-wise FP8) straight into
sharded / pipelined models (each rank reads its slices)."""

import pytest
import torch

from tests.distributed.hf_load_cases import check_hf_load
from tests.distributed.launcher import Case, assert_passed, run_cases, selected_cases
from tests.parity.test_hf_parity import randomise
from tests.unit.test_fp8_checkpoint import read_all, write_fp8
from titan_glm52 import GLM52Model, load_hf_model, save_hf_model
from titan_glm52.hf_checkpoint import hf_state_dict
from titan_glm52.model.args import get_flavor


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    model = GLM52Model(get_flavor("debug").replace(index_topk=8))
    model.init_weights()
    randomise(model, 5)
    # sharded files + index
    save_hf_model(model, str(folder), dtype=torch.float32, max_shard_bytes=200_000)
    return str(folder)


LAYOUTS = {"fsdp2": dict(dp_shard=2), "ep2_fsdp2": dict(dp_shard=2, ep=2), "pp2": dict(pp=2)}


@pytest.fixture(scope="module")
def case_results(request, hf_dir, fp8_dir):
    """Every layout loading the fp32 and the FP8 checkpoint, in one group of processes
    (``launcher.run_cases``); the FP8 loads export into ``fp8_dir / "out_fp8_<layout>"``."""
    cases = {
        f"fp32_{n}": Case(check_hf_load, 2, dict(kw, hf_dir=hf_dir), 90)
        for n, kw in LAYOUTS.items()
    }
    for name, kwargs in LAYOUTS.items():
        cases[f"fp8_{name}"] = Case(
            check_hf_load,
            2,
            dict(
                kwargs,
                hf_dir=str(fp8_dir / "fp8"),
                args_from_checkpoint=True,
                fp8_export_dir=str(fp8_dir / f"out_fp8_{name}"),
            ),
            120,
        )
    return run_cases(selected_cases(request, cases), str(fp8_dir / "rank_reports"))


@pytest.mark.parametrize("name", [f"fp32_{n}" for n in LAYOUTS])
def test_sharded_load_equals_full_load(name, case_results):
    assert_passed(case_results, name)


# Widths above 128 that are not multiples of 128, so that shards start inside a 128 x 128 block:
# wq_a [160, 192], wkv_a [144, 192], wkv_b [192, 136], experts [136, 192] / [192, 136], dense MLP
# [160, 192].
FP8_ARGS = dict(
    hidden_size=192,
    q_lora_rank=160,
    kv_lora_rank=136,
    num_attention_heads=6,
    num_key_value_heads=6,
    intermediate_size=160,
    moe_intermediate_size=136,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    index_topk=8,
    vocab_size=256,
)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """An FP8 checkpoint (with the MTP layer) of a random model, written by the unit tests' own
    quantiser."""
    folder = tmp_path_factory.mktemp("hf_fp8")
    args = get_flavor("debug").replace(**FP8_ARGS)
    model = GLM52Model(args)
    model.init_weights()
    randomise(model, 6)
    write_fp8(hf_state_dict(model), args.to_hf_config(), str(folder / "fp8"))
    # The single-process FP8 export of the single-process load: what the sharded exports must equal.
    save_hf_model(
        load_hf_model(str(folder / "fp8")), str(folder / "ref"), dtype=torch.bfloat16, fp8=True
    )
    return folder


@pytest.mark.parametrize("name", [f"fp8_{n}" for n in LAYOUTS])
def test_sharded_fp8_load_equals_full_load(fp8_dir, case_results, name):
    """Each rank dequantises its own slices: the shards equal the single-process load bitwise, and
    the streamed FP8 export of the sharded model equals the single-process FP8 export."""
    assert_passed(case_results, name)
    out = fp8_dir / f"out_{name}"
    got, want = read_all(str(out)), read_all(str(fp8_dir / "ref"))
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(
            got[key].view(torch.uint8), t.view(torch.uint8)
        ), key
