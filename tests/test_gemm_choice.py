"""Which GEMMs run on their GGUF blocks: measured per weight shape, kept for the next start, and applied."""

import pytest
import torch

from pagedserve.executor import gemm_choice
from pagedserve.layers.linear import EVERY_STEP, BlocksOrDense


class FakeClock:
    """A clock that moves only when a fake GEMM 'runs', by the time it is given to cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakeBlocks:
    stored_bytes = 1024

    def __init__(self, clock, seconds_per_row, qtype=3):
        self.clock, self.seconds_per_row, self.qtype, self.max_rows = clock, seconds_per_row, qtype, 64
        self.rounds_activations = False

    def linear(self, x):
        self.clock.now += self.seconds_per_row * x.shape[0]
        return x


def fake_gemm(clock, shape, blocks_per_row, dense_seconds):
    def dense(x):
        clock.now += dense_seconds
        return x

    return BlocksOrDense(shape, 8, FakeBlocks(clock, blocks_per_row), dense)


def test_each_shape_keeps_its_blocks_up_to_the_last_row_count_they_were_not_slower_at():
    clock = FakeClock()
    gemms = [
        fake_gemm(clock, "narrow 8x8", blocks_per_row=1.0, dense_seconds=4.5),  # blocks win at 1-4 rows, lose at 6
        fake_gemm(clock, "wide 8x64", blocks_per_row=1.0, dense_seconds=100.0),  # blocks win at every candidate
        fake_gemm(clock, "fast dense 8x16", blocks_per_row=1.0, dense_seconds=0.5),  # dense wins from the first row
        fake_gemm(clock, "narrow 8x8", blocks_per_row=1.0, dense_seconds=4.5),  # a second layer of the first shape
    ]
    assert gemm_choice.measure(gemms, clock) == {"narrow 8x8": 4, "wide 8x64": 64, "fast dense 8x16": 0}


def test_a_large_model_is_measured_on_its_first_layers_and_every_shape(monkeypatch):
    """Beyond MEASURED_BYTES of blocks, a measurement runs only the first GEMM of a shape it has not met (the lm_head):
    every shape gets its row count, at a fraction of the time."""
    monkeypatch.setattr(gemm_choice, "MEASURED_BYTES", 2 * FakeBlocks.stored_bytes)
    clock = FakeClock()
    layers = [fake_gemm(clock, shape, blocks_per_row=1.0, dense_seconds=4.5) for _ in range(10) for shape in ("qkv 8x8", "o 8x8")]
    gemms = [*layers, fake_gemm(clock, "lm_head 8x64", blocks_per_row=1.0, dense_seconds=100.0)]
    assert gemm_choice.measured_gemms(gemms) == [gemms[0], gemms[1], gemms[-1]]
    assert gemm_choice.measure(gemms, clock) == {"qkv 8x8": 4, "o 8x8": 4, "lm_head 8x64": 64}
    monkeypatch.setattr(gemm_choice, "MEASURED_BYTES", 100 * FakeBlocks.stored_bytes)
    assert gemm_choice.measured_gemms(gemms) == gemms  # a model within it is measured whole


def test_blocks_that_round_their_input_are_measured_at_prefill_rows_and_may_take_every_step():
    clock = FakeClock()
    gemms = [
        fake_gemm(clock, "float 8x8", blocks_per_row=1.0, dense_seconds=1000.0),  # float products: decode rows only
        fake_gemm(clock, "integer 8x64", blocks_per_row=1.0, dense_seconds=1000.0),  # ahead at every count measured
        fake_gemm(clock, "integer 8x16", blocks_per_row=1.0, dense_seconds=160.0),  # ahead up to 128 rows
    ]
    for gemm in gemms[1:]:
        gemm.blocks.rounds_activations = True
    assert gemm_choice.measure(gemms, clock) == {"float 8x8": 64, "integer 8x64": EVERY_STEP, "integer 8x16": 128}


class FakeModel:
    def __init__(self, gemms):
        self.gemms = gemms

    def blocks_and_dense_gemms(self):
        return self.gemms


def test_the_choice_is_applied_and_read_back_by_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    measured = {"first 8x8": 3, "second 8x16": 0}
    calls = []
    monkeypatch.setattr(gemm_choice, "measure", lambda gemms: calls.append(len(gemms)) or measured)
    clock = FakeClock()
    first = FakeModel([fake_gemm(clock, "first 8x8", 1.0, 1.0), fake_gemm(clock, "second 8x16", 1.0, 1.0)])
    assert gemm_choice.choose(first, torch.float32) == measured
    assert [g.blocks.max_rows for g in first.gemms] == [3, 0]
    second = FakeModel([fake_gemm(clock, "first 8x8", 1.0, 1.0), fake_gemm(clock, "second 8x16", 1.0, 1.0)])
    assert gemm_choice.choose(second, torch.float32) == measured
    assert [g.blocks.max_rows for g in second.gemms] == [3, 0]
    assert calls == [2]  # measured once; the second start read it back
    gemm_choice.choose(second, torch.bfloat16)  # another dense dtype is another measurement
    assert calls == [2, 2]
    for gemm in second.gemms:  # blocks that round their input are another kernel
        gemm.blocks.rounds_activations = True
    gemm_choice.choose(second, torch.bfloat16)
    assert calls == [2, 2, 2]


@pytest.mark.parametrize("rows", [1, 2, 5, 40, 100])
def test_the_default_model_gives_the_same_logits_whichever_path_a_step_takes(default_llm, rows):
    """Every GEMM of the default model, on its blocks or on its float32 weight, gives the same products (float32:
    the blocks' values are the weight's), so where this machine puts the crossover changes no output."""
    from conftest import worker_of

    model = worker_of(default_llm).model
    torch.manual_seed(rows)
    for gemm in model.blocks_and_dense_gemms():
        x = torch.randn(rows, gemm.in_features)
        torch.testing.assert_close(gemm.blocks.linear(x), gemm.dense(x), rtol=1e-4, atol=1e-4)
