"""Per-expert work over the CPU's threads: every busy expert once, on one-thread workers, in the caller's modes."""

import multiprocessing
import sys
import threading
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moekit.moe import kernel_choices
from moekit.moe.cpu_threads import for_each_expert, longest_first, spreads
from moekit.moe.kernel_choices import MIN_EXPERTS_PER_THREAD

CPU = torch.device("cpu")
grouped = sys.modules["moekit.moe.grouped_linear"]


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_the_workers_take_the_busy_experts_longest_first():
    """Each worker takes the next expert as it ends one: in order of falling rows, two threads end within the
    smallest expert's time of each other (8 experts of 2,662 ... 1,433 rows, as a top-2 layer's: 8,293 / 8,091
    rows, where contiguous shares of about equal rows gave 10,442 / 5,942)."""
    assert longest_first([5, 0, 3, 9, 1, 1, 7, 2, 0, 4]) == [3, 6, 0, 9, 2, 7, 4, 5]
    assert longest_first([0, 0]) == []


def _record(costs, device=CPU, dtype=torch.float32):
    seen, lock = [], threading.Lock()

    def work(e):
        with lock:
            seen.append((e, threading.get_ident(), torch.get_num_threads(), torch.is_grad_enabled()))

    for_each_expert(work, costs, device, dtype)
    return seen


def test_every_busy_expert_runs_once_on_a_one_thread_worker(two_threads):
    costs = [0 if e % 5 == 0 else 1 + e % 3 for e in range(4 * MIN_EXPERTS_PER_THREAD)]
    seen = _record(costs)
    assert sorted(e for e, *_ in seen) == [e for e, cost in enumerate(costs) if cost]
    assert all(ident != threading.get_ident() for _, ident, _, _ in seen), "the work runs on the workers"
    assert {threads for *_, threads, _ in seen} == {1}, "each worker runs its products on one intra-op thread"
    assert not any(grad for *_, grad in seen), "no autograd recording in the workers"
    assert torch.get_num_threads() == 2, "the caller keeps its thread count"


def test_few_experts_one_thread_or_a_dispatch_mode_stay_on_the_calling_thread(two_threads):
    many = [1] * (4 * MIN_EXPERTS_PER_THREAD)
    few = [1] * (2 * MIN_EXPERTS_PER_THREAD - 1)
    assert {ident for _, ident, *_ in _record(few)} == {threading.get_ident()}
    with FlopCounterMode(display=False):  # the FLOP counter sees only the calling thread's operators
        assert {ident for _, ident, *_ in _record(many)} == {threading.get_ident()}
    torch.set_num_threads(1)
    assert {ident for _, ident, *_ in _record(many)} == {threading.get_ident()}


@pytest.mark.parametrize("units", ["AMX", ""])
def test_bf16_experts_of_enough_rows_spread_from_fewer_experts_by_matrix_units(two_threads, monkeypatch, units):
    """On a CPU with AMX, 8 bf16 experts (4 a thread) spread where they average BF16_SPREAD_MIN_ROWS rows, and stay on
    the calling thread with fewer rows (a decoding step's) or in float32; a CPU without an entry keeps them all there,
    and MIN_EXPERTS_PER_THREAD experts a thread spread whatever their dtype and rows."""
    monkeypatch.setattr(kernel_choices, "cpu_matrix_units", lambda: units)
    monkeypatch.setattr(kernel_choices, "BF16_MIN_EXPERTS_PER_THREAD", {"AMX": 4})
    monkeypatch.setattr(kernel_choices, "BF16_SPREAD_MIN_ROWS", {"AMX": 100})
    monkeypatch.setattr(kernel_choices, "MIN_EXPERTS_PER_THREAD", 16)
    large = [300, 0, 50, 120, 90, 200, 40, 100, 0, 100]  # 8 busy experts, 125 rows on average
    small = [3, 0, 5, 2, 2, 4, 1, 6, 2]
    assert spreads(large, torch.bfloat16, 2) == (units == "AMX")
    assert not spreads(large[:-1], torch.bfloat16, 2), "7 experts: fewer than 4 a thread"
    assert not spreads(small, torch.bfloat16, 2) and not spreads(large, torch.float32, 2)
    assert spreads([1] * 32, torch.float32, 2) and spreads([1] * 32, torch.bfloat16, 2)
    caller = threading.get_ident()
    on_bf16 = {ident for _, ident, *_ in _record(large, dtype=torch.bfloat16)}
    assert (caller not in on_bf16) if units else on_bf16 == {caller}
    assert {ident for _, ident, *_ in _record(small, dtype=torch.bfloat16)} == {caller}
    assert {ident for _, ident, *_ in _record(large, dtype=torch.float32)} == {caller}


def test_the_workers_keep_the_callers_inference_mode_and_raise_its_errors(two_threads):
    experts = 4 * MIN_EXPERTS_PER_THREAD
    with torch.inference_mode():
        out = torch.zeros(experts)  # an inference tensor: writing it outside inference mode would fail
        for_each_expert(lambda e: out[e].fill_(e), [1] * experts, CPU)
    assert torch.equal(out, torch.arange(experts, dtype=out.dtype))

    def fail(e):
        if e == experts - 1:
            raise ValueError(f"expert {e}")

    with pytest.raises(ValueError, match=f"expert {experts - 1}"):
        for_each_expert(fail, [1] * experts, CPU)


def _in_a_forked_child(experts: int) -> tuple[list[float], bool]:
    torch.set_num_threads(2)
    out = torch.zeros(experts)
    idents = set()
    for_each_expert(lambda e: idents.add(threading.get_ident()) or out[e].fill_(e), [1] * experts, CPU)
    return out.tolist(), threading.get_ident() not in idents


@pytest.mark.e2e  # starts a process
def test_a_forked_child_starts_its_own_workers(two_threads):
    """The parent's worker threads do not exist in a forked child (a DataLoader worker): the child starts its own."""
    experts = 4 * MIN_EXPERTS_PER_THREAD
    _record([1] * experts)  # the parent's workers exist
    with multiprocessing.get_context("fork").Pool(1) as pool:
        values, on_workers = pool.apply_async(_in_a_forked_child, (experts,)).get(timeout=120)
    assert values == list(range(experts)) and on_workers


def test_the_loop_kernel_on_threads_equals_the_reference(two_threads, monkeypatch):
    """64 ragged experts with empty ones and a tail, values and gradients, with the workers in use."""
    calls = []
    workers = sys.modules["moekit.moe.cpu_threads"]._get_workers
    monkeypatch.setattr(sys.modules["moekit.moe.cpu_threads"], "_get_workers", lambda n: calls.append(n) or workers(n))
    experts = 64
    counts = torch.randint(0, 6, (experts,))
    counts[::7] = 0
    rows = int(counts.sum()) + 3  # 3 tail rows that belong to no expert
    x = torch.randn(rows, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(experts, 8, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(experts, 5, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(rows, 5, dtype=torch.float64)
    out = grouped.grouped_linear(x, w, b, counts, "loop")
    out.backward(grad)
    got = (out.detach(), x.grad, w.grad, b.grad)
    assert calls, "the threaded path ran"
    x.grad = w.grad = b.grad = None
    start, ref = 0, torch.zeros(rows, 5, dtype=torch.float64)
    for e, n in enumerate(counts.tolist()):
        ref[start : start + n] = x[start : start + n] @ w[e] + b[e]
        start += n
    ref.backward(grad)
    for g, r in zip(got, (ref.detach(), x.grad, w.grad, b.grad)):
        torch.testing.assert_close(g, r)


def test_an_error_stops_the_workers_and_reaches_the_caller_once_every_worker_has_ended(two_threads):
    """After a failing expert no worker starts another, and the error reaches the caller only once the expert another
    worker was running has ended, so no worker writes the outputs once the caller handles the error (an
    out-of-memory retry, say)."""
    experts = 4 * MIN_EXPERTS_PER_THREAD
    other, failed, started, ended = threading.Event(), threading.Event(), [], []

    def work(e):
        started.append(e)
        if e == 0:
            other.wait(timeout=60)  # fails while the other worker runs an expert
            failed.set()
            raise MemoryError(f"expert {e}")
        other.set()
        failed.wait(timeout=60)  # the other worker's expert runs on after the failure
        time.sleep(0.001)
        ended.append(e)

    with pytest.raises(MemoryError, match="expert 0"):
        for_each_expert(work, [1] * experts, CPU)
    assert sorted(started) == [0, *ended], "every expert that started, bar the failing one, ended before the error"
    assert len(started) == 2, "no worker started another expert after the error: the failing one and the other's"


def test_python_threads_with_different_thread_counts_keep_their_own_workers(two_threads, monkeypatch):
    """Two Python threads whose torch thread counts differ (two models set up with their own) each use workers of
    their count; one starting its workers does not shut down those the other is about to use."""
    cpu_threads = sys.modules["moekit.moe.cpu_threads"]
    get_workers, other_done = cpu_threads._get_workers, threading.Event()
    results = {}

    def between_lookup_and_use(n):
        workers = get_workers(n)
        if n == 2 and not other_done.is_set():  # the 2-thread caller, between finding its workers and using them,
            other = threading.Thread(target=caller, args=(3,))  # lets a 3-thread caller run in full
            other.start()
            other.join()
            other_done.set()
        return workers

    def caller(n):
        torch.set_num_threads(n)
        out = torch.zeros(16 * n)
        try:
            for_each_expert(lambda e: out[e].fill_(e), [1] * len(out), CPU)
            results[n] = torch.equal(out, torch.arange(len(out), dtype=out.dtype))
        except RuntimeError as err:
            results[n] = repr(err)

    monkeypatch.setattr(cpu_threads, "_get_workers", between_lookup_and_use)
    first = threading.Thread(target=caller, args=(2,))
    first.start()
    first.join()
    assert results == {2: True, 3: True}
