"""Collectives through shared memory among processes of one machine, against the sums and gathers they replace."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pagedserve.distributed.shm_exchange import ShmExchange, sum_in_place

RANKS = 3


def _tensors(rank: int, step: int) -> torch.Tensor:
    """What rank contributes to exchange step: shapes and dtypes change from one exchange to the next."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    rows = 1 + (step * 7 + rank) % 5 if step % 3 == 2 else 1 + step % 4  # every third exchange: sizes differ by rank
    dtype = torch.bfloat16 if step % 5 == 4 else torch.float32
    return torch.randn(rows, 6, generator=generator).to(dtype)


def _rank(rank: int, name: str, steps: int, results) -> None:
    exchange = ShmExchange(rank, RANKS, 1 << 12, name)
    seen = []
    for step in range(steps):
        mine = _tensors(rank, step)
        parts = exchange.exchange(mine)
        if step % 3 == 2:
            seen.append(torch.cat([part.clone() for part in parts]))
        else:
            seen.append(sum_in_place(mine.clone(), parts))
    results.put((rank, [tensor.float().tolist() for tensor in seen]))  # plain lists: tensors would travel as shared fds


def test_every_rank_sees_every_ranks_tensor_exchange_after_exchange():
    """Three processes, 60 exchanges back to back through two alternating buffers: each sum equals the ranks' tensors
    added in rank order, each gather their concatenation, bit for bit and the same on every rank."""
    steps = 60
    owner = ShmExchange(0, RANKS, 1 << 12)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    others = [context.Process(target=_rank, args=(rank, owner.name, steps, results)) for rank in range(1, RANKS)]
    for process in others:
        process.start()
    _rank(0, owner.name, steps, results)
    seen = dict(results.get(timeout=120) for _ in range(RANKS))
    for process in others:
        process.join(60)
    for step in range(steps):
        contributions = [_tensors(rank, step) for rank in range(RANKS)]
        if step % 3 == 2:
            expected = torch.cat(contributions)
        else:
            expected = contributions[0].clone()
            for part in contributions[1:]:
                expected += part
        for rank in range(RANKS):
            assert torch.equal(torch.tensor(seen[rank][step]), expected.float()), (step, rank)


def test_a_tensor_over_capacity_or_not_on_cpu_does_not_fit():
    exchange = ShmExchange(0, 2, 1024)
    assert exchange.fits(torch.zeros(256))
    assert not exchange.fits(torch.zeros(257))
    assert not exchange.fits(torch.zeros(4, dtype=torch.complex64))


def test_the_memory_keeps_working_once_its_name_is_released():
    """The maker releases the name once every rank has attached, so processes that end without clean-up (killed) leave
    nothing in /dev/shm; the ranks' exchanges go on through their mappings."""
    owner = ShmExchange(0, 2, 1024)
    peer = ShmExchange(1, 2, 1024, owner.name)
    owner.release_name()
    assert not (Path("/dev/shm") / owner.name.lstrip("/")).exists()
    owner.release_name()  # twice (at exit too) is harmless
    with ThreadPoolExecutor(1) as pool:
        theirs = pool.submit(lambda: [part.clone() for part in peer.exchange(torch.full((3,), 2.0))])
        mine = [part.clone() for part in owner.exchange(torch.full((3,), 1.0))]
        assert [part.tolist() for part in theirs.result(timeout=30)] == [part.tolist() for part in mine] == [[1.0] * 3, [2.0] * 3]
