"""cpbook.engine.scheduler: continuous batching invariants, with a stand-in model (no tensors)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cpbook.engine.scheduler import Request, Scheduler
from cpbook.kv.manager import KVCacheManager

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


def run_to_completion(sched: Scheduler, max_steps: int = 2000) -> list:
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return steps
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
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
            if c.sample:
                sampled[c.request_id] = fake_next(req.all_tokens)
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        sched.update(out, sampled)
        check_blocks(sched.kv)
        steps.append(out)
    raise AssertionError("requests did not finish")


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
