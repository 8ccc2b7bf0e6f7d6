"""The calculators of tinyllm/capacity.py reproduce every worked figure of the seed (inference-fundamentals.txt)
from the seed's stated assumptions; tinyllm's own FLOP count is consistent with itself; the batching simulation
runs on the real Engine scheduler; scripts/capacity.py and scripts/tokens.py run as a user runs them.

The seed's assumptions: a 7B-parameter model with fp16 weights, 14 GB; a hypothetical accelerator of 200 TFLOP/s
and 2 TB/s; config A = 32 layers x 32 KV heads x head_dim 128, config B (70B-class, GQA) = 80 x 8 x 128, fp16 KV.
"""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyllm import capacity
from tinyllm.capacity import GiB, KiB, SimRequest, simulate_batching
from tinyllm.config import ModelConfig

REPO = Path(__file__).resolve().parent.parent
PARAMS, WEIGHTS, PEAK, BANDWIDTH = 7e9, 14e9, 200e12, 2e12
A = dict(layers=32, kv_heads=32, head_dim=128, bytes_per_value=2)      # 7B-class, full multi-head attention
B = dict(layers=80, kv_heads=8, head_dim=128, bytes_per_value=2)       # 70B-class, grouped-query attention
A_GQA = dict(A, kv_heads=8)                                            # config A with 8 KV heads (4x smaller KV)


# --- prefill vs decode, the roofline ------------------------------------------------------------------------------
def test_prefill_and_decode_flops_and_the_ridge():
    assert capacity.prefill_flops(params=PARAMS, tokens=2000) == pytest.approx(2.8e13)
    assert capacity.decode_flops(params=PARAMS) == pytest.approx(1.4e10)
    assert capacity.ridge_point(peak_flops=PEAK, bandwidth=BANDWIDTH) == pytest.approx(100)
    # FLOPs per byte of weights read: about 2,000 for that prefill, about 1 for a batch-1 decode step
    assert capacity.prefill_flops(params=PARAMS, tokens=2000) / WEIGHTS == pytest.approx(2000)
    assert capacity.decode_flops(params=PARAMS) / WEIGHTS == pytest.approx(1.0)


@pytest.mark.parametrize("context", [0, 1, 1000, 32768])
def test_batch1_decode_no_faster_than_7ms(context):
    kv = capacity.kv_bytes_per_token(**A)
    t = capacity.decode_step_time(weight_bytes=WEIGHTS, batch=1, context=context, kv_bytes_per_token=kv,
                                  bandwidth=BANDWIDTH, params=PARAMS, peak_flops=PEAK)
    assert t >= 7e-3
    if context == 0:
        assert t == pytest.approx(7e-3)                   # 14 GB / 2 TB/s: the weights alone


@pytest.mark.parametrize("batch, itl_ms, total_tok_s", [(1, 7.3, 138), (8, 9.1, 879), (32, 15.4, 2079),
                                                        (64, 23.8, 2692)])
def test_the_batch_table_at_1000_tokens(batch, itl_ms, total_tok_s):
    """Config A's KV (fp16) at 1,000 tokens of context per sequence: every step reads the 14 GB of weights once
    and each sequence's 1,000 x 524,288 B of cache; still memory-bound at batch 64."""
    kw = dict(weight_bytes=WEIGHTS, batch=batch, context=1000, kv_bytes_per_token=capacity.kv_bytes_per_token(**A))
    t = capacity.decode_step_time(**kw, bandwidth=BANDWIDTH, params=PARAMS, peak_flops=PEAK)
    assert round(t * 1e3, 1) == itl_ms
    assert round(batch / t) == total_tok_s
    assert t == capacity.decode_step_bytes(**kw) / BANDWIDTH     # the bytes, not the FLOPs, set the time
    if batch == 1:
        assert round(t * 1e3, 2) == 7.26


# --- the KV cache -------------------------------------------------------------------------------------------------
def test_kv_per_token_and_per_sequence():
    assert capacity.kv_bytes_per_token(**A) == 524_288 == 512 * KiB
    assert capacity.kv_bytes_per_sequence(**A, context=4096) / GiB == 2.0
    assert capacity.kv_bytes_per_sequence(**A, context=32768) / GiB == 16.0
    assert capacity.kv_bytes_per_token(**B) == 327_680 == 320 * KiB
    assert capacity.kv_bytes_per_sequence(**B, context=4096) / GiB == 1.25
    assert capacity.kv_bytes_per_sequence(**B, context=32768) / GiB == 10.0
    # an int8 cache halves both
    assert capacity.kv_bytes_per_token(**dict(A, bytes_per_value=1)) == 256 * KiB
    assert capacity.kv_bytes_per_token(**dict(B, bytes_per_value=1)) == 160 * KiB
    assert capacity.kv_bytes_per_sequence(**dict(A, bytes_per_value=1), context=4096) / GiB == 1.0


def test_a_tinyllm_config_gives_the_same_kv_bytes_as_its_shape():
    c = ModelConfig(arch="llama", vocab_size=100, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                    context_length=8192)
    shape = capacity.ModelShape.from_config(c)
    assert shape.kv_bytes_per_token == c.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4
    for kv_dtype in ("float32", "float16", "int8"):
        assert capacity.ModelShape.from_config(c, kv_dtype=kv_dtype).kv_bytes_per_token == c.kv_bytes_per_token(kv_dtype)


def test_sequences_that_fit_with_each_kv_dtype():
    """1 GiB, 90% usable, weights 0.1 GiB: 0.8 GiB of KV; SmolLM2 at 2,048 tokens holds 90 / 45 / 12 KiB per
    token (float32 / float16 / int8 with its scales)."""
    c = ModelConfig(arch="llama", vocab_size=100, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536,
                    context_length=8192)
    shape = capacity.ModelShape.from_config(c, weight_bytes=0.1 * GiB)
    fits = capacity.sequences_by_kv_dtype(shape, memory_bytes=GiB, usable_fraction=0.9, context=2048)
    free = 0.8 * GiB
    for kv_dtype, per_token in (("float32", 46_080), ("float16", 23_040), ("int8", 12_240)):
        assert fits[kv_dtype]["kv_bytes_per_token"] == per_token
        assert fits[kv_dtype]["sequences"] == int(free // (2048 * per_token))
    assert fits["float16"]["vs_float32"] == fits["float16"]["sequences"] / fits["float32"]["sequences"] >= 2


def test_concurrent_sequences_on_an_80_gib_device():
    """The seed's unit convention for concurrency: everything binary. The 80 GiB device, the 14 "GB" of weights
    and the KV sizes are all GiB: free = 80 x 0.9 - 14 = 58 GiB. That is the reading under which 29, 118 and 475
    come out (the same weights counted as 14e9 bytes give 120 and 483 at 1,000 tokens); the roofline figures
    above, in contrast, use 14e9 bytes (14 GB / 2 TB/s = 7 ms)."""
    def fits(shape, context, weights):
        kv = capacity.kv_bytes_per_token(**shape)
        return capacity.max_concurrent_sequences(memory_bytes=80 * GiB, usable_fraction=0.9, weight_bytes=weights,
                                                 context=context, kv_bytes_per_token=kv)
    assert fits(A, 4096, 14 * GiB) == 29
    assert fits(A, 1000, 14 * GiB) == 118                # full multi-head attention
    assert fits(A_GQA, 1000, 14 * GiB) == 475            # 8 KV heads: 4x the sequences (nearly)
    assert (fits(A, 1000, 14e9), fits(A_GQA, 1000, 14e9)) == (120, 483)
    assert fits(A, 4096, 80 * GiB) == 0                  # the weights fill the usable memory


def test_a_batch_that_does_not_fit_says_by_how_much():
    """The issue's case: 7B (config A, 14 GB of fp16 weights) at context 4,096 and batch 64 needs the weights plus
    64 x 2 GiB of KV = 141 GiB on an 80 GiB device of which 90% is usable: 69 GiB too much."""
    kv = capacity.kv_bytes_per_token(**A)
    f = capacity.fit(memory_bytes=80 * GiB, usable_fraction=0.9, weight_bytes=WEIGHTS, batch=64, context=4096,
                     kv_bytes_per_token=kv)
    needed = WEIGHTS + 64 * 4096 * 2 * 32 * 32 * 128 * 2                  # the weights + K and V of every token
    assert not f.fits and f.needed == needed and round(needed / GiB) == 141
    assert f.over == needed - 0.9 * 80 * GiB and round(f.over / GiB, 1) == 69.0
    assert f.max_batch == 29                                              # the seed's 29 sequences of 4,096
    assert f.max_context == int((0.9 * 80 * GiB - WEIGHTS) // (64 * kv)) == 1886
    assert f.verdict() == ("does not fit: needs 141.0 GiB, 69.0 GiB more than the 72.0 GiB usable (80.0 GiB x 0.9); "
                           "at context 4,096 at most 29 sequences fit, at batch 64 at most 1,886 tokens each")
    # the largest batch it names fits, one more does not; so does the largest context it names
    def fit(batch=64, context=4096):
        return capacity.fit(memory_bytes=80 * GiB, usable_fraction=0.9, weight_bytes=WEIGHTS, batch=batch,
                            context=context, kv_bytes_per_token=kv)
    assert fit(batch=29).fits and not fit(batch=30).fits
    assert fit(context=1886).fits and not fit(context=1887).fits
    ok = fit(batch=1)
    assert ok.verdict() == f"fits: needs {ok.needed / GiB:,.1f} GiB of 72.0 GiB usable (80.0 GiB x 0.9), " \
                           f"{(0.9 * 80 * GiB - ok.needed) / GiB:,.1f} GiB to spare"
    # 70B's 140 GB of weights alone exceed 72 GiB: nothing fits, whatever the batch
    big = capacity.fit(memory_bytes=80 * GiB, usable_fraction=0.9, weight_bytes=140e9, batch=1, context=4096,
                       kv_bytes_per_token=capacity.kv_bytes_per_token(**B))
    assert not big.fits and big.max_batch == 0 and big.max_context == 0
    assert big.verdict().startswith("does not fit: the weights alone (130.4 GiB) exceed the 72.0 GiB usable")


def test_bad_capacity_inputs_are_refused():
    with pytest.raises(ValueError, match="usable_fraction"):
        capacity.max_concurrent_sequences(memory_bytes=1e9, usable_fraction=0, weight_bytes=0, context=1,
                                          kv_bytes_per_token=1)
    with pytest.raises(ValueError, match="output_tokens"):
        capacity.request_latency(prompt_tokens=1, output_tokens=0, weight_bytes=1, params=1, kv_bytes_per_token=1,
                                 bandwidth=1, peak_flops=1)


# --- latency and spend --------------------------------------------------------------------------------------------
def latency(n_in, n_out, **kw):
    return capacity.request_latency(prompt_tokens=n_in, output_tokens=n_out, weight_bytes=WEIGHTS, params=PARAMS,
                                    kv_bytes_per_token=capacity.kv_bytes_per_token(**A), bandwidth=BANDWIDTH,
                                    peak_flops=PEAK, **kw)


def test_long_output_costs_more_than_long_prompt():
    """2,000 in / 500 out vs 500 in / 2,000 out: the prefill is compute-bound (0.14 s for 2,000 tokens), each
    decode step memory-bound; the seed holds each step's cache read at the prompt's length."""
    prompt_heavy, output_heavy = latency(2000, 500), latency(500, 2000)
    assert prompt_heavy.ttft == pytest.approx(0.14)
    assert round(prompt_heavy.total, 1) == 3.9
    assert round(output_heavy.total, 1) == 14.3
    assert round(output_heavy.total / prompt_heavy.total, 1) == 3.7
    assert output_heavy.total == pytest.approx(output_heavy.ttft + 1999 * output_heavy.itl)


def test_a_growing_cache_makes_each_step_slower():
    fixed, growing = latency(500, 2000), latency(500, 2000, growing_context=True)
    assert growing.ttft == fixed.ttft and growing.total > fixed.total
    assert growing.itl == pytest.approx(latency(500 + 1000, 2, batch=1).itl)   # the mean step: at the mean context


def test_spend_of_a_million_requests_a_day():
    s = capacity.token_spend(requests_per_day=1e6, input_tokens=3000, output_tokens=500, price_in_per_million=1,
                             price_out_per_million=4)
    assert (s.input_per_day, s.output_per_day, s.total_per_day) == pytest.approx((3000, 2000, 5000))
    assert round(s.output_share_of_spend, 2) == 0.40 and round(s.output_share_of_tokens, 2) == 0.14


# --- tinyllm's own forward, counted ------------------------------------------------------------------------------
def test_forward_flops_is_consistent_with_itself():
    c = ModelConfig(arch="llama", vocab_size=1000, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96,
                    context_length=512)
    head = 2 * c.dim * c.vocab_size
    for T in (1, 7, 100):
        # prefill T then decode one == prefill T + 1, except that the split run computes one more head row
        assert capacity.forward_flops(c, T) + capacity.forward_flops(c, 1, past=T) == \
            capacity.forward_flops(c, T + 1) + head
    # the matmul weights are every parameter but the embedding and the norms
    assert c.n_params - capacity.matmul_params(c) == c.vocab_size * c.dim + 2 * c.n_layers * c.dim + c.dim


# --- batching on the real scheduler ------------------------------------------------------------------------------
SEED_PICTURE = [SimRequest(name, n) for name, n in zip("ABCDEFG", [10, 4, 6, 24, 14, 20, 18])]


def test_static_waits_for_the_longest_continuous_refills(monkeypatch):
    """The seed's picture: A, B, C short, D long, E, F, G waiting, 4 slots, one-token prompts (so each request
    takes exactly its output length in steps). Static runs A-D to D's end (step 24), then E-G from step 25;
    continuous puts E into B's slot at step 5, F into C's at 7, G into A's at 11."""
    from tinyllm import engine as engine_module
    calls = []
    real = engine_module.Scheduler.schedule
    monkeypatch.setattr(engine_module.Scheduler, "schedule", lambda self, now: calls.append(now) or real(self, now))

    static = simulate_batching(SEED_PICTURE, slots=4, policy="static")
    assert static.rows == ["A" * 10 + "." * 14 + "E" * 14 + "." * 6,
                           "B" * 4 + "." * 20 + "F" * 20,
                           "C" * 6 + "." * 18 + "G" * 18 + "." * 2,
                           "D" * 24 + "." * 20]
    assert static.finished == dict(A=10, B=4, C=6, D=24, E=38, F=44, G=42)
    assert len(calls) == 44 == len(static.engine.steps)            # every step was the Engine's scheduler's

    continuous = simulate_batching(SEED_PICTURE, slots=4, policy="continuous")
    assert continuous.rows == ["A" * 10 + "G" * 18,
                               "B" * 4 + "E" * 14 + "." * 10,
                               "C" * 6 + "F" * 20 + "." * 2,
                               "D" * 24 + "." * 4]
    assert continuous.finished == dict(A=10, B=4, C=6, D=24, E=18, F=26, G=28)
    assert len(calls) == 44 + 28
    assert (static.engine.scheduler.policy, continuous.engine.scheduler.policy) == ("static", "continuous")
    assert continuous.engine.metrics().generated_tokens == sum(r.output_tokens for r in SEED_PICTURE)
    assert "all done at step 28" in continuous.render()


def test_long_prompts_are_chunked_and_late_arrivals_wait():
    reqs = [SimRequest("A", 3, prompt_tokens=40), SimRequest("B", 2, arrival=1), SimRequest("C", 1, arrival=9)]
    run = simulate_batching(reqs, slots=2, policy="continuous", max_num_batched_tokens=16)
    # A's 40-token prompt in chunks of 16, 16, 8 (its first token in the third step); B arrives after the first
    # step but A's second chunk takes that whole step's budget, so B starts beside A's last 8 prompt tokens; then
    # the slots idle until C arrives
    assert run.rows == ["aaAAA....C", "..BB......"]
    assert run.finished == dict(A=5, B=4, C=10) and run.latency == dict(A=5, B=3, C=1)
    assert [s.tokens for s in run.engine.steps] == [16, 16, 9, 2, 1, 1]


def test_bad_simulation_input():
    with pytest.raises(ValueError, match="distinct single characters"):
        simulate_batching([SimRequest("A", 1), SimRequest("A", 2)], slots=1, policy="static")
    with pytest.raises(ValueError, match="at least one"):
        simulate_batching([], slots=1, policy="static")
    with pytest.raises(ValueError, match="policy"):
        simulate_batching([SimRequest("A", 1)], slots=1, policy="fifo")


# --- the scripts --------------------------------------------------------------------------------------------------
def script(name, *args):
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True,
                          timeout=300)


def test_capacity_cli_prints_the_seed_figures():
    r = script("capacity.py", "step", "--preset", "7b")
    assert r.returncode == 0, r.stderr
    assert "7.26" in r.stdout and "2,692" in r.stdout
    r = script("capacity.py", "concurrency", "--preset", "7b", "--weights", "14GiB", "--kv-heads", "8",
               "--context", "1000")
    assert r.returncode == 0 and "475 sequences" in r.stdout, r.stderr
    assert "float32 237, float16 475 (2.00x), int8 894 (3.77x)" in r.stdout       # the 7b preset stores fp16
    r = script("capacity.py", "batching", "--slots", "4", "--requests", "10", "4", "6", "24", "14", "20", "18")
    assert r.returncode == 0 and "everything done at step 28 vs 44" in r.stdout, r.stderr
    assert "compiling" not in r.stderr                                   # it runs no model: nothing to compile
    code = ("import runpy, sys; sys.argv = ['capacity.py', 'batching']\n"
            "try: runpy.run_path(sys.argv[0].join(['scripts/', '']), run_name='__main__')\n"
            "except SystemExit: pass\n"
            "assert 'numba' not in sys.modules, 'the batching simulation imported numba'")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args, message", [
    (["concurrency", "--memory", "80x"], "cannot read '80x'"),
    (["batching", "--requests", "0"], "request '0'"),
    (["kv", "--layers", "-1"], "positive integer"),
])
def test_capacity_cli_bad_input_one_line(args, message):
    r = script("capacity.py", *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_tokens_script_matches_the_tokenizer(default_model_path):
    from tinyllm.gguf import GGUFFile
    from tinyllm.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf_metadata(GGUFFile(default_model_path).metadata)
    text = "The capital of France is Paris"
    r = script("tokens.py", "--text", text, "--json", "--model", str(default_model_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ids"] == tok.encode(text) and tok.decode(out["ids"]) == text
    assert "".join(out["pieces"]).replace("␣", " ") == text
    assert out["characters_per_token"] == pytest.approx(len(text) / len(out["ids"]))
    variants = {v["text"]: v["ids"] for v in out["variants"]}
    assert variants["Paris"] == tok.encode("Paris") != variants[" Paris"] == tok.encode(" Paris")
    table = script("tokens.py", "--text", text, "--model", str(default_model_path))
    assert table.returncode == 0 and "characters per token" in table.stdout and "␣Paris" in table.stdout


def test_the_documented_example_is_the_real_output():
    """docs/calculators.md shows the 7b step table: exactly what the script prints, numbers included."""
    page = (REPO / "docs" / "calculators.md").read_text()
    command = "python scripts/capacity.py step --preset 7b\n```\n\n```text\n"
    shown = page[page.index(command) + len(command):]
    shown = shown[:shown.index("```")]
    r = script("capacity.py", "step", "--preset", "7b")
    assert r.returncode == 0 and r.stdout == shown, r.stdout


# --- this machine's roofs, cached -----------------------------------------------------------------------------------
def test_the_read_kernel_sums_rows_as_numpy_does():
    from tinyllm.roofs import row_sums
    a = np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)   # [rows, 1024]
    out = np.empty(64, dtype=np.float32)
    row_sums(a, out)
    np.testing.assert_allclose(out, a.sum(axis=1), rtol=1e-4, atol=1e-3)


def test_calibration_cache_round_trip_and_refusals(tmp_path, monkeypatch):
    from tinyllm import roofs
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert roofs.calibration_file() == tmp_path / "tinyllm" / "calibration.json"
    assert roofs.load_calibration() is None                                       # never measured
    mine = roofs.MachineRoofs(bandwidth=12.5e9, peak_flops=90e9, memory=8 * GiB, threads=2,
                              machine=roofs.this_machine(), measured="2026-12-04T07:00:00Z", source="a test")
    path = roofs.save_calibration(mine)
    assert path == roofs.calibration_file() and roofs.load_calibration() == mine
    roofs.save_calibration(dataclasses.replace(mine, machine="another host / x86_64 / 64 cores"))
    assert roofs.load_calibration() is None                                       # a copied cache is not used
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable calibration.*--calibrate"):
        roofs.load_calibration()
    path.write_text(json.dumps({"bandwidth": 1}))
    with pytest.raises(ValueError, match="not a calibration of this tinyllm"):
        roofs.load_calibration()
