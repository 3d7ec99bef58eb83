"""cpbook.engine.scheduler: continuous batching invariants, with a stand-in model (no tensors)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.engine.scheduler import Request, Scheduler
from cpbook.kv.manager import AllocationError, KVCacheManager

VOCAB = 50


def fake_next(tokens: list[int]) -> int:
    """A deterministic 'model': the next token is a function of the whole sequence."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % VOCAB


def expected_output(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_next(toks))
    return toks[len(prompt) :]


def check_blocks(kv: KVCacheManager) -> None:
    """No block id owned twice, except full hashed blocks shared through the prefix cache;
    reference counts match the owners; free ids have no owner."""
    owners: dict[int, int] = {}
    for req in kv.requests.values():
        assert len(set(req.blocks)) == len(req.blocks)
        for b in req.blocks:
            owners[b] = owners.get(b, 0) + 1
    for b, n in owners.items():
        assert kv.ref_cnt[b] == n and b not in kv.free_queue
        assert n == 1 or kv.block_hash[b] is not None
    assert len(owners) + kv.num_free_blocks == kv.num_blocks


def assert_work_conserving(sched: Scheduler, out) -> None:
    """Right after ``schedule()``: a step leaves token budget unused only when no work could
    use it.  (1) If a running request still has tokens this step did not schedule, the step
    used the whole budget.  (2) If budget is left while requests wait, admission was blocked
    by a stated rule: ``max_num_seqs``, a preemption this step, the head's cached prefix not
    yet written, or not enough free blocks for the head (tried on a copy of the manager)."""
    scheduled = {c.request_id: c.num_tokens for c in out.chunks}
    left = {
        r.request_id: r.num_tokens - r.num_computed_tokens - scheduled.get(r.request_id, 0)
        for r in sched.running
    }
    assert all(n >= 0 for n in left.values())
    budget = sched.max_num_batched_tokens
    if any(left.values()):
        assert out.num_batched_tokens == budget, (
            f"step {out.step} used {out.num_batched_tokens} of {budget} tokens while running "
            f"work was left: {left}"
        )
    if out.num_batched_tokens < budget and sched.waiting:
        head = sched.waiting[0]
        if len(sched.running) < sched.max_num_seqs and not out.preempted:
            tokens = head.all_tokens
            if all(b in sched.written for b in sched.kv.cached_prefix(tokens)):
                with pytest.raises(AllocationError):
                    copy.deepcopy(sched.kv).allocate(head.request_id, len(tokens), tokens)


def check_prefix_hits_read_written_kv(sched: Scheduler, out, kv_store: dict) -> None:
    """Right after ``schedule()``: every token a prefix hit lets an admitted request skip has
    its K/V in the cache already, written by an earlier step for the same token prefix.
    ``kv_store[(block id, offset)]`` is what the runner last wrote there (the token prefix the
    K/V row was computed from), so a block marked written while partly computed fails here."""
    vb = sched.kv.virtual_block_size
    for rid in out.admitted:
        req = sched.requests[rid]
        table = sched.kv.block_table(rid).tolist()
        for p in range(req.prefix_hit_tokens):
            assert kv_store.get((table[p // vb], p % vb)) == tuple(req.all_tokens[: p + 1]), (
                f"step {out.step}: {rid} reuses position {p} of block {table[p // vb]}, whose "
                "K/V was never computed for that prefix"
            )


def run_to_completion(sched: Scheduler, max_steps: int = 2000) -> list:
    """Run the scheduler with :func:`fake_next` as the model, checking every step: the budget,
    work conservation, ``max_num_seqs``, vLLM's no-admission-in-a-step-that-preempted rule,
    that prefix hits read only computed K/V, chunk contents and block ownership."""
    steps, kv_store = [], {}
    vb = sched.kv.virtual_block_size
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return steps
        out = sched.schedule()
        # vllm/v1/core/sched/scheduler.py (v0.34.0): "if not preempted_reqs ..." (line 1066)
        # guards the whole WAITING loop: a step that preempted admits no new request
        assert not (out.preempted and out.admitted), out
        check_prefix_hits_read_written_kv(sched, out, kv_store)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert_work_conserving(sched, out)
        assert len(sched.running) <= sched.max_num_seqs
        sampled = {}
        for c in out.chunks:
            req = sched.requests[c.request_id]
            assert c.start == req.num_computed_tokens  # no token skipped or computed twice
            assert c.num_tokens >= 1 and c.start + c.num_tokens <= req.num_tokens
            assert list(c.token_ids) == req.all_tokens[c.start : c.start + c.num_tokens]
            assert all(
                b in sched.written for b in c.block_table[: c.start // sched.kv.virtual_block_size]
            )
            for p in range(c.start, c.start + c.num_tokens):  # the runner writes K/V rows
                kv_store[(c.block_table[p // vb], p % vb)] = tuple(req.all_tokens[: p + 1])
            if c.sample:
                sampled[c.request_id] = fake_next(req.all_tokens)
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        sched.update(out, sampled)
        check_blocks(sched.kv)
        steps.append(out)
    raise AssertionError(f"requests did not finish within {max_steps} steps")


workloads = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(4, 24),
        "block_size": st.sampled_from([2, 4]),
        "dcp": st.sampled_from([1, 2, 4]),
        "budget": st.integers(1, 24),
        "max_num_seqs": st.integers(1, 6),
        "caching": st.booleans(),
        "prompts": st.lists(
            st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 6)),
            min_size=1,
            max_size=7,
        ),
    }
)


@given(workloads)
@settings(max_examples=150, deadline=None)
def test_every_admitted_request_finishes_with_its_exact_tokens(w):
    kv = KVCacheManager(
        w["num_blocks"], w["block_size"], w["dcp"], enable_prefix_caching=w["caching"]
    )
    sched = Scheduler(kv, w["budget"], w["max_num_seqs"])
    family = {f: [(f * 7 + i) % VOCAB for i in range(40)] for f in range(3)}
    reqs = []
    for i, (f, n, new) in enumerate(w["prompts"]):
        reqs.append(sched.add_request(Request(str(i), family[f][:n], new)))
    run_to_completion(sched)
    cap = kv.num_blocks * kv.virtual_block_size
    for r in reqs:
        if len(r.prompt) + r.max_new_tokens > cap:
            assert r.status == "error" and "[request-fits-cache]" in r.error and not r.output
        else:
            assert r.status == "finished"
            assert r.output == expected_output(r.prompt, r.max_new_tokens)
    assert kv.num_free_blocks == kv.num_blocks  # everything released


def test_preemption_recomputes_and_loses_nothing():
    kv = KVCacheManager(6, 4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    reqs = [sched.add_request(Request(str(i), [i + 1] * 9, 10)) for i in range(2)]
    steps = run_to_completion(sched)
    assert sched.num_preemptions >= 1 and any(s.preempted for s in steps)
    for r in reqs:
        assert r.output == expected_output(r.prompt, 10)


def test_shared_prefix_waits_until_written_then_hits():
    kv = KVCacheManager(32, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=4)
    shared = list(range(16))
    a = sched.add_request(Request("a", shared + [20, 21], 2))
    b = sched.add_request(Request("b", shared + [30], 2))
    first = sched.schedule()
    assert first.admitted == ("a",) and first.chunks[0].kind == "chunked_prefill"
    run_to_completion(sched)
    assert b.prefix_hit_tokens == 16 and a.prefix_hit_tokens == 0
    assert b.output == expected_output(b.prompt, 2)


def test_budget_splits_a_long_prompt_into_chunks():
    sched = Scheduler(KVCacheManager(32, 4), max_num_batched_tokens=8)
    sched.add_request(Request("a", list(range(20)), 1))
    kinds = [[(c.kind, c.num_tokens) for c in s.chunks] for s in run_to_completion(sched)]
    assert kinds == [[("chunked_prefill", 8)], [("chunked_prefill", 8)], [("chunked_prefill", 4)]]


long_work = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(8, 40),
        "block_size": st.sampled_from([2, 4]),
        "dcp": st.sampled_from([1, 2]),
        "budget": st.integers(1, 12),
        "max_num_seqs": st.integers(1, 6),
        "caching": st.booleans(),
        "prompts": st.lists(
            st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 8)),
            min_size=2,
            max_size=8,
        ),
    }
)


@given(long_work)
@settings(max_examples=100, deadline=None)
def test_a_step_uses_the_whole_budget_while_running_work_remains(w):
    """Work conservation: budgets small against the prompts, so most steps end with running
    work left; every such step schedules exactly ``max_num_batched_tokens`` tokens
    (:func:`assert_work_conserving` runs after every ``schedule()``)."""
    kv = KVCacheManager(
        w["num_blocks"], w["block_size"], w["dcp"], enable_prefix_caching=w["caching"]
    )
    sched = Scheduler(kv, w["budget"], w["max_num_seqs"])
    family = {f: [(f * 5 + i) % VOCAB for i in range(40)] for f in range(3)}
    for i, (f, n, new) in enumerate(w["prompts"]):
        sched.add_request(Request(str(i), family[f][:n], new))
    run_to_completion(sched)
    assert all(r.status in ("finished", "error") for r in sched.requests.values())


def test_exact_tokens_per_step_with_one_token_of_budget_left():
    """Budget 8: ``a`` (7 tokens) leaves 1 token, which starts ``b``'s prefill; then ``a``'s
    decodes share each step with 7 of ``b``'s tokens."""
    sched = Scheduler(KVCacheManager(32, 4), max_num_batched_tokens=8, max_num_seqs=4)
    sched.add_request(Request("a", list(range(7)), 3))
    sched.add_request(Request("b", list(range(10, 30)), 2))
    steps = [
        [(c.request_id, c.kind, c.num_tokens) for c in s.chunks] for s in run_to_completion(sched)
    ]
    assert steps == [
        [("a", "prefill", 7), ("b", "chunked_prefill", 1)],
        [("a", "decode", 1), ("b", "chunked_prefill", 7)],
        [("a", "decode", 1), ("b", "chunked_prefill", 7)],
        [("b", "chunked_prefill", 5)],
        [("b", "decode", 1)],
    ]


def test_a_partly_computed_block_is_not_a_prefix_hit():
    """Budget 7, virtual blocks of 4: ``a``'s first chunk computes tokens 0-6, so its second
    block holds 3 of 4 rows.  ``b`` shares ``a``'s first 8 tokens; it may reuse that block only
    after the step that computes token 7 (vLLM caches ``num_computed_tokens // block_size``
    blocks: ``single_type_kv_cache_manager.py`` ``cache_blocks``, v0.34.0)."""
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=7, max_num_seqs=4)
    shared = list(range(1, 11))
    sched.add_request(Request("a", shared, 2))
    b = sched.add_request(Request("b", shared[:8] + [30], 2))
    steps = run_to_completion(sched)
    assert [s.admitted for s in steps[:3]] == [("a",), (), ("b",)]
    assert b.prefix_hit_tokens == 8 and b.output == expected_output(b.prompt, 2)


def test_a_step_that_preempts_admits_nobody():
    """Two requests with one prompt on 5 blocks of 4 tokens: ``b`` decodes into a block whose
    tokens ``a`` already cached, so once preempted it would fit again at once (its prefix is
    shared).  vLLM admits no request in a step that preempted (``scheduler.py``, v0.34.0: the
    WAITING loop runs only ``if not preempted_reqs``); ``b`` comes back a step later."""
    kv = KVCacheManager(5, 4, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=2)
    a = sched.add_request(Request("a", [3, 3, 3, 0, 0], 10))
    b = sched.add_request(Request("b", [3, 3, 3, 0, 0], 11))
    fits_but_waits = 0
    for _ in range(200):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        assert not out.admitted or not out.preempted
        if out.preempted and out.num_batched_tokens < sched.max_num_batched_tokens:
            head = sched.waiting[0]
            copy.deepcopy(kv).allocate(head.request_id, head.num_tokens, head.all_tokens)
            fits_but_waits += 1  # the head fits: only the rule held it back
        sampled = {
            c.request_id: fake_next(sched.requests[c.request_id].all_tokens)
            for c in out.chunks
            if c.sample
        }
        sched.update(out, sampled)
    assert fits_but_waits >= 1 and sched.num_preemptions >= 1
    assert a.output == expected_output(a.prompt, 10) and b.output == expected_output(b.prompt, 11)


def test_preemption_takes_the_newest_request_and_requeues_it_first():
    """vLLM preempts the last running request (``self.running.pop()``) and puts it back at the
    head of the waiting queue (``self.waiting.prepend_request``): ``scheduler.py``, v0.34.0."""
    kv = KVCacheManager(7, 4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=3)
    for i in range(3):
        sched.add_request(Request(str(i), [i + 1] * 7, 12))
    sched.add_request(Request("late", [9] * 3, 2))
    for _ in range(100):
        running = [r.request_id for r in sched.running]
        out = sched.schedule()
        if out.preempted:
            break
        sampled = {
            c.request_id: fake_next(sched.requests[c.request_id].all_tokens)
            for c in out.chunks
            if c.sample
        }
        sched.update(out, sampled)
    assert out.preempted == (running[-1],)
    assert [r.request_id for r in sched.waiting][:2] == [running[-1], "late"]
