"""Loading the published-format HF checkpoint straight into sharded / pipelined models (each rank reads its slices)."""

import pytest
import torch

from tests.distributed.hf_load_cases import check_hf_load
from tests.distributed.launcher import run_on_ranks
from tests.parity.test_hf_parity import randomise
from titan_glm52 import GLM52Model, save_hf_model
from titan_glm52.model.args import get_flavor


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    model = GLM52Model(get_flavor("debug").replace(index_topk=8))
    model.init_weights()
    randomise(model, 5)
    save_hf_model(model, str(folder), dtype=torch.float32, max_shard_bytes=200_000)  # sharded files + index
    return str(folder)


@pytest.mark.parametrize("world, kwargs", [(2, dict(dp_shard=2)), (2, dict(dp_shard=2, ep=2)), (2, dict(pp=2))],
                         ids=["fsdp2", "ep2_fsdp2", "pp2"])
def test_sharded_load_equals_full_load(hf_dir, world, kwargs):
    run_on_ranks(check_hf_load, world, timeout_s=90, hf_dir=hf_dir, **kwargs)
