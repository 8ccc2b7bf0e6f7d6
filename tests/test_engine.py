"""The serving engine: batched outputs == each request alone, prefix-cache hit == miss, preempted-and-resumed ==
undisturbed, chunked prefill keeps decodes running, static vs continuous scheduling, exact metrics on a fake
clock, rejection at admission. Tiny random models except the last test."""
import numpy as np
import pytest

from tinyllm.engine import Engine
from tinyllm.scheduler import pool_name
from tinyllm.sampling import SamplingParams, sample
from test_model import random_model


@pytest.fixture(scope="module")
def model():
    return random_model("llama", context_length=128)


def reference(model, prompt, max_tokens, params=SamplingParams()):
    """The request alone, on a contiguous cache: what every engine configuration must reproduce."""
    cache, rng, out = model.new_cache(128), params.make_rng(), []
    logits = model.prefill(prompt, cache)
    for _ in range(max_tokens):
        out.append(sample(logits, params, rng, list(prompt) + out))
        logits = model.decode_step(out[-1], cache)
    return out


def workload(n=16, seed=0, max_prompt=40, max_out=30):
    rng = np.random.default_rng(seed)
    return [(list(rng.integers(0, 50, int(rng.integers(1, max_prompt)))), int(rng.integers(1, max_out)))
            for _ in range(n)]


def run(engine, reqs, **kw):
    for i, (p, n) in enumerate(reqs):
        engine.add_request(str(i), p, max_tokens=n, **kw)
    events = list(engine.run())
    engine.pool.allocator.check_invariants()
    assert engine.pool.allocator.num_used == 0                    # nothing leaks: every block back in the pool
    return events


class FakeClock:
    """Time advances by 1 per forward pass, so every step lasts exactly 1 'second'."""
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def timed_engine(model, **kw):
    clock = FakeClock()
    engine = Engine(model, clock=clock, **kw)
    forward = model.forward_batch

    def ticking(*a, **k):
        clock.t += 1.0
        return forward(*a, **k)
    engine.model = type("Timed", (), {"forward_batch": staticmethod(ticking), "config": model.config,
                                      "tokenizer": None})()
    return engine, clock


def test_alone_equals_inside_a_batch_of_16_mixed_lengths(model):
    reqs = workload()
    engine = Engine(model, num_blocks=200, block_size=4, max_num_seqs=16, max_num_batched_tokens=1024)
    events = run(engine, reqs)
    for i, (p, n) in enumerate(reqs):
        assert engine.requests[str(i)].output_ids == reference(model, p, n), i
        assert engine.requests[str(i)].finish_reason == "length"
    streamed = {}                                                  # events concatenate to the outputs
    for e in events:
        streamed.setdefault(e.request_id, []).append(e.token_id)
    assert all(streamed[str(i)] == engine.requests[str(i)].output_ids for i in range(len(reqs)))
    assert max(len(s.slots) for s in engine.steps) == 16          # really batched


def test_seeded_sampling_alone_equals_batched(model):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    reqs = workload(6, seed=3)
    engine = Engine(model, num_blocks=100, block_size=4)
    run(engine, reqs, params=params)
    for i, (p, n) in enumerate(reqs):
        assert engine.requests[str(i)].output_ids == reference(model, p, n, params)


def test_prefix_cache_hit_equals_miss(model):
    shared = list(np.random.default_rng(5).integers(0, 50, 21))
    a, b = shared + [1, 2], shared + [3]
    engine = Engine(model, num_blocks=60, block_size=4)
    engine.add_request("a", a, max_tokens=10)
    list(engine.run())
    engine.add_request("b", b, max_tokens=10)
    list(engine.run())
    assert engine.requests["b"].metrics.cached_tokens == 20        # 5 full blocks of the shared 21 tokens
    assert engine.requests["b"].output_ids == reference(model, b, 10)
    assert engine.metrics().prefix_hit_rate == pytest.approx(20 / (len(a) + len(b)))
    cold = Engine(model, num_blocks=60, block_size=4, prefix_caching=False)
    cold.add_request("b", b, max_tokens=10)
    list(cold.run())
    assert cold.requests["b"].metrics.cached_tokens == 0
    assert cold.requests["b"].output_ids == engine.requests["b"].output_ids


def test_full_prompt_hit_still_produces_the_first_token(model):
    prompt = list(range(12))                                        # exactly 3 blocks of 4
    engine = Engine(model, num_blocks=30, block_size=4)
    engine.add_request("a", prompt, max_tokens=6)
    list(engine.run())
    engine.add_request("b", prompt, max_tokens=6)
    list(engine.run())
    assert engine.requests["b"].metrics.cached_tokens == 11
    assert engine.requests["b"].output_ids == engine.requests["a"].output_ids == reference(model, prompt, 6)


def test_preempted_and_resumed_equals_undisturbed(model):
    reqs = workload(8, seed=1, max_prompt=20, max_out=40)
    engine = Engine(model, num_blocks=24, block_size=4, max_num_seqs=8)   # too small for all: preemption
    run(engine, reqs)
    assert engine.metrics().preemptions > 0
    for i, (p, n) in enumerate(reqs):
        assert engine.requests[str(i)].output_ids == reference(model, p, n), i


def test_preemption_of_requests_sharing_a_prefix(model):
    shared = list(np.random.default_rng(9).integers(0, 50, 16))
    reqs = [(shared + [i], 30) for i in range(6)]
    engine = Engine(model, num_blocks=20, block_size=4, max_num_seqs=6)
    run(engine, reqs)
    m = engine.metrics()
    assert m.preemptions > 0 and m.prefix_hit_rate > 0
    for i, (p, n) in enumerate(reqs):
        assert engine.requests[str(i)].output_ids == reference(model, p, n), i


def test_chunked_prefill_keeps_running_decodes_going(model):
    engine, clock = timed_engine(model, num_blocks=100, block_size=4, max_num_batched_tokens=8)
    engine.add_request("short", [1, 2, 3], max_tokens=20)
    engine.step()                                                   # short is now decoding
    long_prompt = list(np.random.default_rng(2).integers(0, 50, 60))
    engine.add_request("long", long_prompt, max_tokens=3)
    while engine.requests["long"].metrics.first_token is None:
        events = engine.step()
        assert [e.request_id for e in events][:1] == ["short"]      # a decode token every step
        assert engine.steps[-1].tokens <= 8                         # the budget holds
    assert engine.requests["long"].metrics.ttft >= 60 / 7           # its prompt went in chunks of <= 7
    list(engine.run())
    assert engine.requests["long"].output_ids == reference(model, long_prompt, 3)


def test_long_prefill_cap_bounds_each_step(model):
    """long_prefill_tokens: a long prompt enters a few tokens per step even when the step budget is large."""
    engine = Engine(model, num_blocks=100, block_size=4, long_prefill_tokens=8)
    engine.add_request("short", [1, 2, 3], max_tokens=20)
    engine.step()
    long_prompt = list(np.random.default_rng(3).integers(0, 50, 60))
    engine.add_request("long", long_prompt, max_tokens=3)
    while engine.requests["long"].metrics.first_token is None:
        engine.step()
        assert engine.steps[-1].tokens <= 8 + 1                    # one chunk of the prompt + short's decode
    assert len(engine.steps) >= 1 + 60 // 8
    list(engine.run())
    assert engine.requests["long"].output_ids == reference(model, long_prompt, 3)
    with pytest.raises(ValueError, match="long_prefill_tokens"):
        Engine(model, num_blocks=10, long_prefill_tokens=0)


@pytest.mark.parametrize("watermark, b_admitted", [(0.3, False), (0.0, True)])
def test_watermark_keeps_blocks_free_for_running_requests(model, watermark, b_admitted):
    """10 blocks of 4, watermark 30% = 3 blocks: with A holding 2, admitting B (6 blocks) would leave 2 free."""
    engine = Engine(model, num_blocks=10, block_size=4, watermark=watermark)
    prompts = {"A": list(range(1, 9)), "B": list(range(10, 34))}            # 2 and 6 blocks
    for rid, p in prompts.items():
        engine.add_request(rid, p, max_tokens=4)
    engine.step()
    assert engine.requests["A"].status == "running"
    assert (engine.requests["B"].status == "running") is b_admitted
    list(engine.run())                                             # B runs once A is done: nothing is lost
    engine.pool.allocator.check_invariants()
    assert engine.pool.allocator.num_used == 0
    for rid, p in prompts.items():
        assert engine.requests[rid].output_ids == reference(model, p, 4)
    with pytest.raises(ValueError, match="watermark"):
        Engine(model, num_blocks=10, watermark=1.5)


def test_metrics_on_a_fake_clock(model):
    engine, clock = timed_engine(model, num_blocks=10, block_size=4)
    engine.add_request("a", [1, 2, 3, 4, 5], max_tokens=4)
    list(engine.run())
    m = engine.requests["a"].metrics
    assert (m.queue_time, m.ttft, m.itl, m.tpot, m.e2e) == (0.0, 1.0, [1.0, 1.0, 1.0], 1.0, 4.0)
    agg = engine.metrics()
    assert agg.throughput == pytest.approx(1.0) and agg.itl_p99 == 1.0 and agg.generated_tokens == 4
    assert agg.kv_bytes_per_token == model.config.kv_bytes_per_token()


def test_static_runs_a_batch_to_its_longest_member_continuous_refills(model):
    """The seed's picture, small: 2 slots, one long request and several short ones."""
    reqs = [([1, 2, 3], 24)] + [([4 + i, 5], 3) for i in range(6)]
    results = {}
    for policy in ("static", "continuous"):
        engine, clock = timed_engine(model, num_blocks=50, block_size=4, max_num_seqs=2, policy=policy)
        run(engine, reqs)
        results[policy] = engine.metrics()
        if policy == "static":                                     # nobody joins while a batch is running
            started = {}
            for k, s in enumerate(engine.steps):
                for rid in s.slots.values():
                    started.setdefault(rid, k)
            assert started["2"] >= 24                              # waited for the long request to finish
    assert results["continuous"].duration < results["static"].duration
    assert results["continuous"].e2e_mean < results["static"].e2e_mean
    assert results["continuous"].throughput > results["static"].throughput


def test_request_that_can_never_fit_is_rejected_at_admission(model):
    engine = Engine(model, num_blocks=4, block_size=4)              # 16 positions in the whole pool
    with pytest.raises(ValueError, match="can never run"):
        engine.add_request("big", list(range(10)), max_tokens=8)   # needs 17
    assert not engine.has_unfinished() and not engine.requests
    engine.add_request("ok", list(range(10)), max_tokens=7)        # needs exactly 16
    list(engine.run())
    assert len(engine.requests["ok"].output_ids) == 7


def test_abort_frees_blocks_and_bad_input(model):
    engine = Engine(model, num_blocks=20, block_size=4)
    engine.add_request("a", list(range(9)), max_tokens=30)
    engine.add_request("b", list(range(5)), max_tokens=30)
    engine.step()
    engine.abort("a")
    assert engine.requests["a"].finish_reason == "abort"
    list(engine.run())
    assert engine.pool.allocator.num_used == 0
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1], max_tokens=1)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("c", [999], max_tokens=1)
    with pytest.raises(ValueError, match="policy"):
        Engine(model, num_blocks=4, policy="fifo")


def test_real_model_engine_equals_generate(default_model):
    import tinyllm
    prompts = ["The capital of France is", "List three fruits:"]
    engine = Engine(default_model, kv_memory="64MiB")
    for i, p in enumerate(prompts):
        engine.add_request(str(i), default_model.tokenizer.encode(p), max_tokens=12, stop=["\n\n\n"])
    list(engine.run())
    for i, p in enumerate(prompts):
        ref = tinyllm.generate(default_model, p, max_new_tokens=12, stop=["\n\n\n"])
        assert engine.requests[str(i)].output_ids == ref.token_ids
        assert engine.requests[str(i)].text == ref.text


def test_static_admits_its_whole_batch_even_when_prompts_exceed_the_token_budget(model):
    engine = Engine(model, num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, policy="static")
    reqs = [(list(range(1, 13)), 5) for _ in range(6)]              # 4 x 12 prompt tokens > the 16-token budget
    for i, (p, n) in enumerate(reqs):
        engine.add_request(str(i), p, max_tokens=n)
    engine.step()
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 2
    list(engine.run())
    assert all(engine.requests[str(i)].output_ids == reference(model, p, n) for i, (p, n) in enumerate(reqs))


class LetterTokenizer:
    """Token i decodes to one letter; no end-of-sequence token (enough for the engine's text handling)."""
    eos_id, special_ids = None, []

    def stream_decoder(self):
        return type("Dec", (), {"feed": staticmethod(lambda i: chr(97 + i % 26)), "flush": staticmethod(lambda: "")})()


def test_stop_string_cuts_the_text_and_is_never_streamed():
    m = random_model("llama", context_length=128)
    m.tokenizer = LetterTokenizer()
    prompt = [3, 1, 4, 1, 5]
    letters = "".join(chr(97 + t % 26) for t in reference(m, prompt, 20))
    stop = letters[6:8]                                             # a stop string the output will meet
    engine = Engine(m, num_blocks=20, block_size=4)
    engine.add_request("a", prompt, max_tokens=20, stop=[stop])
    events = list(engine.run())
    req = engine.requests["a"]
    assert req.finish_reason == "stop_string" and req.text == letters[:letters.index(stop)]
    assert "".join(e.text for e in events) == req.text              # no piece of the stop string leaked out


def reference_rng(model, prompt, max_tokens, params, rng):
    cache, out = model.new_cache(128), []
    logits = model.prefill(prompt, cache)
    for _ in range(max_tokens):
        out.append(sample(logits, params, rng, list(prompt) + out))
        logits = model.decode_step(out[-1], cache)
    return out


def test_n_samples_fork_the_prompt_blocks_and_each_equals_its_seeded_reference(model):
    params = SamplingParams(temperature=1.0, seed=5)
    prompt = list(range(1, 11))                                      # 10 tokens: 2 full blocks of 4 + 2
    engine = Engine(model, num_blocks=40, block_size=4)
    engine.add_request("a", prompt, params, max_tokens=9, n=3)
    first = engine.step()                                          # the prompt, then 3 first tokens
    assert sorted(e.index for e in first) == [0, 1, 2] and {e.request_id for e in first} == {"a"}
    alloc = engine.pool.allocator
    assert alloc.num_used == 3                                     # the 3 prompt blocks, shared, not copied
    assert all(alloc.ref[b] == 3 for b in alloc.tables[pool_name("a")])
    events = first + list(engine.run())
    alloc.check_invariants()
    assert alloc.num_used == 0
    for i in range(3):
        rng = np.random.default_rng(5 if i == 0 else (5, i))
        got = [e.token_id for e in events if e.index == i]
        assert got == reference_rng(model, prompt, 9, params, rng), i
    assert len({tuple(e.token_id for e in events if e.index == i) for i in range(3)}) > 1   # really different
    assert engine.counters["prompt_tokens"] == 10 and engine.counters["generation_tokens"] == 27


def test_abort_of_a_request_ends_its_samples(model):
    engine = Engine(model, num_blocks=40, block_size=4)
    engine.add_request("a", list(range(1, 8)), SamplingParams(temperature=1.0), max_tokens=20, n=4)
    engine.step()
    engine.abort("a")
    assert not engine.has_unfinished() and engine.pool.allocator.num_used == 0
    assert {engine.requests[r].finish_reason for r in ("a", "a/1", "a/2", "a/3")} == {"abort"}


def test_logprobs_are_the_model_distribution(model):
    from tinyllm.sampling import log_softmax
    prompt = [3, 1, 4, 1, 5]
    engine = Engine(model, num_blocks=20, block_size=4)
    engine.add_request("a", prompt, max_tokens=4, logprobs=3)
    events = list(engine.run())
    out = [e.token_id for e in events]
    full = model.logits(prompt + out)                              # [T, V] the no-cache forward
    for k, e in enumerate(events):
        lp = log_softmax(full[len(prompt) - 1 + k])
        assert e.logprob == pytest.approx(lp[e.token_id], abs=1e-4)
        assert [t for t, _ in e.top_logprobs] == list(np.argsort(-lp)[:3])   # greedy: the first is the token
        assert e.top_logprobs[0][0] == e.token_id


def test_history_is_bounded_and_counters_cumulative(model):
    engine = Engine(model, num_blocks=40, block_size=4, history=3)
    reqs = workload(6, seed=1, max_prompt=10, max_out=5)
    for i, (p, n) in enumerate(reqs):
        engine.add_request(str(i), p, max_tokens=n, stop_token_ids=())
    list(engine.run())
    assert len(engine.requests) == 3 and len(engine.steps) == 3
    assert engine.counters["generation_tokens"] == sum(n for _, n in reqs)
    assert engine.counters["prompt_tokens"] == sum(len(p) for p, _ in reqs)
    assert engine.counters["finished_length"] == 6
    assert engine.metrics().requests == 3


def test_n_samples_survive_preemption(model):
    params = SamplingParams(temperature=1.0, seed=9)
    prompt = list(range(1, 11))
    engine = Engine(model, num_blocks=24, block_size=4, watermark=0.0)   # 4 x 13 blocks do not fit at once
    engine.add_request("a", prompt, params, max_tokens=40, n=4, stop_token_ids=())
    events = list(engine.run())
    assert engine.scheduler.num_preemptions > 0
    engine.pool.allocator.check_invariants()
    assert engine.pool.allocator.num_used == 0
    for i in range(4):
        rng = np.random.default_rng(9 if i == 0 else (9, i))
        assert [e.token_id for e in events if e.index == i] == reference_rng(model, prompt, 40, params, rng), i


def test_request_ids_are_validated_and_never_collide_with_pool_names(model):
    engine = Engine(model, num_blocks=32)
    for bad_id in (None, "", 7):
        with pytest.raises(ValueError, match="request id must be a non-empty string"):
            engine.add_request(bad_id, [1, 2, 3], max_tokens=2)
    other = engine.pool.new_sequence([1, 2])                       # the pool names it "seq0" itself
    engine.add_request("seq0", [1, 2, 3], max_tokens=3)
    events = list(engine.run())                                    # used to raise: 'seq0' already has blocks
    assert [e.finished for e in events].count(True) == 1 and len(events) == 3
    other.free()
    assert engine.pool.allocator.num_used == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(stop=[""]), "stop strings must be non-empty"),
    (dict(max_tokens=True), "invalid max_tokens"),
    (dict(max_tokens=2.0), "invalid max_tokens"),
    (dict(prompt_ids=[5.9]), "prompt_ids must be a list of integer token ids"),
    (dict(prompt_ids=42), "prompt_ids must be a list of integer token ids"),
    (dict(stop_token_ids=["a"]), "stop_token_ids must be a list of integer token ids"),
    (dict(params={"temperature": 1}), "params must be a SamplingParams"),
])
def test_bad_request_values_are_refused(model, kwargs, message):
    engine = Engine(model, num_blocks=32)
    args = dict(prompt_ids=[1, 2, 3], max_tokens=2) | kwargs
    with pytest.raises(ValueError, match=message):
        engine.add_request("a", **args)
    assert not engine.requests and not engine.has_unfinished()


def test_abort_of_an_unknown_id_is_a_clear_error(model):
    engine = Engine(model, num_blocks=32)
    with pytest.raises(ValueError, match="no request with id 'nope' to abort"):
        engine.abort("nope")
