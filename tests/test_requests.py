"""requests.py, what generate and the engine share: stop strings held back across token boundaries and cut,
the decoder's flush, end tokens, prompt checks with the same one-line errors from both, the scheduler's slots,
and stream()'s two call forms (keywords, or SamplingParams + CacheSpec) giving the same tokens. Tiny models."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyllm
from tinyllm import CacheSpec, SamplingParams
from tinyllm.engine import Engine
from tinyllm.requests import (StopStrings, TextOutput, as_sampling_params, as_token_ids, check_prompt_ids,
                              check_room, end_token_ids, positive_int, prompt_ids)
from tinyllm.stream_decoder import StreamDecoder

from test_model import random_model
from tiny_gguf import tiny_llama


class PieceTokenizer:
    """Token i is the bytes pieces[i]; the real StreamDecoder on top (so split UTF-8 characters are held back)."""

    def __init__(self, pieces, eos_id=None, special_ids=()):
        self.pieces, self.eos_id, self.special_ids = [p if isinstance(p, bytes) else p.encode() for p in pieces], \
            eos_id, frozenset(special_ids)

    def id_to_bytes(self, i):
        return self.pieces[i]

    def stream_decoder(self):
        return StreamDecoder(self)

    def decode(self, ids):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def emit(tokenizer, stop, tokens):
    """Feed tokens as generate and the engine do. -> (pieces handed out, the TextOutput)"""
    out, pieces = TextOutput(tokenizer, StopStrings(stop)), []
    for t in tokens:
        if out.add(t):
            break
        pieces.append(out.take())
    pieces.append(out.close())
    return pieces, out


# --- stop strings and text emission --------------------------------------------------------------------------------
def test_a_stop_string_split_over_tokens_is_held_back_then_cut():
    tok = PieceTokenizer(["he", "llo", " E", "ND", "!"])
    pieces, out = emit(tok, ["END"], [0, 1, 2, 3, 4])
    assert pieces == ["he", "llo", " ", ""]                       # "E" waited: it could have begun "END"
    assert out.stopped and out.text == "hello " == "".join(pieces)


def test_held_back_text_is_released_once_it_cannot_become_a_stop_string():
    tok = PieceTokenizer(["a", "E", "N", "x"])
    pieces, out = emit(tok, ["END"], [0, 1, 2, 3])
    assert pieces == ["a", "", "", "ENx", ""] and not out.stopped and out.text == "aENx"


def test_the_earliest_of_several_stop_strings_cuts_and_the_longest_prefix_is_held():
    assert StopStrings(["<|im_end|>", "|"]).safe_length("a <|im") == 2     # "<|im" could still become "<|im_end|>"
    assert StopStrings(["b", "ab"]).find("xxab") == 2
    assert StopStrings("near").strings == ("near",)                        # one string, not its letters
    with pytest.raises(ValueError, match="stop strings must be non-empty strings"):
        StopStrings(["ok", ""])


def test_close_flushes_an_unfinished_character_but_not_after_a_stop_string():
    tok = PieceTokenizer([b"a", b"\xc3", b"\xa9", b"ST\xc3"])
    assert emit(tok, [], [0, 1, 2])[0] == ["a", "", "é", ""]              # the split character waits for its end
    assert emit(tok, [], [0, 1])[0] == ["a", "", "\ufffd"]                # unfinished at the end: replaced
    pieces, out = emit(tok, ["ST"], [0, 3])                               # its pending byte lies past the cut
    assert pieces == ["a", ""] and out.text == "a"


def test_no_tokenizer_means_no_text_and_no_stop_strings():
    out = TextOutput(None)
    assert not out.add(5) and out.take() == "" and out.close() == ""
    with pytest.raises(ValueError, match="stop strings need a model with a tokenizer"):
        TextOutput(None, StopStrings(["x"]))


VOCAB = ["a", "b", "ab", "ba", "\n", "é", b"\xc3", b"\xa9", "<", "|>", "end", "e", "nd"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, len(VOCAB) - 1), max_size=30),
       st.lists(st.sampled_from(["ab", "\n\n", "end", "b", "<|>", "éa", "aaa"]), max_size=3))
def test_pieces_join_to_the_one_shot_text_cut_before_the_first_stop_string(tokens, stop):
    tok = PieceTokenizer(VOCAB)
    pieces, out = emit(tok, stop, tokens)
    fed = tokens[:len(pieces) - 1 + out.stopped]                          # up to the token that completed a stop
    full = tok.decode(fed)
    cut = StopStrings(stop).find(full)
    if out.stopped:
        assert cut >= 0 and out.text == full[:cut]
    else:
        assert cut == -1 and out.text == full                             # flushed: every byte decoded
    assert "".join(pieces) == out.text                                    # nothing past the cut was ever shown


# --- end tokens ----------------------------------------------------------------------------------------------------
def test_end_tokens_are_eos_and_endoftext():
    tok = PieceTokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a"], eos_id=2, special_ids=(0, 1, 2))
    assert end_token_ids(tok) == {0, 2}
    assert end_token_ids(PieceTokenizer(["a", "<|endoftext|>"], special_ids=(1,))) == {1}   # no eos id
    assert end_token_ids(PieceTokenizer(["<|endoftext|>"])) == set()     # text, not a special token
    tok.end_ids = frozenset({3})                                         # a file's eot / eom ids
    assert end_token_ids(tok) == {0, 2, 3}


# --- prompt checks -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    tiny_llama(p)
    return tinyllm.load(p, backend="numpy")


def test_token_ids_are_integers_only():
    assert as_token_ids([1, 2]) == as_token_ids((1, 2)) == as_token_ids(np.array([1, 2])) == [1, 2]
    assert as_token_ids(range(3)) == [0, 1, 2] and as_token_ids([np.int64(4)]) == [4]
    for bad in (42, [5.9], [True, 2], "text", np.array([1.0])):
        with pytest.raises(ValueError, match="prompt must be text, a list of chat messages, or a list of integer"):
            as_token_ids(bad)
    with pytest.raises(ValueError, match="stop_token_ids must be a list of integer token ids; got str 'a'"):
        as_token_ids("a", "stop_token_ids")


def test_prompt_ids_checks():
    assert check_prompt_ids([0, 9], 10) == [0, 9]
    with pytest.raises(ValueError, match="the prompt is empty: give at least one token"):
        check_prompt_ids([], 10)
    with pytest.raises(ValueError, match=r"prompt has token ids outside the vocabulary \(0 \.\. 9\)"):
        check_prompt_ids([3, 10], 10)
    check_room([1] * 63, 64)
    with pytest.raises(ValueError, match="the prompt has 64 tokens but the model's context is 64: shorten it"):
        check_room([1] * 64, 64)
    assert positive_int(3, "max_tokens") == 3
    for bad in (0, True, 2.0, "3"):
        with pytest.raises(ValueError, match=f"invalid n={bad!r}: must be an integer >= 1"):
            positive_int(bad, "n")
    assert as_sampling_params(None) == SamplingParams()
    with pytest.raises(ValueError, match="params must be a SamplingParams, got dict"):
        as_sampling_params({"temperature": 1})


def test_prompt_as_text_chat_or_ids(tiny):
    tok = tiny.tokenizer
    assert prompt_ids(tiny, "hello") == tok.encode("hello")
    assert prompt_ids(tiny, (5, 6)) == [5, 6]
    # The tiny model ships no template but has ChatML's tokens: ChatML it is (as in llama.cpp).
    chatml = tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    assert tok.chat_template is None and tok.encode("<|im_start|>") == [1]
    for chat in [dict(prompt="hello", chat=True), dict(prompt=[{"role": "user", "content": "hello"}])]:
        assert prompt_ids(tiny, **chat) == chatml


@pytest.mark.parametrize("prompt, message", [
    ([], "the prompt is empty"),
    ([1, 10_000], r"prompt has token ids outside the vocabulary \(0 \.\. "),
])
def test_generate_and_the_engine_refuse_a_bad_prompt_alike(tiny, prompt, message):
    with pytest.raises(ValueError, match=message):
        tinyllm.generate(tiny, prompt, max_new_tokens=1)
    with pytest.raises(ValueError, match=message):
        Engine(tiny, num_blocks=8).add_request("a", prompt, max_tokens=1)


# --- the scheduler assigns slots -----------------------------------------------------------------------------------
def test_forked_samples_take_the_lowest_free_slots():
    engine = Engine(random_model("llama"), num_blocks=32, block_size=4, max_num_seqs=6)
    engine.add_request("a", [1, 2, 3], max_tokens=4)
    engine.add_request("b", [4, 5, 6], SamplingParams(temperature=1.0, seed=0), max_tokens=4, n=3)
    engine.step()
    assert sorted(r.slot for r in engine.scheduler.running) == [0, 1, 2, 3]
    assert {r.request_id: r.slot for r in engine.scheduler.running}["b/2"] == 3
    list(engine.run())
    assert engine.pool.allocator.num_used == 0


# --- stream(): keywords, or SamplingParams + CacheSpec -------------------------------------------------------------
@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_both_call_forms_of_stream_give_the_same_tokens(tiny, kv):
    by_keywords = tinyllm.stream(tiny, "hello", max_new_tokens=8, temperature=0.7, top_k=40, seed=5, kv=kv,
                                 kv_dtype="float16")
    by_objects = tinyllm.stream(tiny, "hello", max_new_tokens=8,
                                params=SamplingParams(temperature=0.7, top_k=40, seed=5),
                                cache=CacheSpec(kind=kv, kv_dtype="float16"))
    assert "".join(by_keywords) == by_keywords.result.text
    assert "".join(by_objects) == by_objects.result.text
    a, b = by_keywords.result, by_objects.result
    assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
    assert a.stats.kv_bytes_per_token == b.stats.kv_bytes_per_token == tiny.config.kv_bytes_per_token("float16")
    greedy = tinyllm.generate(tiny, "hello", max_new_tokens=8, kv=kv)     # the defaults: greedy, float32
    assert greedy.token_ids == tinyllm.generate(tiny, "hello", max_new_tokens=8, params=SamplingParams(),
                                                cache=CacheSpec(kv)).token_ids


def test_stream_keyword_form_still_takes_every_setting(tiny):
    out = tinyllm.generate(tiny, "hello", max_new_tokens=4, temperature=0.9, top_k=5, top_p=0.9, min_p=0.01,
                           repetition_penalty=1.1, seed=1, kv="paged", kv_memory=64 * tiny.config.kv_bytes_per_token(),
                           kv_dtype="float32")
    same = tinyllm.generate(tiny, "hello", max_new_tokens=4, params=SamplingParams(0.9, 5, 0.9, 0.01, 1.1, 1),
                            cache=CacheSpec("paged", 64 * tiny.config.kv_bytes_per_token()))
    assert out.token_ids == same.token_ids


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(kv="disk"), ValueError, "unknown kv 'disk'; choose one of: contiguous, paged"),
    (dict(kv_memory="1MiB"), ValueError, "kv_memory sizes the paged pool: use it with kv='paged'"),
    (dict(kv_dtype="bfloat16"), ValueError, "unknown kv_dtype 'bfloat16'"),
    (dict(params=SamplingParams(), temperature=1.0), ValueError, "as params=SamplingParams.* or as keywords, not both"),
    (dict(cache=CacheSpec(), kv="paged"), ValueError, "as cache=CacheSpec.* or as keywords, not both"),
    (dict(params={"temperature": 1.0}), ValueError, "params must be a SamplingParams, got dict"),
    (dict(cache="paged"), ValueError, "cache must be a CacheSpec, got str"),
    (dict(temprature=1.0), TypeError, "unexpected keyword argument 'temprature'"),
])
def test_bad_settings_are_one_line_errors(tiny, kwargs, error, message):
    with pytest.raises(error, match=message):
        tinyllm.stream(tiny, "hello", max_new_tokens=2, **kwargs)


def test_cache_spec_names_its_dtype():
    assert CacheSpec(kv_dtype=np.float16).kv_dtype == "float16"
    with pytest.raises(ValueError, match="unknown kv 'x'"):
        CacheSpec("x")
