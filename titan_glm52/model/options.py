"""ModelOptions: how one run computes the model, beside what the model is (``GLM52ModelArgs``).

The args are the published ``config.json`` (they decide the parameters); the options decide kernels,
modes and recompute choices, and which auxiliary losses the model adds to the gradient. Both are
given to the model at construction (``GLM52Model(args, options)``), before it is built on the meta
device; nothing sets them on the modules afterwards. ``config.model_options(job_config, device)``
makes them from a job config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DSA_BACKENDS = ("torch", "triton")
TRAINABLE = ("all", "indexers", "all_but_indexers")


@dataclass(frozen=True)
class ModelOptions:
    """How one run computes the model (module docstring).

    Attributes:
        dsa_backend: "torch" (the reference, any device) or "triton" (the DSA kernels; CUDA, or the
            Triton interpreter on CPU).
        gluon_kernels: with "triton" on Hopper, the warp-specialised Gluon kernels for the sparse
            MLA and the indexer scoring where they apply; False runs the Triton kernels only
            (``[dsa] gluon_kernels``).
        sparse_attention: top-k attention (the DSA sparse stage); False is dense causal attention
            over each document (the DSA dense warm-up).
        dense_prefix: the first ``index_topk`` rows of each long enough document run on a dense
            causal kernel (``[dsa] dense_prefix``; same math).
        dense_masked_ratio: documents up to this many times ``index_topk`` tokens run their later
            rows on a masked dense kernel (``[dsa] dense_masked_ratio``; 0 = off).
        recompute_latent_query: the sparse attention's backward rebuilds its latent query
            (``[dsa] recompute_latent_query``).
        indexer_loss_coeff: weight of the indexer KL loss (``[dsa] indexer_loss_coeff``); > 0 trains
            the indexers from it, with the per-step normaliser given by ``AuxTerms.tokens``.
        seq_aux_loss_coeff: weight of the MoE sequence-level balance loss (``[moe]
            seq_aux_loss_coeff``), with the normaliser ``AuxTerms.sequences``; 0 = off.
        grouped_mm: the routed experts' products as one ``torch._grouped_mm`` (True), one GEMM per
            expert (False), or chosen per call by size (None; ``[moe] grouped_mm``).
        recompute_expert_inputs: the routed experts rebuild their GEMM inputs in backward
            (``[moe] recompute_expert_inputs``).
        mlp_token_chunk: > 0 runs each MLP (dense, or the routed and shared experts) over chunks of
            that many tokens, each recomputed in backward (``[activation_checkpoint]
            mlp_token_chunk``; long sequences); 0 runs the whole batch at once.
        mtp_token_chunk: > 0 runs the MTP layer's token-wise parts (its input projection with
            ``enorm`` and ``hnorm``, its block's MLP, its final norm) over chunks of that many
            tokens, each recomputed in backward, whatever ``mlp_token_chunk`` says
            (``[activation_checkpoint] mtp_token_chunk``); 0: its MLP as the main blocks', the
            rest unchunked.
        trainable: which parameters train: "all", "indexers" (the dense warm-up) or
            "all_but_indexers" (``[dsa] freeze_indexer``).
    """

    # DSA attention.
    dsa_backend: Literal["torch", "triton"] = "torch"
    gluon_kernels: bool = True
    sparse_attention: bool = True
    dense_prefix: bool = True
    dense_masked_ratio: float = 0.0
    recompute_latent_query: bool = True
    # Auxiliary losses.
    indexer_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    # MoE.
    grouped_mm: bool | None = None
    recompute_expert_inputs: bool = True
    mlp_token_chunk: int = 0
    mtp_token_chunk: int = 0
    # Training.
    trainable: Literal["all", "indexers", "all_but_indexers"] = "all"

    def __post_init__(self) -> None:
        if self.dsa_backend not in DSA_BACKENDS:
            raise ValueError(
                f"ModelOptions.dsa_backend = {self.dsa_backend!r}: choose one of {DSA_BACKENDS}"
            )
        if self.trainable not in TRAINABLE:
            raise ValueError(
                f"ModelOptions.trainable = {self.trainable!r}: choose one of {TRAINABLE}"
            )
        if self.indexer_loss_coeff < 0 or self.seq_aux_loss_coeff < 0:
            raise ValueError("ModelOptions: indexer_loss_coeff and seq_aux_loss_coeff must be >= 0")

    def trains(self, param_name: str) -> bool:
        """Whether the parameter named ``param_name`` (a model FQN) is trained."""
        is_indexer = ".indexer." in param_name
        return {"all": True, "indexers": is_indexer, "all_but_indexers": not is_indexer}[
            self.trainable
        ]
