"""Incremental detokenization and stop strings on the demo byte-level BPE."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from pdserve.engine.model.demo import make_model
from pdserve.engine.text.detokenizer import IncrementalDetokenizer
from pdserve.engine.text.stop_strings import StopStringMatcher
from pdserve.engine.text.tokenizer import Tokenizer

MULTIBYTE = "Größe 😀 你好，世界！🚀 👨‍👩‍👧‍👦 こんにちは 🇫🇷 ∑∫ done"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("demo") / "tiny-llama", "tiny", "llama")


@pytest.fixture(scope="module")
def tok(demo_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


def _stream(detok: IncrementalDetokenizer, ids) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


def _random_text(rng: random.Random, n: int) -> str:
    pool = "abc xyz\n.,!?éüßЖλ中文你好世界こんにちは한국😀🚀🔥👍🏽🇫🇷—€"
    return "".join(rng.choice(pool) for _ in range(n))


def test_multibyte_characters_split_across_tokens(tok):
    ids = tok.encode(MULTIBYTE)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the test needs characters split across tokens
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # everything was complete before the flush


def test_matches_tokenizers_decode_stream(tok, demo_dir):
    """Per-token deltas agree with the `tokenizers` library's own incremental decoder."""
    backend = HFTokenizer.from_file(str(demo_dir / "tokenizer.json"))
    rng = random.Random(0)
    for _ in range(20):
        ids = tok.encode(_random_text(rng, rng.randrange(1, 60)))
        reference = DecodeStream(skip_special_tokens=True)
        expected = [reference.step(backend, i) or "" for i in ids]
        assert _stream(IncrementalDetokenizer(tok), ids)[:-1] == expected


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_ids(tok, skip_special_tokens):
    rng = random.Random(0)
    valid_utf8 = 0
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 48))]
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        deltas = _stream(detok, ids)
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        valid_utf8 += "\ufffd" not in full
        assert "".join(deltas) == full
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])
    assert valid_utf8 > 10  # some sequences were entirely valid UTF-8


def test_sentencepiece_byte_fallback_never_raises_and_keeps_whole_text():
    """SentencePiece byte tokens: any sequence (invalid UTF-8, which DecodeStream refuses to re-read) streams
    without an exception and with every delta but the last whole; text spelled with them (characters the
    vocabulary lacks) streams exactly as it decodes after its prompt."""
    path = Path(__file__).parent / "fixtures" / "gguf" / "llama" / "tokenizer.json"
    sp = Tokenizer(HFTokenizer.from_file(str(path)), {}, frozenset(), None, path.parent)
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(3, sp.vocab_size) for _ in range(rng.randrange(1, 40))]
        deltas = _stream(IncrementalDetokenizer(sp, prompt_token_ids=[300]), ids)
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])
    for _ in range(50):
        prompt, output = sp.encode(_random_text(rng, 20)), sp.encode(_random_text(rng, 30))
        assert any(sp.decode([i]) == "\ufffd" for i in output)             # characters spelled in bytes
        deltas = _stream(IncrementalDetokenizer(sp, prompt_token_ids=prompt), output)
        assert "".join(deltas) == sp.decode(prompt + output)[len(sp.decode(prompt)):]


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>assistant\nHi 你好<|im_end|>")
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == "assistant\nHi 你好"
    kept = "".join(_stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert kept == "<|im_start|>assistant\nHi 你好<|im_end|>"


def test_prompt_context(tok):
    rng = random.Random(0)
    for _ in range(20):
        prompt, output = tok.encode(_random_text(rng, 30)), tok.encode(_random_text(rng, 30))
        deltas = _stream(IncrementalDetokenizer(tok, prompt_token_ids=prompt), output)
        assert "".join(deltas) == tok.decode(output)


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("ab 😀 你好")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    deltas = _stream(IncrementalDetokenizer(tok, prompt_token_ids=ids[:cut]), ids[cut:])
    assert "".join(deltas) == tok.decode(ids[cut:])


def test_decodes_a_bounded_window(tok):
    """Streaming is DecodeStream's (a window of its own); our own decodes (context check, flush) stay short."""
    lengths = []

    class Spy:
        backend = tok.backend

        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(_random_text(random.Random(1), 600))
    assert "".join(_stream(IncrementalDetokenizer(Spy(), prompt_token_ids=ids[:50]), ids)) == tok.decode(ids)
    assert max(lengths) <= 12


def _reference_stop(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    """Brute force: after each chunk, the whole text so far is searched for every stop string."""
    text = ""
    for chunk in chunks:
        text += chunk
        starts = [text.find(s) for s in stops if s in text]
        if starts:
            return text[:min(starts)], True
    return text, False


def _run_matcher(chunks: list[str], stops: list[str]) -> tuple[str, bool, list[str]]:
    matcher, emitted = StopStringMatcher(stops), []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True, emitted
    emitted.append(matcher.flush())
    return "".join(emitted), False, emitted


def test_stop_spanning_deltas():
    text, stopped, emitted = _run_matcher(["Hello wo", "rld! ST", "O", "P now"], ["STOP"])
    assert (text, stopped) == ("Hello world! ", True)
    assert emitted == ["Hello wo", "rld! ", "", ""]


def test_overlapping_prefixes():
    assert _run_matcher(list("xababcd"), ["abcd"])[:2] == ("xab", True)
    assert _run_matcher(["aaa", "ab"], ["aab"])[:2] == ("aa", True)
    assert _run_matcher(["aba", "bax"], ["abab", "abx"])[:2] == ("", True)
    assert _run_matcher(["xaba", "c"], ["bac", "abac"])[:2] == ("x", True)


def test_earliest_match_wins_and_no_stop_flushes():
    assert _run_matcher(["hello world"], ["world", "lo w"])[:2] == ("hel", True)
    assert _run_matcher(["say END", " or STOP"], ["STOP", "END"])[:2] == ("say ", True)
    assert _run_matcher(["abc", "ab"], ["abd"]) == ("abcab", False, ["abc", "", "ab"])
    assert _run_matcher(["no stops"], []) == ("no stops", False, ["no stops", ""])


def test_after_stop_everything_is_swallowed():
    matcher = StopStringMatcher(["</s>"])
    assert matcher.feed("done</s>tail") == ("done", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_matcher_against_brute_force():
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("abc😀") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice("abc😀") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        cuts = sorted(rng.sample(range(1, len(text)), min(rng.randrange(0, 8), max(0, len(text) - 1))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        got, stopped, emitted = _run_matcher(chunks, stops)
        assert (got, stopped) == _reference_stop(chunks, stops)
        assert not any(s in "".join(emitted) for s in stops)


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])
