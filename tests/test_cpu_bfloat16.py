"""dtype bfloat16 on CPU: the GEMMs multiply in bfloat16 (where the processor has matrix units for it) between
float32 activations; dtype auto picks it on such processors."""

import pytest
import torch
from conftest import greedy, hf_greedy, hf_token_logprobs, token_ids_of, worker_of

from pagedserve import LLM
from pagedserve.config import EngineConfig
from pagedserve.cpu_features import CPUFeatures
from pagedserve.executor import worker as worker_module
from pagedserve.layers.linear import TILES_MAX_ROWS, Linear

PROMPTS = [[1, 400, 500, 600, 700], list(range(100, 170)), [5] * 3, list(range(3000, 3040, 3))]


@pytest.fixture(scope="module")
def bfloat16_llm(tiny_models):
    return LLM(str(tiny_models["llama"]), dtype="bfloat16", kv_cache_memory=16 * 1024**2)


def test_bfloat16_gemms_run_between_float32_activations_on_the_float32_kernels(bfloat16_llm):
    worker = worker_of(bfloat16_llm)
    assert (worker.dtype, worker.gemm_dtype, worker.kv_cache_dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    assert worker.attn_backend.name == "cpu" and worker.cpu_kernels is not None
    # The prompts' attention multiplies in bfloat16 pairs where the processor has AVX-512 BF16 (the float32 mode never does).
    assert worker.attn_backend.prefill_bf16_products == worker.cpu_kernels.prefill_bf16_products()
    linears = [m for m in worker.model.modules() if isinstance(m, Linear)]
    on_tiles = worker.cpu_kernels.bf16_matrix_tiles()  # AMX: steps of few rows on the tiles, float32 sums out
    assert worker.bfloat16_on_tiles == on_tiles and (worker.attn_backend.fresh_prefill_dtype is not None) == on_tiles
    assert linears and all(m.packed.dtype == torch.bfloat16 and (m.bf16_products is not None) == on_tiles for m in linears)
    model = worker.model
    if worker.cpu_kernels.bf16_dot_products():  # the lm_head multiplies in bfloat16 too, its sums kept in float32
        assert model.lm_head_pairs is not None and model.packed_lm_head is None
    else:
        assert model.lm_head_pairs is None and model.packed_lm_head.dtype == torch.float32
    assert model.compute_logits(torch.randn(3, model.config.hidden_size)).dtype == torch.float32  # the logits stay float32
    assert all(p.dtype == torch.float32 for p in worker.model.parameters())  # norms and embeddings stay float32
    # On oneDNN a GEMM's bfloat16 output stays bfloat16 where what reads it takes it so: the gate-up's (SiLU-and-mul, the
    # down projection), the output and down projections' (the next RMSNorm widens it as it adds the residual), and q, k,
    # v where the attention takes them in bfloat16 (on the tiles' machines); on the tiles every GEMM returns float32.
    mlp = worker.model.model.layers[0].mlp
    for rows, tiles in ((5, on_tiles), (TILES_MAX_ROWS + 1, False)):
        x = torch.randn(rows, mlp.gate_up_proj.in_features)
        assert mlp.gate_up_proj(x).dtype == mlp(x).dtype == (torch.float32 if tiles else torch.bfloat16)
    kept = ("gate_up_proj", "o_proj", "down_proj", *(("qkv_proj",) if worker.attn_backend.takes_bfloat16 else ()))
    for name, module in worker.model.named_modules():
        if isinstance(module, Linear):
            assert module.output_dtype == (torch.bfloat16 if name.endswith(kept) else torch.float32), name


def test_float32_prompts_attend_with_float32_products(default_llm):
    assert worker_of(default_llm).dtype == torch.float32 and not worker_of(default_llm).attn_backend.prefill_bf16_products


def test_a_prompt_step_beyond_the_tiles_makes_silu_and_mul_in_the_gate_up_gemms(bfloat16_llm):
    """Where the tiles take steps of few rows, the larger steps reach oneDNN with the gate-up's gate and up packed apart,
    SiLU and the product applied as the two GEMMs store their sums: the same values as the whole product followed by
    the SiLU-and-mul pass, to bfloat16's rounding; a step the tiles take, and the layer's own product, are unchanged."""
    worker = worker_of(bfloat16_llm)
    mlp = worker.model.model.layers[0].mlp
    gate_up = mlp.gate_up_proj
    linears = {name: m for name, m in worker.model.named_modules() if isinstance(m, Linear)}
    apart = {name for name, m in linears.items() if m.packed_parts is not None}
    assert apart == ({name for name in linears if name.endswith("mlp.gate_up_proj")} if worker.cpu_kernels.bf16_matrix_tiles() else set())
    weight = gate_up.weight.detach().to(torch.bfloat16).float()
    size = weight.shape[0] // 2
    for rows in (7, TILES_MAX_ROWS + 9):
        x = torch.randn(rows, gate_up.in_features, generator=torch.Generator().manual_seed(rows))
        exact = x.to(torch.bfloat16).float() @ weight.T
        expected = torch.nn.functional.silu(exact[:, :size]) * exact[:, size:]
        fused = gate_up.fused_silu_and_mul(x)
        assert (fused is not None) == (gate_up.packed_parts is not None and rows > TILES_MAX_ROWS)
        activated = fused if fused is not None else mlp.act_fn(gate_up(x))
        torch.testing.assert_close(activated.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
        torch.testing.assert_close(gate_up(x).float(), exact, rtol=2e-2, atol=2e-2 * exact.abs().max().item())


def test_a_step_beyond_the_tiles_runs_its_gemms_at_a_multiple_of_64_rows_with_the_same_logprobs(bfloat16_llm, monkeypatch):
    """oneDNN makes a primitive for each new row count: where its bfloat16 GEMMs take the steps beyond the tiles, a step
    runs through the layers at its token count rounded up to a multiple of ONEDNN_ROW_MULTIPLE, the rows past its tokens
    zero and left out of the attention; its logprobs are those of the step run at its own row count."""
    from pagedserve.layers.linear import ONEDNN_ROW_MULTIPLE

    worker = worker_of(bfloat16_llm)
    model = worker.model.model
    assert model.pads_gemm_rows == worker.cpu_kernels.bf16_matrix_tiles()
    tokens = TILES_MAX_ROWS + 40
    prompt = torch.randint(100, 40000, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    seen_rows = set()
    dense_matmul = Linear.dense_matmul

    def counting(self, x, bias):
        seen_rows.add(x.shape[0])
        return dense_matmul(self, x, bias)

    def prompt_logprobs():
        bfloat16_llm.llm_engine.call_utility("reset_prefix_cache")
        scored = bfloat16_llm.generate({"prompt_token_ids": prompt}, greedy(1, prompt_logprobs=0), use_tqdm=False)[0]
        return [{token: entry.logprob for token, entry in position.items()} for position in scored.prompt_logprobs[1:]]

    monkeypatch.setattr(Linear, "dense_matmul", counting)
    padded = prompt_logprobs()
    rounded = -(-tokens // ONEDNN_ROW_MULTIPLE) * ONEDNN_ROW_MULTIPLE
    assert tokens % ONEDNN_ROW_MULTIPLE and (rounded in seen_rows) == model.pads_gemm_rows and (tokens in seen_rows) != model.pads_gemm_rows
    monkeypatch.setattr(model, "pads_gemm_rows", False)
    seen_rows.clear()
    assert prompt_logprobs() == padded
    assert rounded not in seen_rows


def test_bfloat16_products_reach_the_next_layer_as_they_come_with_the_same_logprobs(bfloat16_llm, monkeypatch):
    """A prompt step of more rows than the tiles take runs oneDNN's bfloat16 GEMMs: their outputs reach what reads them
    in bfloat16 as they come and each RMSNorm hands the next GEMM bfloat16 (Linear.input_dtype). The prompt's logprobs
    are the same, bit for bit, as when every output is widened to float32 and rounded again before the next GEMM."""
    worker = worker_of(bfloat16_llm)
    layer = worker.model.model.layers[0]
    assert layer.self_attn.o_proj.output_dtype == torch.bfloat16
    assert layer.self_attn.qkv_proj.input_dtype(TILES_MAX_ROWS + 1) == torch.bfloat16
    prompt = torch.randint(100, 40000, (TILES_MAX_ROWS + 60,), generator=torch.Generator().manual_seed(0)).tolist()

    def prompt_logprobs():
        bfloat16_llm.llm_engine.call_utility("reset_prefix_cache")
        scored = bfloat16_llm.generate({"prompt_token_ids": prompt}, greedy(1, prompt_logprobs=0), use_tqdm=False)[0]
        return [{token: entry.logprob for token, entry in position.items()} for position in scored.prompt_logprobs[1:]]

    narrow = prompt_logprobs()
    for name, module in worker.model.named_modules():
        if isinstance(module, Linear) and not name.endswith("gate_up_proj"):
            monkeypatch.setattr(module, "output_dtype", torch.float32)
    monkeypatch.setattr(Linear, "input_dtype", lambda self, rows: None)
    assert narrow == prompt_logprobs()


def test_bfloat16_greedy_follows_transformers_bfloat16_except_after_near_ties(bfloat16_llm, tiny_models):
    """Up to where it parts from transformers' own bfloat16 forward, if it does, the output is the same; there the two
    tokens were nearly tied under float32 (our activations are float32, transformers' are bfloat16)."""
    model_dir = tiny_models["llama"]
    ours = token_ids_of(bfloat16_llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(16), use_tqdm=False))
    theirs = hf_greedy(model_dir, PROMPTS, 16, dtype=torch.bfloat16)
    for prompt, mine, reference in zip(PROMPTS, ours, theirs):
        parted = next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), None)
        if parted is not None:
            _, full = hf_token_logprobs(model_dir, prompt, list(mine[:parted]))
            last = full[len(prompt) + parted - 1]
            assert abs(last[mine[parted]] - last[reference[parted]]) < 0.25, (prompt, parted)
    # And it stays on float32's path at least as long as transformers' bfloat16 does (random weights have many ties).
    exact = hf_greedy(model_dir, PROMPTS, 16)
    assert sum(map(common_prefix, ours, exact)) >= sum(map(common_prefix, theirs, exact))


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe"])  # qwen2: q, k, v biases, tied embeddings; qwen2_moe: experts
def test_bfloat16_logprobs_stay_as_close_to_float32_as_transformers_bfloat16(arch, tiny_models):
    """Scored on the tokens float32 picks, over several prompts: our bfloat16 mode's logprobs are off from float32
    transformers' by no more, on the whole, than transformers' own bfloat16 forward's."""
    model_dir = tiny_models[arch]
    bfloat16_llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=16 * 1024**2)
    ours_off, theirs_off = [], []
    for seed in range(6):
        prompt = torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
        tokens = hf_greedy(model_dir, [prompt], 12)[0]
        exact, _ = hf_token_logprobs(model_dir, prompt, tokens)
        theirs, _ = hf_token_logprobs(model_dir, prompt, tokens, dtype=torch.bfloat16)
        scored = bfloat16_llm.generate({"prompt_token_ids": prompt + tokens}, greedy(1, prompt_logprobs=0), use_tqdm=False)[0]
        ours = [scored.prompt_logprobs[len(prompt) + i][token].logprob for i, token in enumerate(tokens)]
        ours_off += [abs(a - b) for a, b in zip(ours, exact)]
        theirs_off += [abs(a - b) for a, b in zip(theirs, exact)]
    assert sum(ours_off) <= 1.25 * sum(theirs_off), (max(ours_off), max(theirs_off))


def test_bfloat16_greedy_output_does_not_depend_on_the_batch(bfloat16_llm):
    alone = [token_ids_of(bfloat16_llm.generate({"prompt_token_ids": p}, greedy(16), use_tqdm=False))[0] for p in PROMPTS]
    together = token_ids_of(bfloat16_llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 4], greedy(16), use_tqdm=False))
    assert together == alone * 4


@pytest.mark.parametrize("flags,rates,expected", [
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, (220.0, 450.0), torch.bfloat16),  # AVX-512 BF16 at twice float32's rate
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, (300.0, 150.0), torch.float32),  # ... at half of it: float32 is faster
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, (300.0, 285.0), torch.bfloat16),  # a near-tie keeps bfloat16's bytes
    ({"avx2", "fma", "avx512f", "amx_tile", "amx_bf16"}, (400.0, 1700.0), torch.bfloat16),  # AMX tiles
    ({"avx2", "fma", "avx512f"}, None, torch.float32),  # AVX-512 without bfloat16: nothing to measure
    ({"avx2", "fma"}, None, torch.float32),
])
def test_auto_picks_bfloat16_where_its_gemms_measure_no_slower_than_float32(flags, rates, expected, monkeypatch, tmp_path):
    from pagedserve.executor import auto_dtype

    monkeypatch.delenv("PAGEDSERVE_CPU_AUTO_DTYPE")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(worker_module, "cpu_features", lambda: CPUFeatures(f"test CPU {sorted(flags)}", frozenset(flags)))
    measured = []
    monkeypatch.setattr(auto_dtype, "measure_gemm_rates", lambda: measured.append(rates) or auto_dtype.GemmRates(*rates))
    auto_dtype.gemm_rates.cache_clear()
    cpu = torch.device("cpu")
    assert worker_module.resolve_dtype(EngineConfig(), cpu) == expected
    assert measured == ([rates] if rates else [])
    # The KV cache is bfloat16 wherever the processor has bfloat16 instructions, whatever the GEMMs measured; asked-for
    # dtypes keep theirs.
    cache_dtype = torch.bfloat16 if "avx512_bf16" in flags or "amx_bf16" in flags else torch.float32
    assert worker_module.cache_dtype_of_model(EngineConfig(), cpu, expected) == cache_dtype
    assert worker_module.cache_dtype_of_model(EngineConfig(dtype="float32"), cpu, torch.float32) == torch.float32
    auto_dtype.gemm_rates.cache_clear()  # a later start reads the measurement back instead of measuring again
    assert worker_module.resolve_dtype(EngineConfig(), cpu) == expected and len(measured) == (1 if rates else 0)
    assert worker_module.resolve_dtype(EngineConfig(dtype="float32"), cpu) == torch.float32  # the exact mode, asked for
    monkeypatch.setenv("PAGEDSERVE_CPU_AUTO_DTYPE", "float32")
    assert worker_module.resolve_dtype(EngineConfig(), cpu) == torch.float32
    assert worker_module.cache_dtype_of_model(EngineConfig(), cpu, torch.float32) == torch.float32
    monkeypatch.setenv("PAGEDSERVE_CPU_AUTO_DTYPE", "half")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_AUTO_DTYPE must be float32 or bfloat16, got 'half'"):
        worker_module.resolve_dtype(EngineConfig(), cpu)
    auto_dtype.gemm_rates.cache_clear()


def test_the_measured_gemm_rates_are_this_machines():
    """The measurement itself: both dtypes multiplied through torch on this processor, float32 always."""
    from pagedserve.executor import auto_dtype

    rates = auto_dtype.measure_gemm_rates()
    assert rates.float32 > 1.0 and (rates.bfloat16 is None or rates.bfloat16 > 1.0)


def test_bfloat16_products_are_the_same_through_onednn_and_through_torch():
    """gemm_backend torch (and processors oneDNN has no bfloat16 kernels for) multiply the same bfloat16 values."""
    from pagedserve.layers.gemm import onednn_packs, pack_weight, packed_linear

    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 64), torch.randn(48), torch.randn(5, 64)
    expected = (x.bfloat16().float() @ weight.bfloat16().float().T).bfloat16().float() + bias
    plain = pack_weight(weight, torch.bfloat16, onednn=False)
    assert not plain.is_mkldnn and plain.dtype == torch.bfloat16
    torch.testing.assert_close(packed_linear(x, plain, bias), expected, rtol=1e-2, atol=1e-2)
    if onednn_packs(torch.bfloat16):
        packed = pack_weight(weight, torch.bfloat16)
        assert packed.is_mkldnn
        torch.testing.assert_close(packed_linear(x, packed, bias), expected, rtol=1e-2, atol=1e-2)


def test_bfloat16_is_honoured_with_torch_gemms_too(tiny_models):
    llm = LLM(str(tiny_models["qwen2"]), dtype="bfloat16", gemm_backend="torch", kv_cache_memory=8 * 1024**2)
    linears = [m for m in worker_of(llm).model.modules() if isinstance(m, Linear)]
    assert all(not m.packed_weight.is_mkldnn and m.packed_weight.dtype == torch.bfloat16 for m in linears)
    assert len(llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_default_model_in_bfloat16_gives_a_request_the_same_output_alone_and_in_a_batch():
    """Alone, a request decodes in one-row steps, on the GGUF blocks with its input rounded to 8 bits; in a batch, on
    the packed bfloat16 weights (on every processor with bfloat16 matrix units: elsewhere on the blocks' float32
    products, past the rows the integer products take). The two differ by those roundings only: logprobs stay close
    (8-bit input moves this model's by up to about a fifth from float32's, bfloat16 GEMMs by a twentieth), and greedy
    picks part, if at all, only where the exact model (float32) nearly ties the two tokens: each run's roundings move
    a gap between two logprobs by up to twice what they move one, so the runs' own gaps say less than the exact one."""
    from conftest import PROMPTS

    from pagedserve.cpu_features import cpu_features

    exact = LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 * 1024**2)

    def exact_gap(prompt_token_ids: list[int], token: int, other: int) -> float:
        position = exact.generate({"prompt_token_ids": prompt_token_ids}, greedy(1, logprobs=20), use_tqdm=False)[0].outputs[0].logprobs[0]
        return abs(position[token].logprob - position[other].logprob) if token in position and other in position else float("inf")

    llm = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory=64 * 1024**2)
    model = worker_of(llm).model
    assert model.compute_logits(torch.randn(2, model.config.hidden_size)).dtype == torch.float32  # the logits stay float32
    if cpu_features().has_bfloat16_matrix:
        for gemm in model.blocks_and_dense_gemms():
            gemm.blocks.max_rows = 1
    params = greedy(24, logprobs=2)
    alone = [llm.generate(prompt, params, use_tqdm=False)[0] for prompt in PROMPTS]
    together = [o.outputs[0] for o in llm.generate(PROMPTS * 2, params, use_tqdm=False)]
    for request, batched in zip(alone * 2, together):
        single = request.outputs[0]
        for step, (token, a, b) in enumerate(zip(single.token_ids, single.logprobs, batched.logprobs)):
            if batched.token_ids[step] != token:  # parted: the exact model nearly ties the two picks there
                assert exact_gap(request.prompt_token_ids + single.token_ids[:step], token, batched.token_ids[step]) < 0.3
                break
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=0.3)


def test_the_start_up_log_says_what_runs_on_amx_tiles(tiny_models, caplog):
    """Where the processor has AMX tiles (and Linux grants them), the log names what runs on them; elsewhere nothing
    claims them."""
    import logging

    with caplog.at_level(logging.INFO, logger="pagedserve.executor.worker"):
        llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", kv_cache_memory=8 * 1024**2)
    lines = [record.getMessage() for record in caplog.records if "AMX tiles" in record.getMessage()]
    if worker_of(llm).cpu_kernels.bf16_matrix_tiles():
        linears = sum(1 for m in worker_of(llm).model.modules() if isinstance(m, Linear))
        assert len(lines) == 1 and f"{linears} linear layers' steps of up to {TILES_MAX_ROWS} rows" in lines[0]
    else:
        assert lines == []
