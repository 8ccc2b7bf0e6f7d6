"""tinyllm on the real SmolLM2-135M-Instruct against an independent reference (HF tokenizers + transformers).

Two sources of reference values:
- committed fixtures (tests/fixtures/smollm2_reference.{npz,json}, written by
  scripts/make_reference_fixtures.py from scripts/reference.py): need only the default model, so these tests
  run everywhere the model can be fetched;
- live transformers (scripts/reference.py, computed inside the test): skipped with a reason when torch /
  transformers / gguf / accelerate are missing; CI installs them (the `reference` extra).

The error budget is 2e-3 absolute on fp32 logits. Greedy decoding must agree token for token, except that a
mismatch at a near-tie (reference top-1 minus top-2 logit < NEAR_TIE) ends the comparison instead of failing:
past that point the two runs legitimately continue from different contexts.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_JSON = FIXTURES / "smollm2_reference.json"
FIXTURE_NPZ = FIXTURES / "smollm2_reference.npz"

ATOL = 2e-3  # fp32 logits budget vs transformers
NEAR_TIE = 0.01  # = ATOL * 5: a step whose reference top-2 margin is below this may flip either way
LIVE_PROMPTS = ("chat_math_digits", "plain_long_story")  # full [T, V] comparison against live transformers
GENERATE_PROMPTS = ("chat_capital", "chat_math_digits")  # also checked through tinyllm.generate

# The JSON is small (tens of kB): read at import so prompts can parametrize the tests.
DOC = json.loads(FIXTURE_JSON.read_text(encoding="utf-8"))
PROMPTS = DOC["prompts"]
PROMPT_IDX = {p["name"]: k for k, p in enumerate(PROMPTS)}
by_prompt = pytest.mark.parametrize("k", range(len(PROMPTS)), ids=[p["name"] for p in PROMPTS])
# the default run's share of the cached greedy runs: a chat and the longest prompt; the others run with --full
DEFAULT_RUN_PROMPTS = ("chat_capital", "plain_long_story")
by_prompt_rest_slow = pytest.mark.parametrize(
    "k", [k if p["name"] in DEFAULT_RUN_PROMPTS else pytest.param(k, marks=pytest.mark.slow)
          for k, p in enumerate(PROMPTS)], ids=[p["name"] for p in PROMPTS])


@pytest.fixture(scope="module")
def ref():
    """The fixture arrays as a dict name -> np.ndarray (loaded without pickle)."""
    with np.load(FIXTURE_NPZ, allow_pickle=False) as z:
        return {name: z[name] for name in z.files}


def _worst(err: np.ndarray, what: str) -> str:
    """Text naming the largest entry of an error array and where it is."""
    where = np.unravel_index(int(np.argmax(err)), err.shape)
    return f"{what}: max abs error {err.max():.3e} at {tuple(int(i) for i in where)} (budget {ATOL:g})"


# ---------------------------------------------------------------------------------------------------------
# The fixture itself (fast, no model): well-formed and self-consistent, so the tests below compare real data.
# ---------------------------------------------------------------------------------------------------------


def test_fixture_is_plain_consistent_arrays(ref):
    """Numeric arrays only; shapes, ids, argmaxes and margins agree with each other and with the JSON."""
    V, C, K, N = DOC["vocab_size"], DOC["n_columns"], DOC["top_k"], DOC["n_generate"]
    cols = ref["columns"]  # [C]
    assert cols.shape == (C,) and np.all(np.diff(cols) > 0) and 0 <= cols[0] and cols[-1] < V
    assert len(PROMPTS) >= 5
    assert min(p["n_tokens"] for p in PROMPTS) <= 2 and max(p["n_tokens"] for p in PROMPTS) > 300
    for k, p in enumerate(PROMPTS):
        ids = ref[f"p{k}_ids"]  # [T]
        T = len(p["ids"])
        assert ids.tolist() == p["ids"] and T == p["n_tokens"]
        assert ref[f"p{k}_cols"].shape == (T, C) and ref[f"p{k}_last"].shape == (V,)
        assert ref[f"p{k}_top_ids"].shape == (T, K) and ref[f"p{k}_gen_cols"].shape == (N, C)
        assert ref[f"p{k}_gen_ids"].tolist() == p["greedy_ids"] and len(p["greedy_ids"]) == N
        last = ref[f"p{k}_last"]  # [V]
        # The stored pieces describe the same logits: last row vs columns, top-10 vs last row, gen row 0.
        np.testing.assert_array_equal(ref[f"p{k}_cols"][-1], last[cols])
        np.testing.assert_array_equal(ref[f"p{k}_top_vals"][-1], last[ref[f"p{k}_top_ids"][-1]])
        assert int(np.argmax(last)) == p["greedy_ids"][0]
        np.testing.assert_array_equal(ref[f"p{k}_gen_cols"][0], last[cols])
        top = ref[f"p{k}_gen_top_vals"]  # [N, K]
        assert np.all(np.diff(top, axis=1) <= 0)
        np.testing.assert_array_equal(ref[f"p{k}_gen_top_ids"][:, 0], ref[f"p{k}_gen_ids"])
        np.testing.assert_allclose(ref[f"p{k}_gen_margin"], top[:, 0] - top[:, 1], rtol=0, atol=1e-6)
    for name, arr in ref.items():
        assert arr.dtype in (np.int32, np.float32), (name, arr.dtype)
        if arr.dtype == np.float32:
            assert np.all(np.isfinite(arr)), name


# ---------------------------------------------------------------------------------------------------------
# tinyllm vs the committed fixtures.
# ---------------------------------------------------------------------------------------------------------


@by_prompt
def test_tokenizer_ids_match_reference(default_model, k):
    """tinyllm encodes each prompt text (and renders each chat) exactly as the reference tokenizer did."""
    p = PROMPTS[k]
    tok = default_model.tokenizer
    if p["kind"] == "chat":
        assert tok.apply_chat_template(p["messages"], add_generation_prompt=True) == p["text"]
        assert tok.encode_chat(p["messages"]) == p["ids"]          # contents as text: the same ids here
    assert tok.encode(p["text"]) == p["ids"]
    assert tok.decode(p["ids"]) == p["text"]


@pytest.mark.parametrize("case", DOC["tokenizer_cases"], ids=lambda c: repr(c["text"][:24]))
def test_tokenizer_edge_cases_match_reference(default_model, case):
    """Digits, whitespace runs, contractions, non-Latin scripts, emoji, code and special-token text."""
    tok = default_model.tokenizer
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.decode(case["ids"]) == case["text"]


@by_prompt
def test_logits_match_reference(default_model, ref, k):
    """No-cache forward: every position at the shared columns and at its own top-10 ids; full last row."""
    ids = PROMPTS[k]["ids"]
    logits = default_model.logits(ids)  # [T, V]
    assert logits.shape == (len(ids), DOC["vocab_size"]) and logits.dtype == np.float32
    err_cols = np.abs(logits[:, ref["columns"]] - ref[f"p{k}_cols"])  # [T, C]
    top = np.take_along_axis(logits, ref[f"p{k}_top_ids"].astype(np.int64), axis=1)  # [T, 10]
    err_top = np.abs(top - ref[f"p{k}_top_vals"])  # [T, 10]
    err_last = np.abs(logits[-1] - ref[f"p{k}_last"])  # [V]
    msg = "; ".join([_worst(err_cols, "columns [pos, col#]"), _worst(err_top, "top-10 [pos, rank]"),
                     _worst(err_last, "last row [id]")])
    assert max(err_cols.max(), err_top.max(), err_last.max()) < ATOL, msg


@pytest.fixture(scope="module")
def greedy_runs(default_model, ref):
    """tinyllm's cached greedy run per prompt, computed on first use: prefill, then decode_step with argmax.

    Stops right after the first token that differs from the reference (from there the contexts differ).
    Returns {k: dict(tokens=[...], last=[V] prefill row, cols=[n, C], top=[n, 10])}, where row n holds the
    logits that chose tokens[n], read at the fixture's shared columns and at the reference's top-10 ids.
    """
    runs: dict[int, dict] = {}

    def run(k: int) -> dict:
        if k in runs:
            return runs[k]
        ids, ref_gen = PROMPTS[k]["ids"], PROMPTS[k]["greedy_ids"]
        cache = default_model.new_cache(len(ids) + len(ref_gen))
        row = default_model.prefill(ids, cache)  # [V]
        out = {"tokens": [], "last": row.copy(), "cols": [], "top": []}
        for n in range(len(ref_gen)):
            tok = int(np.argmax(row))
            out["tokens"].append(tok)
            out["cols"].append(row[ref["columns"]])  # [C]
            out["top"].append(row[ref[f"p{k}_gen_top_ids"][n]])  # [10]
            if tok != ref_gen[n] or n == len(ref_gen) - 1:
                break
            row = default_model.decode_step(tok, cache)  # [V]
        runs[k] = out
        return out

    return run


def _compare_greedy(got: list[int], want: list[int], margin: np.ndarray) -> tuple[int, str]:
    """Compare a greedy continuation to the reference's under the near-tie rule.

    Returns (number of tokens that agreed, note). Fails on a mismatch where the reference's top-2 margin
    is at least NEAR_TIE; a mismatch at a near-tie ends the comparison.
    """
    for n, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert margin[n] < NEAR_TIE, (
                f"step {n}: tinyllm chose {a}, reference {b}, and the reference's top-2 margin "
                f"{margin[n]:.4f} is not a near-tie (< {NEAR_TIE}); agreed on {got[:n]}"
            )
            return n, f"stopped at near-tie step {n} (margin {margin[n]:.4f})"
    return min(len(got), len(want)), "all agreed"


def test_near_tie_rule():
    """The greedy comparison passes on agreement, stops at a near-tie mismatch, fails at any other."""
    margin = np.array([1.0, 0.005, 0.5], dtype=np.float32)  # [3]
    assert _compare_greedy([5, 6, 7], [5, 6, 7], margin) == (3, "all agreed")
    assert _compare_greedy([5, 9, 1], [5, 6, 7], margin)[0] == 1
    with pytest.raises(AssertionError, match="not a near-tie"):
        _compare_greedy([5, 6, 9], [5, 6, 7], margin)


@by_prompt_rest_slow
def test_greedy_continuation_matches_reference(greedy_runs, ref, k):
    """40 greedy tokens with tinyllm's KV cache equal the reference's (near-tie rule in the module doc)."""
    run = greedy_runs(k)
    want = PROMPTS[k]["greedy_ids"]
    agreed, note = _compare_greedy(run["tokens"], want, ref[f"p{k}_gen_margin"])
    if agreed < len(want):
        # Only a near-tie may end the run early; _compare_greedy has already checked that.
        assert len(run["tokens"]) == agreed + 1, note
    else:
        assert run["tokens"] == want


@by_prompt_rest_slow
def test_prefill_and_decode_logits_match_reference(greedy_runs, ref, k):
    """The cached path: prefill's last row (all V) and each decode step's logits while the tokens agree."""
    run = greedy_runs(k)
    err_last = np.abs(run["last"] - ref[f"p{k}_last"])  # [V]
    n = len(run["cols"])
    err_cols = np.abs(np.stack(run["cols"]) - ref[f"p{k}_gen_cols"][:n])  # [n, C]
    err_top = np.abs(np.stack(run["top"]) - ref[f"p{k}_gen_top_vals"][:n])  # [n, 10]
    msg = "; ".join([_worst(err_last, "prefill last row [id]"), _worst(err_cols, "decode columns [step, col#]"),
                     _worst(err_top, "decode top-10 [step, rank]")])
    assert max(err_last.max(), err_cols.max(), err_top.max()) < ATOL, msg


@pytest.mark.slow
@pytest.mark.parametrize("name", GENERATE_PROMPTS)
def test_generate_greedy_matches_reference(default_model, ref, name):
    """tinyllm.generate at temperature 0 yields the reference's greedy tokens (it may stop early at EOS)."""
    import tinyllm

    k = PROMPT_IDX[name]
    p = PROMPTS[k]
    res = tinyllm.generate(default_model, p["ids"], max_new_tokens=len(p["greedy_ids"]), temperature=0.0)
    got, want = list(res.token_ids), p["greedy_ids"]
    assert 1 <= len(got) <= len(want)
    agreed, _ = _compare_greedy(got, want, ref[f"p{k}_gen_margin"])
    if agreed == len(got) < len(want):
        # Stopped early with no divergence: the reference's next token must be an end token, which
        # generate() leaves out of token_ids (<|endoftext|> 0, <|im_end|> 2).
        assert res.finish_reason == "eos" and want[len(got)] in (0, 2), (res.finish_reason, want[len(got)])
    assert res.stats.prompt_tokens == len(p["ids"]) and res.stats.generated_tokens == len(got)


# ---------------------------------------------------------------------------------------------------------
# Live: transformers computed here (needs the `reference` extra), full [T, V] logits.
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """transformers' model on the default GGUF in fp32, loaded once per session (about 20 s)."""
    for mod in ("torch", "transformers", "gguf", "accelerate"):
        pytest.importorskip(mod, reason=f"live reference needs {mod} (pip install -e .[reference])")
    import reference

    return reference.reference_model(default_model_path, threads=2)


@pytest.mark.slow
@pytest.mark.reference
def test_reference_tokenizer_reproduces_fixture_ids(default_model_path):
    """The committed ids are what scripts/reference.py's tokenizer gives today (the fixture is not stale)."""
    for mod in ("tokenizers", "gguf"):
        pytest.importorskip(mod, reason=f"reference tokenizer needs {mod} (pip install -e .[reference])")
    import reference

    tok = reference.reference_tokenizer(default_model_path)
    assert tok.encode("a  2").ids == [81, 256, 34]  # the digit split transformers' GGUF tokenizer lacks
    for p in PROMPTS:
        if p["kind"] == "chat":
            assert reference.chatml(p["messages"]) == p["text"]
        assert tok.encode(p["text"]).ids == p["ids"], p["name"]
    for case in DOC["tokenizer_cases"]:
        assert tok.encode(case["text"]).ids == case["ids"], case["text"]


@pytest.fixture(scope="module")
def live_logits(hf_model):
    """Full reference logits [T, V] for LIVE_PROMPTS, computed once: {name: array}."""
    import reference

    return {name: reference.reference_logits(hf_model, PROMPTS[PROMPT_IDX[name]]["ids"]) for name in LIVE_PROMPTS}


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.parametrize("name", LIVE_PROMPTS)
def test_live_full_logits_match_transformers(default_model, live_logits, name):
    """Every position, every vocab entry: tinyllm fp32 vs transformers fp32 within ATOL."""
    want = live_logits[name]  # [T, V]
    got = default_model.logits(PROMPTS[PROMPT_IDX[name]]["ids"])  # [T, V]
    assert got.shape == want.shape
    err = np.abs(got - want)  # [T, V]
    assert err.max() < ATOL, _worst(err, f"{name} [pos, id]")


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.parametrize("name", LIVE_PROMPTS)
def test_live_reference_reproduces_fixture(ref, live_logits, name):
    """The committed logits are what transformers computes today (a quarter of the budget: library drift)."""
    k = PROMPT_IDX[name]
    want = live_logits[name]  # [T, V]
    err = np.abs(want[:, ref["columns"]] - ref[f"p{k}_cols"])  # [T, C]
    assert err.max() < ATOL / 4, _worst(err, f"{name} fixture vs live [pos, col#]")
