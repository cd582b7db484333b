"""FSDP2 / HSDP / expert parallel / AC / compile on 2 and 4 gloo processes against a single-process
reference.

Each case: loss (summed over ranks), every gradient (full tensors), the grad norm after clipping,
the parameters, moments and gradients after one AdamW step (for-loop, or torch fused / Triton with
the clip folded into its step) and the MoE loads (per rank and all-reduced) equal the single-process
run of the debug flavor on the whole global batch (see cases.check_train_step). The ``fp8_`` cases
run FP8 products on both sides (FP8_NOTE says against which micro-batches of the single process).
"""

import pytest

from tests.distributed import cases
from tests.distributed.launcher import Case, assert_passed

TRAIN_STEP = {
    # 2 processes
    "fsdp2": (2, dict(dp_shard=2)),
    "replicate2_no_shard": (2, dict(dp_replicate=2, dp_shard=1)),  # DDP-like: HSDP on a (2, 1) mesh
    "ep2_fsdp2": (2, dict(dp_shard=2, ep=2)),
    "ep2_second_rank_gets_no_tokens": (2, dict(dp_shard=2, ep=2, route_to_first_experts=True)),
    "ep2_ac_full": (2, dict(dp_shard=2, ep=2, ac_mode="full")),
    "ep2_ac_selective_op": (
        2,
        dict(dp_shard=2, ep=2, ac_mode="selective", selective_ac_option="op"),
    ),
    "fsdp2_ac_every_2nd_block_no_reshard": (
        2,
        dict(
            dp_shard=2, ac_mode="selective", selective_ac_option="2", reshard_after_forward="never"
        ),
    ),
    "ep2_compile_ac_selective": (2, dict(dp_shard=2, ep=2, compile=True, ac_mode="selective")),
    # the MTP layer in token chunks of 48 (128 tokens per rank) while every 2nd block is
    # checkpointed, its own FSDP unit resharded after forward and gathered again for the recompute
    "fsdp2_mtp_token_chunk_ac_every_2nd_block": (
        2,
        dict(
            dp_shard=2,
            ac_mode="selective",
            selective_ac_option="2",
            reshard_after_forward="always",
            mtp_token_chunk=48,
        ),
    ),
    "ep2_compile_mtp_token_chunk": (2, dict(dp_shard=2, ep=2, compile=True, mtp_token_chunk=48)),
    # fused / Triton AdamW on DTensor parameters with the gradient clip folded into its step (the
    # trainer's paths)
    "fsdp2_fused_clip": (2, dict(dp_shard=2, clip_in_step="fused")),
    "ep2_fsdp2_fused_clip": (2, dict(dp_shard=2, ep=2, clip_in_step="fused")),
    "fsdp2_triton_clip": (2, dict(dp_shard=2, clip_in_step="triton")),
    # the DSA kernels (the interpreter on CPU; 2 layers + MTP and one sequence per rank to keep it
    # short), resharding after forward: the latent query rebuilt in backward from W_uk's view of
    # the parameter FSDP gathers again
    "fsdp2_triton_dsa_latent_query_rebuilt": (
        2,
        dict(
            dp_shard=2,
            dsa_backend="triton",
            num_hidden_layers=2,
            reshard_after_forward="always",
            global_batch=2,
        ),
    ),
    # 4 processes
    "fsdp4_meta_init": (4, dict(dp_shard=4, reshard_after_forward="always", meta_init=True)),
    "hsdp2x2": (4, dict(dp_replicate=2, dp_shard=2)),
    "ep2_fsdp4_meta_init": (4, dict(dp_shard=4, ep=2, meta_init=True)),
    "hsdp2x2_ep2_ac_full": (4, dict(dp_replicate=2, dp_shard=2, ep=2, ac_mode="full")),
    "ep4_fsdp4": (4, dict(dp_shard=4, ep=4)),
    # 1 expert per EP rank, 2 expert-FSDP ranks: experts are FSDP-sharded on dim 1
    "ep2_fsdp4_experts_on_dim1": (
        4,
        dict(dp_shard=4, ep=2, n_routed_experts=2, num_experts_per_tok=2, meta_init=True),
    ),
    # the same with TritonAdamW: its kernel walks the dim-1 shards' (transposed) memory
    "ep2_fsdp4_experts_on_dim1_triton_clip": (
        4,
        dict(dp_shard=4, ep=2, n_routed_experts=2, num_experts_per_tok=2, clip_in_step="triton"),
    ),
    "hsdp2x2_ep2_fused_clip": (4, dict(dp_replicate=2, dp_shard=2, ep=2, clip_in_step="fused")),
    # FP8 products (the linears, the routed experts and the head) on both sides, "debug_fp8"
    # flavor: see FP8_NOTE for the reference's micro-batches
    "fp8_fsdp2": (2, {"dp_shard": 2, "fp8": True, "ref_chunks": 2}),
    "fp8_fsdp2_ac_every_2nd_block": (
        2,
        {
            "dp_shard": 2,
            "ac_mode": "selective",
            "selective_ac_option": "2",
            "fp8": True,
            "ref_chunks": 2,
        },
    ),
    "fp8_ep2_fsdp2_compile_ac_selective": (
        2,
        {"dp_shard": 2, "ep": 2, "compile": True, "ac_mode": "selective", "fp8": True},
    ),
    # the rowwise experts (one grouped product on rows aligned per expert): under EP 2 the owner
    # of an expert gets its rows in the single process's order, so the same per-expert scales
    "fp8_rowwise_experts_ep2_fsdp2": (
        2,
        {"dp_shard": 2, "ep": 2, "fp8": True, "fp8_experts": "rowwise"},
    ),
    # torchao's Float8Linear for the linears: tensorwise scales (the weight's amax over the whole
    # gathered weight, the activations' over the rank's micro-batch), and rowwise compiled with
    # op-level checkpointing (its products are aten._scaled_mm, which the policy saves)
    "fp8_tensorwise_linears_fsdp2": (
        2,
        {"dp_shard": 2, "fp8": True, "fp8_linears": "tensorwise", "ref_chunks": 2},
    ),
    "fp8_rowwise_linears_fsdp2_compile_ac_selective": (
        2,
        {
            "dp_shard": 2,
            "compile": True,
            "ac_mode": "selective",
            "fp8": True,
            "fp8_linears": "rowwise",
            "ref_chunks": 2,
        },
    ),
    "fp8_hsdp2x2_ac_full": (
        4,
        {"dp_replicate": 2, "dp_shard": 2, "ac_mode": "full", "fp8": True, "ref_chunks": 4},
    ),
}

FP8_NOTE = """FP8 (block-wise) cases: which micro-batches the single process runs, and why in
float64.

Tiles. The forward and the input gradient quantise per 1 x 128 tile along the contraction, i.e. per
row: they do not depend on how the batch is split. The weight gradient quantises the gradient and
the input per 128 x 1 tile along the tokens that one product sees (per expert for the routed
experts, each expert's tiles starting at its first row), so a data-parallel rank, which holds only
its own tokens, forms other tiles than one process holding the whole batch unless the counts line
up:

* every linear sees the rank's 4 x 32 = 128 tokens under 2 ranks: one whole tile, the one that the
  single process forms from the same tokens; under 4 ranks (64 tokens) a padded tile of its own;
* a routed expert gets about 96 of the batch's 768 routed rows, split unevenly over the ranks (no
  split lines up with the tiles), so under FSDP and HSDP its tiles are per rank. Under EP over all
  the data-parallel ranks the owner of an expert receives the expert's rows from every rank, in rank
  order, which is the order in which one process sorts them (a stable sort of the global batch):
  the same tiles as one process.

So the reference is the single process running the rank slices as accumulated micro-batches
(``ref_chunks`` = the data-parallel degree) under FSDP and HSDP, and the one-batch single process
(``ref_chunks`` = 1) under EP 2 on 2 ranks. Swapping them fails: one batch against FSDP 2 differs in
the routed experts' gradients (the first mismatch is layers.3.moe.experts.w13), two micro-batches
against EP 2 likewise, two against HSDP 2 x 2 in the linears' (64-token tiles).

float64. In fp32 the parallel run is equal to the single process only up to summation order (under
FSDP's hooks autograd sums the gradient terms that reach the final norm's output from the head and
from the MTP layer in another order: a last-bit difference). Without FP8 that stays ~1e-7; an FP8
quantisation turns a last-bit change of a value that lies at an e4m3 rounding midpoint into a whole
e4m3 step (1/16 of it), and backward
carries that into every earlier layer (up to 3 % of a gradient's largest element, far beyond the
tolerances, although every tile is the same). These cases therefore keep parameters, activations,
gradients and the FSDP reductions in float64 on both sides: the FP8 products quantise from fp32
(``x.float()``) and compute in fp32, so summation-order differences (~1e-16) vanish in that
rounding, and the comparison keeps the tolerances of the other cases. (Against the one-batch
reference, or in fp32, these cases fail: checked by hand.)
"""


CASES = {
    **{
        name: Case(cases.check_train_step, world, kwargs, 420 if "dsa_backend" in kwargs else 90)
        for name, (world, kwargs) in TRAIN_STEP.items()
    },
    "backward_all_to_alls": Case(cases.check_backward_all_to_alls, 2, timeout_s=60),
    "mixed_precision": Case(cases.check_mixed_precision, 2, dict(ep=2), timeout_s=60),
}


@pytest.mark.parametrize("name", list(TRAIN_STEP))
def test_matches_single_process(name, case_results):
    assert_passed(case_results, name)


@pytest.mark.parametrize("name", ["backward_all_to_alls"])
def test_selective_ac_does_not_resend_all_to_alls(name, case_results):
    assert_passed(case_results, name)


@pytest.mark.parametrize("name", ["mixed_precision"])
def test_bf16_params_with_fp32_reduction(name, case_results):
    assert_passed(case_results, name)
