"""Job config: TOML + CLI precedence, our sections, refusals that name the key, --help."""

import subprocess
import sys

import pytest
import torch

from titan_glm52.config import ConfigError, parse_job_config, validate


def write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_cli_overrides_toml_overrides_defaults(tmp_path):
    toml = write(
        tmp_path, "[dsa]\nbackend = 'torch'\nindexer_loss_coeff = 0.5\n[training]\nsteps = 7\n"
    )
    cfg = parse_job_config(["--job.config_file", toml, "--training.steps", "9"])
    assert (cfg.training.steps, cfg.dsa.backend, cfg.dsa.indexer_loss_coeff) == (9, "torch", 0.5)
    assert cfg.mtp.enable and cfg.mtp.loss_weight == 0.3 and cfg.model.flavor == "debug"


def test_unknown_toml_key_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \{'bogus'\}.*Model"):
        parse_job_config(["--job.config_file", write(tmp_path, "[model]\nbogus = 1\n")])
    with pytest.raises(ConfigError, match="nosuchsection"):
        parse_job_config(["--job.config_file", write(tmp_path, "[nosuchsection]\nx = 1\n")])


def test_unknown_cli_key_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"no_such_option.*python train\.py --help") as e:
        parse_job_config(["--dsa.no_such_option", "1"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--parallelism.tensor_parallel_degree", "2"], "parallelism.tensor_parallel_degree"),
        (["--parallelism.context_parallel_degree", "0"], "parallelism.context_parallel_degree"),
        # zigzag CP cuts each sequence into 2 x degree chunks: 256 tokens do not split into 6
        (["--parallelism.context_parallel_degree", "3"], "training.seq_len"),
        (
            ["--parallelism.context_parallel_degree", "2", "--dsa.dense_masked_ratio", "2"],
            "dsa.dense_masked_ratio",
        ),
        (
            ["--parallelism.context_parallel_rotate_method", "alltoall"],
            "parallelism.context_parallel_rotate_method",
        ),
        (["--dsa.mode", "dense_warmup"], "dsa.indexer_loss_coeff"),
        (
            ["--dsa.mode", "dense_warmup", "--dsa.indexer_loss_coeff", "1", "--dsa.freeze_indexer"],
            "dsa.freeze_indexer",
        ),
        (["--dsa.freeze_indexer", "--dsa.indexer_loss_coeff", "0.1"], "dsa.freeze_indexer"),
        (["--checkpoint.enable", "--checkpoint.keep_latest_k", "1"], "checkpoint.keep_latest_k"),
        (["--checkpoint.async_mode", "async"], "checkpoint.async_mode"),
        (["--training.dataset_path", "/x"], "training.dataset_path"),
        (["--training.dtype", "bfloat16"], "training.dtype"),
        (["--metrics.enable_wandb"], "metrics.enable_wandb"),
        (["--model.converters", "float8"], "model.converters"),
        (["--debug.deterministic"], "debug.deterministic"),
        (["--validation.enable"], "validation.enable"),
        (["--fault_tolerance.enable"], "fault_tolerance.enable"),
        (["--comm.init_timeout_seconds", "900"], "comm.init_timeout_seconds"),
        (["--activation_checkpoint.early_stop"], "activation_checkpoint.early_stop"),
        (["--quantize.linear.float8.emulate"], "quantize.linear"),
        (["--training.gc_freq", "0"], "training.gc_freq"),
        (["--training.dataloader.num_workers", "2"], "training.dataloader.num_workers"),
        (["--training.dataloader.pin_memory"], "training.dataloader.pin_memory"),
        (["--data.prefetch", "-1"], "data.prefetch"),
        (["--dsa.dense_masked_ratio", "1.0"], "dsa.dense_masked_ratio"),
        (["--dsa.dense_masked_ratio", "-2"], "dsa.dense_masked_ratio"),
        (
            ["--parallelism.pipeline_parallel_layers_per_stage", "4"],
            "parallelism.pipeline_parallel_layers_per_stage",
        ),
        (["--parallelism.pipeline_parallel_layout", "4,x"], "parallelism.pipeline_parallel_layout"),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--training.local_batch_size",
                "3",
                "--parallelism.pipeline_parallel_microbatch_size",
                "2",
            ],
            "parallelism.pipeline_parallel_microbatch_size",
        ),
        (["--model.tokenizer_path", "/x"], "model.tokenizer_path"),
        (["--faults.max_consecutive_nonfinite", "0"], "faults.max_consecutive_nonfinite"),
        (["--compile.enable", "--compile.components", "loss"], "compile.components"),
        (
            ["--training.master_weights", "optimizer", "--optimizer.implementation", "fused"],
            "training.master_weights",
        ),
        (
            [
                "--training.master_weights",
                "optimizer",
                "--optimizer.implementation",
                "triton",
                "--training.mixed_precision_param",
                "float32",
            ],
            "training.master_weights",
        ),
        (
            ["--activation_checkpoint.mtp_token_chunk", "64", "--mtp.no-enable"],
            "activation_checkpoint.mtp_token_chunk",
        ),
        (
            ["--activation_checkpoint.mtp_token_chunk", "-1"],
            "activation_checkpoint.mtp_token_chunk",
        ),
        # the chunks' recompute would draw new dropout masks in the adapted shared experts
        (
            [
                "--lora.enable",
                "--lora.dropout",
                "0.1",
                "--lora.target_modules",
                "gate_proj",
                "--activation_checkpoint.mode",
                "none",
                "--activation_checkpoint.mtp_token_chunk",
                "64",
            ],
            "lora.dropout",
        ),
    ],
)
def test_impossible_combinations_name_the_key(argv, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_job_config(argv)


def test_mtp_token_chunk_reaches_the_model_options():
    from titan_glm52.config import model_options

    cfg = parse_job_config(["--activation_checkpoint.mtp_token_chunk", "4096"])
    opts = model_options(cfg, "cpu")
    assert opts.mtp_token_chunk == 4096 and opts.mlp_token_chunk == 0
    assert model_options(parse_job_config([]), "cpu").mtp_token_chunk == 0
    # LoRA dropout on attention adapters only: the chunks recompute no adapted module
    parse_job_config(
        [
            "--lora.enable",
            "--lora.dropout",
            "0.1",
            "--lora.target_modules",
            "q_a_proj",
            "--activation_checkpoint.mode",
            "none",
            "--activation_checkpoint.mtp_token_chunk",
            "64",
            "--moe.bias_update_rate",
            "0",
        ]
    )


def test_master_weights_in_the_optimizer_need_one_process():
    cfg = parse_job_config(
        ["--training.master_weights", "optimizer", "--optimizer.implementation", "triton"]
    )
    validate(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"training\.master_weights.*2 ranks"):
        validate(cfg, world_size=2)
    # "auto": FSDP there
    validate(parse_job_config(["--optimizer.implementation", "triton"]), world_size=8)


def test_help_lists_our_options():
    # (spelled with underscores, as the TOML keys and the README spell them)
    out = subprocess.run(
        [sys.executable, "train.py", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=__file__.rsplit("/tests/", 1)[0],
    ).stdout
    for option in (
        "--dsa.backend",
        "--dsa.mode",
        "--dsa.indexer_loss_coeff",
        "--moe.bias_update_rate",
        "--moe.seq_aux_loss_coeff",
        "--mtp.loss_weight",
        "--activation_checkpoint.mtp_token_chunk",
        "--faults.max_consecutive_nonfinite",
        "--parallelism.pipeline_parallel_layout",
        "--model.hf_config",
        "--training.dataset",
    ):
        assert option in out, option
    assert "Weight of the indexer KL loss" in out


@pytest.mark.parametrize(
    "toml, message",
    [
        ('[training]\nsteps = "abc"\n', r"training\.steps: expected int, got 'abc' \(str\)"),
        ('[optimizer]\nlr = "3e-3"\n', r"optimizer\.lr: expected float, got '3e-3' \(str\)"),
        (
            "[training]\nlocal_batch_size = 0\n",
            r"training\.local_batch_size: 0 is out of range: must be >= 1",
        ),
        ("[checkpoint]\ninterval = -5\n", r"checkpoint\.interval: -5 is out of range"),
        (
            "[optimizer]\nbeta2 = 1.5\n",
            r"optimizer\.beta2: 1\.5 is out of range: must be in \[0, 1\]",
        ),
        (
            "[data]\nsame_global_batch = 1\n",
            r"data\.same_global_batch: expected bool, got 1 \(int\)",
        ),
        (
            '[dsa]\nmode = "dense"\n',
            r"dsa\.mode: expected one of 'sparse', 'dense_warmup', got 'dense'",
        ),
    ],
)
def test_toml_values_of_the_wrong_type_or_range_are_refused(tmp_path, toml, message):
    with pytest.raises(ConfigError, match=message):
        parse_job_config(["--job.config_file", write(tmp_path, toml)])


def test_a_sequence_longer_than_the_model_positions_needs_an_opt_in():
    from titan_glm52.config import model_args

    long = ["--training.seq_len", "8192"]  # the debug flavor: max_position_embeddings 4096
    with pytest.raises(
        ConfigError, match=r"training\.seq_len: 8192 is above .* model\.extend_positions"
    ):
        model_args(parse_job_config(long))
    assert model_args(parse_job_config(long + ["--model.extend_positions"])).num_hidden_layers == 8


def test_missing_or_broken_config_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"job\.config_file: .*nope\.toml is not a file"):
        parse_job_config(["--job.config_file", str(tmp_path / "nope.toml")])
    with pytest.raises(ConfigError, match="is not valid TOML"):
        parse_job_config(["--job.config_file", write(tmp_path, "[training\n")])
    with pytest.raises(ConfigError, match=r"training\.steps: invalid literal.*'abc'") as e:
        parse_job_config(["--training.steps", "abc"])
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ FP8
FP8_BOTH = "quantize.linear.float8,quantize.grouped_mm.float8"


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--model.converters", "float8"], "model.converters"),
        (["--model.converters", f"{FP8_BOTH},quantize.linear.mx"], "model.converters"),
        (
            ["--model.converters", FP8_BOTH, "--quantize.linear.float8.recipe_name", "mxfp8"],
            "quantize.linear.float8.recipe_name",
        ),
        # (bias_update_rate 0: LoRA's own refusal of the routing bias would come first)
        (
            ["--model.converters", FP8_BOTH, "--lora.enable", "--moe.bias_update_rate", "0"],
            "model.converters",
        ),
        (["--model.converters", FP8_BOTH, "--moe.grouped_mm", "on"], "moe.grouped_mm"),
        (
            ["--model.converters", FP8_BOTH, "--quantize.grouped_mm.float8.recipe_name", "mx"],
            "quantize.grouped_mm.float8.recipe_name",
        ),
        (
            [
                "--model.converters",
                FP8_BOTH,
                "--quantize.grouped_mm.float8.recipe_name",
                "rowwise",
                "--moe.grouped_mm",
                "off",
            ],
            "moe.grouped_mm",
        ),
        (
            ["--model.converters", FP8_BOTH, "--quantize.linear.float8.emulate"],
            "quantize.linear.float8.emulate",
        ),
        (
            ["--quantize.linear.mx.recipe_name", "mxfp8_cublas_rceil"],
            "quantize.linear.mx.recipe_name",
        ),
        (
            ["--quantize.linear.mx.mxfp8_dim1_cast_kernel_choice", "cuda"],
            "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice",
        ),
        (["--quantize.grouped_mm.mx.fqns", "experts"], "quantize.grouped_mm.mx.fqns"),
        # an FP8 option without its converter would be ignored
        (
            ["--quantize.linear.float8.recipe_name", "rowwise"],
            "quantize.linear.float8.recipe_name",
        ),
        (
            [
                "--model.converters",
                "quantize.linear.float8",
                "--quantize.grouped_mm.float8.fqns",
                "moe",
            ],
            "quantize.grouped_mm.float8.fqns",
        ),
        (
            [
                "--model.converters",
                "quantize.linear.float8",
                "--quantize.grouped_mm.float8.recipe_name",
                "rowwise",
            ],
            "quantize.grouped_mm.float8.recipe_name",
        ),
    ],
)
def test_fp8_refusals_name_the_key(argv, key):
    """Each of ``_validate_fp8``'s refusals (and the MX options', which are not implemented) is one
    ConfigError whose message starts with the key."""
    with pytest.raises(ConfigError) as e:
        parse_job_config(argv)
    assert str(e.value).startswith(f"{key}: "), str(e.value)
    assert "\n" not in str(e.value)
    if "--lora.enable" in argv:
        assert "LoRA" in str(e.value)


def test_fp8_spec_from_the_converters(tmp_path):
    from titan_glm52.config import fp8_spec
    from titan_glm52.fp8_training import Fp8Spec

    assert fp8_spec(parse_job_config([])) is None
    toml = write(
        tmp_path,
        "[model]\nconverters = ['quantize.linear.float8', 'quantize.grouped_mm.float8']\n"
        "[quantize.linear.float8]\nrecipe_name = 'blockwise'\n",
    )
    assert fp8_spec(parse_job_config(["--job.config_file", toml])) == Fp8Spec(
        recipe="blockwise",
        linears=True,
        filter_fqns=("indexer", "wkv_b"),
        expert_fqns=("experts",),
    )
    linears = parse_job_config(
        [
            "--model.converters",
            "quantize.linear.float8",
            "--quantize.linear.float8.filter_fqns",
            "output,router",
        ]
    )
    assert fp8_spec(linears) == Fp8Spec(
        linears=True, filter_fqns=("output", "router"), expert_fqns=()
    )
    # with "output" the head stays bf16 (fp8_training.Fp8OutputHead otherwise)
    head = ["--model.converters", FP8_BOTH, "--quantize.linear.float8.filter_fqns", "output"]
    assert fp8_spec(parse_job_config(head)).filter_fqns == ("output",)
    # the grouped bf16 GEMM is refused only for FP8 experts
    assert linears.moe.grouped_mm != "on"
    parse_job_config(["--model.converters", "quantize.linear.float8", "--moe.grouped_mm", "on"])
    experts = parse_job_config(
        [
            "--model.converters",
            "quantize.grouped_mm.float8",
            "--quantize.grouped_mm.float8.fqns",
            "mtp",
        ]
    )
    assert fp8_spec(experts) == Fp8Spec(linears=False, expert_fqns=("mtp",))
    # the rowwise experts are one grouped product: the grouped GEMM may be asked for
    rowwise = parse_job_config(
        [
            "--model.converters",
            FP8_BOTH,
            "--quantize.grouped_mm.float8.recipe_name",
            "rowwise",
            "--moe.grouped_mm",
            "on",
        ]
    )
    assert fp8_spec(rowwise) == Fp8Spec(expert_recipe="rowwise")
    # torchao's recipes for the linears
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        argv = ["--model.converters", FP8_BOTH, "--quantize.linear.float8.recipe_name", recipe]
        assert fp8_spec(parse_job_config(argv)) == Fp8Spec(recipe=recipe)


def test_torchao_recipes_are_refused_without_torchao(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    argv = ["--model.converters", FP8_BOTH, "--quantize.linear.float8.recipe_name", "tensorwise"]
    with pytest.raises(ConfigError, match="^quantize.linear.float8.recipe_name: .*not installed"):
        parse_job_config(argv)
    parse_job_config(argv[:2])  # the block-wise recipe needs no torchao


def test_without_converters_the_model_is_unchanged():
    """The switch off gives today's results: without ``model.converters`` the parallelize recipe
    leaves every module's class as it was (no Fp8Linear / Fp8GroupedExperts) and the loss and every
    gradient are bit for bit those of the untouched model, on the flavor whose widths FP8 converts;
    with the converters the same recipe converts and the loss moves."""
    import copy

    from tests.losses import cross_entropy_sum
    from titan_glm52.config import fp8_spec
    from titan_glm52.fp8_training import Fp8GroupedExperts, Fp8Linear, Fp8OutputHead, is_fp8
    from titan_glm52.model.args import get_flavor
    from titan_glm52.model.head import OutputHead
    from titan_glm52.model.model import GLM52Model
    from titan_glm52.parallelize import parallelize_model

    args = get_flavor("debug_fp8").replace(index_topk=8)
    torch.manual_seed(0)
    base = GLM52Model(args)
    base.init_weights()
    tokens = torch.randint(1, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))

    def step(model):
        loss = cross_entropy_sum(model(tokens)[:, :-1], tokens[:, 1:]) / 62
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want_grads = step(copy.deepcopy(base))
    off = copy.deepcopy(base)
    assert fp8_spec(parse_job_config([])) is None
    parallelize_model(off, None, fp8=fp8_spec(parse_job_config([])))
    assert [type(m) for m in off.modules()] == [type(m) for m in base.modules()]
    assert not any(isinstance(m, (Fp8Linear, Fp8GroupedExperts)) for m in off.modules())
    loss, grads = step(off)
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], want_grads[n]), n

    on = copy.deepcopy(base)
    parallelize_model(on, None, fp8=fp8_spec(parse_job_config(["--model.converters", FP8_BOTH])))
    assert sum(isinstance(m, Fp8Linear) for m in on.modules()) > 0
    assert sum(isinstance(m, Fp8GroupedExperts) for m in on.modules()) == 6  # 5 MoE layers + MTP
    assert all(is_fp8(m) for m in on.modules() if isinstance(m, (Fp8Linear, Fp8GroupedExperts)))
    assert [n for n, _ in on.named_parameters()] == [n for n, _ in base.named_parameters()]
    fp8_loss, _ = step(on)
    assert not torch.equal(fp8_loss, want_loss)
    torch.testing.assert_close(fp8_loss, want_loss, rtol=2e-2, atol=0)
    assert type(on.output) is Fp8OutputHead and is_fp8(on.output)  # by default the head too

    # with "output" in filter_fqns the head stays bf16
    kept = copy.deepcopy(base)
    argv = ["--model.converters", FP8_BOTH, "--quantize.linear.float8.filter_fqns", "output"]
    parallelize_model(kept, None, fp8=fp8_spec(parse_job_config(argv)))
    assert type(kept.output) is OutputHead
    kept_loss, kept_grads = step(kept)
    assert not torch.equal(kept_loss, fp8_loss)
    torch.testing.assert_close(kept_loss, want_loss, rtol=2e-2, atol=0)
    assert kept_grads.keys() == want_grads.keys()


def test_bf16_optimizer_state_needs_the_triton_step():
    """``optimizer.state_dtype = "bfloat16"`` is refused, naming the key, with torch's Adam (which
    keeps its moments in the parameters' dtype); the Triton step takes it."""
    with pytest.raises(ConfigError) as e:
        parse_job_config(["--optimizer.state_dtype", "bfloat16"])
    assert str(e.value).startswith("optimizer.state_dtype: ") and "\n" not in str(e.value)
    cfg = parse_job_config(
        ["--optimizer.state_dtype", "bfloat16", "--optimizer.implementation", "triton"]
    )
    assert cfg.optimizer.state_dtype == "bfloat16"


def test_bf16_optimizer_state_refuses_a_slow_second_moment():
    """bf16 moments with beta2 above 0.99 are refused in one line naming the key: with 0.999 a
    stored exp_avg_sq of 1 never moves toward a squared gradient of 2 (each step adds 0.001, below
    half of bf16's step of 2^-7 there), while 0.95 follows it."""
    v = torch.ones((), dtype=torch.bfloat16)
    for beta2, moves in ((0.999, False), (0.95, True)):
        stored = (beta2 * v.float() + (1 - beta2) * 2.0).to(torch.bfloat16)
        assert bool(stored != v) == moves
    args = ["--optimizer.state_dtype", "bfloat16", "--optimizer.implementation", "triton"]
    with pytest.raises(ConfigError) as e:
        parse_job_config([*args, "--optimizer.beta2", "0.999"])
    assert str(e.value).startswith("optimizer.state_dtype: ") and "\n" not in str(e.value)
    assert "beta2" in str(e.value)
    assert parse_job_config([*args, "--optimizer.beta2", "0.99"]).optimizer.beta2 == 0.99
