"""Offload on a side stream: what the CPU can check of it (the copies, the prefetch before each block's
backward, the host pool reused from step to step, the timing, training bitwise through every switch into and
out of it); the overlap itself needs CUDA (tests/test_cuda.py runs every mode there)."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch

from rematd import client
from rematd.client import introspect
from rematd.client.blocks import offload
from rematd.client.blocks.host_pool import IDLE_STEPS, HostPool, size_class
from rematd.client.steps import hello as hello_module
from rematd.planner import Mode

from .helpers import batch, lm_loss, tiny_model
from .workers.switch_matrix import EXACT, circuit, rounds

EVERY = client.OffloadConfig(min_bytes=0)
"""Tiny tensors offloaded all the same."""


def test_offloaded_blocks_train_exactly_as_stored_ones_and_come_back_before_their_backward() -> None:
    ref = tiny_model(dropout=0.2, seed=5)
    model = tiny_model(dropout=0.2, seed=5)
    h = client.attach(model, budget_bytes=10**12, modes=["store", "recompute", "offload"], offload=EVERY)
    assert Mode.OFFLOAD not in introspect.blocks(h)[0].offer, "no host link to measure on the CPU: not offered"
    lm_loss(model, batch(24)).backward()  # the profiling step
    h.step()
    model.zero_grad()
    h.pin_modes([Mode.OFFLOAD] * 4)  # as a plan naming offload would have it
    for seed in (1, 2):
        torch.manual_seed(seed)
        ref_loss = lm_loss(ref, batch(24, seed=seed))
        ref_loss.backward()
        torch.manual_seed(seed)
        loss = lm_loss(model, batch(24, seed=seed))
        loss.backward()
        h.step()
        assert loss.item() == ref_loss.item()
        for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), name
        ref.zero_grad()
        model.zero_grad()
    off = introspect.offloader(h)
    assert (off.prefetched, off.late) == (8, 0), "every block fetched when the gradient reached its output"
    assert introspect.offload_groups(off) == 0, "nothing left behind"
    assert h.last_stats is not None
    (timed,) = h.last_stats.mode_seconds
    assert timed.mode == Mode.OFFLOAD and timed.blocks == 4
    assert timed.forward_seconds > 0 and timed.seconds > 0, "the copies out and back are both timed"
    h.close()


def test_small_tensors_and_parameters_stay_on_the_device() -> None:
    off = offload.Offloader()
    w = torch.nn.Parameter(torch.randn(256, 256))
    x = torch.randn(4, 256, requires_grad=True)
    with off.block() as group:
        y = (x @ w).relu().sum()
    assert group.saved == [], "a parameter and tensors under 64 KiB are not worth a copy"
    y.backward()
    assert x.grad is not None and w.grad is not None


def test_groups_of_forwards_without_backward_go_at_the_step_end() -> None:
    """A forward with gradients on whose backward never runs leaves its host copies behind only until the
    step ends; a backward still pending then finds its own."""
    off = offload.Offloader(config=EVERY)
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)

    def two_blocks() -> torch.Tensor:
        with off.block() as first:
            y = (x @ w).sin()
        off.on_output(first, y)
        with off.block() as second:
            z = (y @ w).cos()
        off.on_output(second, z)
        return z.sum()

    pending = two_blocks()
    with off.block() as unused:
        _ = (x @ w).sin().sum()  # evaluated, never backpropagated
    host = weakref.ref(unused.saved[0].host)
    del unused, _
    assert introspect.offload_groups(off) == 3
    off.end_step()
    gc.collect()
    assert introspect.offload_groups(off) == 0 and host() is None, "the unused forward's host copies are gone"
    assert off.pool is not None and off.pool.free_bytes > 0, "their buffer is the pool's again"
    pending.backward()  # the pending backward still has what it saved
    assert off.prefetched == 2 and off.late == 0
    grads = x.grad.clone(), w.grad.clone()  # type: ignore[union-attr]
    x.grad = w.grad = None
    ((x @ w).sin() @ w).cos().sum().backward()
    assert torch.allclose(grads[0], x.grad) and torch.allclose(grads[1], w.grad)  # type: ignore[arg-type]


def test_steps_reuse_the_pools_host_buffers_and_a_length_left_behind_lets_them_go() -> None:
    model = tiny_model(seed=2)
    h = client.attach(model, budget_bytes=10**12, modes=["store", "recompute", "offload"], offload=EVERY)
    pool = introspect.offloader(h).pool
    assert pool is not None
    lm_loss(model, batch(32)).backward()  # the profiling step
    h.step()
    h.pin_modes([Mode.OFFLOAD] * 4)
    lens, fresh, owned = [32, 32, 32, 40, 24, 24, 24, 24], [], []
    for k, seq in enumerate(lens):
        lm_loss(model, batch(seq, seed=k)).backward()
        h.step()
        fresh.append(pool.fresh)
        owned.append(pool.owned_bytes)
    assert fresh[0] > 0 and fresh[2] == fresh[1] == fresh[0], f"steps of one length allocate once: {fresh}"
    assert pool.reused >= 2 * fresh[0], "the later steps of that length took the same buffers"
    # 40 tokens fit in 32's size classes or take new buffers; 24 takes 32's buffers or smaller ones, and buffers
    # no step took for IDLE_STEPS step ends go: the pool ends holding what a 24-token step needs.
    assert fresh[-1] == fresh[-2], f"a held length allocates nothing more: {fresh}"
    assert 0 < owned[-1] < owned[3], f"what only the longer step needed was let go: {owned}"
    h.close()


def test_a_steps_end_calls_the_offloader_only_while_it_has_something_to_let_go_of() -> None:
    model = tiny_model(seed=2)
    h = client.attach(model, budget_bytes=10**12, modes=["store", "recompute", "offload"], offload=EVERY)
    off = introspect.offloader(h)
    pool = off.pool
    assert pool is not None
    ends = []
    end_step = off.end_step
    off.end_step = lambda: ends.append(1) or end_step()  # type: ignore[method-assign]

    def step() -> bool:
        lm_loss(model, batch(32)).backward()
        h.step()
        return off.used

    step()  # the profiling step
    h.pin_modes([Mode.STORE] * 4)
    assert not step() and ends == [], "nothing offloaded: the step's end does not call the offloader"
    h.pin_modes([Mode.OFFLOAD] * 4)
    assert step() and pool.owned_bytes > 0 and ends == [1], "the pool holds its buffers for the next steps"
    h.pin_modes([Mode.STORE] * 4)
    # Buffers no step took go after IDLE_STEPS step ends, each of which calls the offloader; then none does.
    used = [step() for _ in range(IDLE_STEPS + 2)]
    assert used[-2:] == [False, False] and pool.owned_bytes == 0, used
    assert len(ends) == 1 + used.index(False) + 1 <= 1 + IDLE_STEPS + 1, ends
    h.close()


def test_the_pool_lends_a_buffer_again_only_once_its_last_copy_is_done() -> None:
    class Copy:
        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

    pool = HostPool()
    first = pool.take(100_000, pinned=False)
    copy = Copy()
    pool.give_back(first, copy)
    second = pool.take(100_000, pinned=False)
    assert second.buffer.data_ptr() != first.buffer.data_ptr(), "its copy back still runs: not lent"
    copy.done = True
    pool.give_back(second)
    third, fourth = pool.take(100_000, pinned=False), pool.take(99_000, pinned=False)
    assert {third.buffer.data_ptr(), fourth.buffer.data_ptr()} == {first.buffer.data_ptr(), second.buffer.data_ptr()}
    assert (pool.fresh, pool.reused) == (2, 2)
    assert third.view(torch.empty(5, 7, dtype=torch.float64)).shape == (5, 7)
    del third  # dropped without a give-back (a forward whose backward never ran): the pool has it back
    gc.collect()
    assert pool.free_bytes == size_class(100_000)
    pool.give_back(fourth)
    for _ in range(IDLE_STEPS):
        assert pool.owned_bytes == 2 * size_class(100_000)
        pool.end_step()
    assert (pool.owned_bytes, pool.free_bytes) == (0, 0), "buffers no step took are let go"


@pytest.mark.parametrize(
    ("field", "value"), [("prefetch_blocks", -1), ("prefetch_blocks", 1.5), ("min_bytes", True), ("pool", "yes")]
)
def test_a_bad_setting_is_refused_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^offload.{field} must be"):
        client.OffloadConfig(**{field: value})  # type: ignore[arg-type]


def test_without_the_pool_every_tensor_takes_a_fresh_host_copy_and_trains_alike() -> None:
    results = []
    for config in (EVERY, client.OffloadConfig(min_bytes=0, pool=False, prefetch_blocks=3)):
        model = tiny_model(seed=4)
        h = client.attach(model, budget_bytes=10**12, modes=["store", "recompute", "offload"], offload=config)
        lm_loss(model, batch(16)).backward()
        h.step()
        h.pin_modes([Mode.OFFLOAD] * 4)
        for seed in (1, 2):
            lm_loss(model, batch(16, seed=seed)).backward()
            h.step()
        off = introspect.offloader(h)
        assert (off.pool is None) == (not config.pool)
        results.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        h.close()
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("ahead", [1, 3])
def test_offload_is_priced_from_the_links_bandwidth_and_holds_the_blocks_fetched_ahead(
    monkeypatch: pytest.MonkeyPatch, ahead: int
) -> None:
    """The link's bandwidth is CUDA's to measure (tests/test_cuda.py); given one, the profile prices offload
    from it: both copies' seconds, none of them hidden until a step shows it, and while a block's backward runs
    its activations and those of the blocks fetched ahead of it on the device."""
    monkeypatch.setattr(hello_module, "link_bandwidth", lambda memory: 1e9)
    model = tiny_model(seed=1)
    config = client.OffloadConfig(prefetch_blocks=ahead)
    h = client.attach(model, budget_bytes=10**12, modes=["store", "recompute", "offload"], offload=config)
    lm_loss(model, batch(64)).backward()
    h.step()
    for block in introspect.hello(h).blocks:
        costs = {c.mode: c for c in block.modes}
        off = costs[Mode.OFFLOAD]
        assert off.kept.bytes == 0
        assert off.transient.bytes == (1 + ahead) * block.saved_bytes
        assert off.extra_seconds == pytest.approx(2 * block.saved_bytes / 1e9)
    h.close()


def test_a_tensor_no_host_memory_can_be_had_for_stays_on_the_device_and_the_step_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    off = offload.Offloader(config=EVERY)
    assert off.pool is not None

    def no_memory(nbytes: int, *, pinned: bool) -> None:
        raise RuntimeError("CUDA error: out of memory (pinned host allocation)")

    off.pool.take = no_memory  # type: ignore[assignment,method-assign]
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    with off.block() as group:
        y = (x @ w).sin().sum()
    y.backward()
    assert group.saved == [] and off.kept == 2, "both saved tensors kept where they were"
    expected = torch.autograd.grad((x @ w).sin().sum(), [x, w])
    assert torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])  # type: ignore[arg-type]
    assert [r.getMessage() for r in caplog.records].count(
        "rematd: offload could not get host memory (CUDA error: out of memory (pinned host allocation)); tensors "
        "stay on the device"
    ) == 1, "said once"


def test_size_classes_round_up_by_at_most_an_eighth_or_a_page() -> None:
    for n in [1, 4095, 4096, 4097, 65_536, 65_537, 1_000_000, 3 * 2**20 + 1, 2**31 + 5]:
        c = size_class(n)
        assert c >= n and c % 4096 == 0, n
        assert c - n < max(n / 8, 4096), (n, c)
    assert size_class(1_000_000) == size_class(1_000_001), "a tensor a little larger takes the same buffer"


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_backward_finds_the_blocks_prefetch_blocks_ahead_already_coming_back(ahead: int) -> None:
    off = offload.Offloader(config=client.OffloadConfig(min_bytes=0, prefetch_blocks=ahead))
    ws = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(5)]
    x = torch.randn(4, 16, requires_grad=True)
    groups = []
    for w in ws:
        with off.block() as group:
            x = (x @ w).sin()
        off.on_output(group, x)
        groups.append(group)
    events: list[tuple[str, int]] = []
    fetch, wait = off._fetch, off._wait

    def fetching(group: offload._Group) -> None:
        if not group.fetched:
            events.append(("fetch", groups.index(group)))
        fetch(group)

    def waiting(s: offload._Saved) -> torch.Tensor:
        i = next(k for k, g in enumerate(groups) if any(t is s for t in g.saved))
        if ("unpack", i) not in events:
            events.append(("unpack", i))
        return wait(s)

    off._fetch, off._wait = fetching, waiting  # type: ignore[method-assign]
    x.sum().backward()
    assert (off.prefetched, off.late) == (5, 0)
    for i in range(5):
        before = {k for kind, k in events[: events.index(("unpack", i))] if kind == "fetch"}
        assert before == set(range(max(0, i - ahead), 5)), (ahead, i, events)


def test_every_switch_into_and_out_of_offload_trains_bitwise_as_without_rematd() -> None:
    """A circuit through every ordered pair of the exact modes the blocks offer and offload (each block from its
    own offset, so the plans in between mix them), a pin a step, against the same training without rematd."""
    ref = tiny_model(dropout=0.1, seed=7)
    model = tiny_model(dropout=0.1, seed=7)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    h = client.attach(model, budget_bytes=10**12, modes=[*EXACT, Mode.OFFLOAD], offload=EVERY, optimizer=opts[1])

    def step(k: int) -> None:
        ids = batch(24, seed=k)
        losses = []
        for m, opt in zip((ref, model), opts, strict=True):
            torch.manual_seed(k)  # dropout draws the same numbers in both
            loss = lm_loss(m, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        assert torch.equal(*losses), (k, h.modes)
        for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q), (k, h.modes, name)

    step(0)  # the profiling step: the blocks' offer is known from here
    offered = [m for m in EXACT if m in introspect.blocks(h)[0].offer]
    assert {Mode.ATTENTION, Mode.MLP, Mode.TITAN} <= set(offered), "the demo's blocks offer the finer modes"
    every = [*offered, Mode.OFFLOAD]
    pins = rounds(circuit(every)[:-1], 4, 1)
    for k, pinned in enumerate(pins, start=1):
        assert pinned is not None
        h.pin_modes(pinned)
        step(k)
        assert list(h.modes) == pinned
    made = {(a[i], b[i]) for a, b in itertools.pairwise(pins) for i in range(4) if a and b and a[i] != b[i]}
    assert made == set(itertools.permutations(every, 2)), "every switch was made"
    assert introspect.offloader(h).late == 0
    h.close()
