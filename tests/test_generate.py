"""The generation loop: stop conditions, streaming, stats, and errors (tiny model), plus the real model."""
import numpy as np
import pytest

import tinyllm
from tinyllm.requests import StopStrings, end_token_ids

from tiny_gguf import tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    tiny_llama(p)
    return tinyllm.load(p)


def test_greedy_matches_argmax_of_full_forward(tiny):
    res = tinyllm.generate(tiny, "hello", max_new_tokens=6)
    ids = list(res.prompt_ids)
    for tok in res.token_ids:                         # each token is the argmax given everything before it
        assert tok == int(np.argmax(tiny.logits(ids)[-1]))
        ids.append(tok)


def test_stream_pieces_concatenate_to_text(tiny):
    s = tinyllm.stream(tiny, "hello", max_new_tokens=12, temperature=1.0, seed=3)
    pieces = list(s)
    assert "".join(pieces) == s.result.text
    assert s.result.text == tiny.tokenizer.decode(s.result.token_ids)


def test_max_new_tokens_and_stats(tiny):
    res = tinyllm.generate(tiny, "hello", max_new_tokens=5, temperature=1.0, seed=0)
    st = res.stats
    if res.finish_reason == "length":
        assert len(res.token_ids) == 5 and len(st.itl_s) == 4
    assert st.prompt_tokens == len(res.prompt_ids) and st.generated_tokens == len(res.token_ids)
    assert st.ttft_s >= st.prefill_s > 0 and st.prefill_tokens_per_s > 0
    assert st.kv_bytes_per_token == tiny.config.kv_bytes_per_token()


def test_seed_reproduces_and_differs(tiny):
    a = tinyllm.generate(tiny, "hello", max_new_tokens=10, temperature=1.5, seed=1).token_ids
    b = tinyllm.generate(tiny, "hello", max_new_tokens=10, temperature=1.5, seed=1).token_ids
    c = tinyllm.generate(tiny, "hello", max_new_tokens=10, temperature=1.5, seed=2).token_ids
    assert a == b and a != c


def test_context_end_stops_generation(tiny):
    prompt = list(range(3, 3 + 60))                  # 60 of the tiny model's 64 positions
    res = tinyllm.generate(tiny, prompt, max_new_tokens=50, temperature=1.0, seed=0)
    assert res.finish_reason in ("context", "eos")
    if res.finish_reason == "context":
        assert len(prompt) + len(res.token_ids) == 64 + 1   # the last sampled token needs no cache slot


def test_ignore_eos_generates_past_the_end_token(tiny):
    stopped = next((seed for seed in range(200) if tinyllm.generate(
        tiny, "hello", max_new_tokens=20, temperature=3.0, seed=seed).finish_reason == "eos"), None)
    assert stopped is not None, "no seed met the end token: raise the temperature"
    short = tinyllm.generate(tiny, "hello", max_new_tokens=20, temperature=3.0, seed=stopped)
    full = tinyllm.generate(tiny, "hello", max_new_tokens=20, temperature=3.0, seed=stopped, ignore_eos=True)
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    n = len(short.token_ids)
    assert full.token_ids[:n] == short.token_ids                   # the same draws, and then the end token
    assert full.token_ids[n] in end_token_ids(tiny.tokenizer)


def test_prompt_errors(tiny):
    with pytest.raises(ValueError, match="prompt has 64 tokens but the model's context is 64"):
        tinyllm.generate(tiny, list(range(3, 67)), max_new_tokens=1)
    with pytest.raises(ValueError, match="empty"):
        tinyllm.generate(tiny, "", max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tinyllm.generate(tiny, "hello", max_new_tokens=0)
    with pytest.raises(ValueError, match="invalid top_p"):
        tinyllm.generate(tiny, "hello", top_p=2.0)
    with pytest.raises(ValueError, match="UTF-8"):
        tinyllm.generate(tiny, "bad \udcff bytes", max_new_tokens=1)


def test_stop_strings_cut_and_hold_back():
    assert StopStrings(["near"]).safe_length("the end is ne") == len("the end is ne") - 2
    assert StopStrings(["xyz"]).safe_length("abc") == 3
    assert StopStrings(["b", "ab"]).find("xxab") == 2
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings([""])
    assert StopStrings(["<|im_end|>", "|"]).safe_length("a <|im") == 2   # "<|im" could still become "<|im_end|>"


def test_prompt_that_cannot_fit_is_refused_before_encoding(tiny, monkeypatch):
    longest = tiny.tokenizer.max_token_bytes                     # 13: "<|endoftext|>"
    monkeypatch.setattr(tiny.tokenizer, "_encode_word", lambda w: pytest.fail("encoded a prompt that cannot fit"))
    text = "x" * (64 * longest)                                 # at least 64 tokens whatever the merges
    for prompt, chat in [(text, False), (text, True), ([{"role": "user", "content": text}], False)]:
        with pytest.raises(ValueError, match=f"at least 64 tokens .* context is 64"):
            tinyllm.generate(tiny, prompt, chat=chat, max_new_tokens=1)


@pytest.mark.parametrize("prompt", [42, [5.9], 3.5, [True, 2], [[1, 2]], {"a": 1}])
def test_prompt_that_is_neither_text_nor_ids_is_refused(tiny, prompt):
    with pytest.raises(ValueError, match="prompt must be text, a list of chat messages, or a list of integer"):
        tinyllm.generate(tiny, prompt, max_new_tokens=1)


def test_prompt_ids_as_list_tuple_or_array(tiny):
    ids = tiny.tokenizer.encode("hello")
    outs = [tinyllm.generate(tiny, p, max_new_tokens=3).token_ids for p in (ids, tuple(ids), np.array(ids))]
    assert outs[0] == outs[1] == outs[2]


def test_huge_kv_memory_is_a_one_line_error(tiny):
    with pytest.raises(ValueError, match="KV memory 1TiB cannot be allocated"):
        tinyllm.generate(tiny, "hello", max_new_tokens=2, kv="paged", kv_memory="1TiB")


def test_default_model_answers_and_stops_at_eos(default_model):
    res = tinyllm.generate(default_model, "What is the capital of France?", chat=True, max_new_tokens=40)
    assert "Paris" in res.text and res.finish_reason == "eos"
    assert len(res.stats.itl_s) == len(res.token_ids)            # one ITL per token after the first, incl. eos


def test_default_model_stop_string_is_cut_and_never_streamed(default_model):
    full = tinyllm.generate(default_model, "List three colors:", chat=True, max_new_tokens=30).text
    stop = full.split()[3]                                       # a word that really appears mid-answer
    s = tinyllm.stream(default_model, "List three colors:", chat=True, max_new_tokens=30, stop=[stop])
    streamed = "".join(s)
    assert s.result.finish_reason == "stop_string"
    assert streamed == s.result.text == full[:full.index(stop)]
    assert stop not in streamed


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_kv_memory_is_reported(tiny, kv):
    res = tinyllm.generate(tiny, "hello", max_new_tokens=5, kv=kv)
    per_token = tiny.config.kv_bytes_per_token()
    assert res.stats.kv_bytes_per_token == per_token
    # at least every position the request ended with is held (contiguous: the whole reservation)
    assert res.stats.kv_cache_bytes >= (len(res.prompt_ids) + len(res.token_ids) - 1) * per_token


def test_kv_memory_budget_is_checked_before_any_work(tiny):
    per_token = tiny.config.kv_bytes_per_token()
    res = tinyllm.generate(tiny, "hello", max_new_tokens=5, kv="paged", kv_memory=64 * per_token)
    assert len(res.token_ids) >= 1
    with pytest.raises(ValueError, match="KV memory .* holds 16 positions .* may need 3[0-9]"):
        tinyllm.generate(tiny, "hello", max_new_tokens=30, kv="paged", kv_memory=16 * per_token)
    with pytest.raises(ValueError, match="use it with kv='paged'"):
        tinyllm.generate(tiny, "hello", kv_memory="1MiB")
