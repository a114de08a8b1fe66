"""bench/sse_client.py: the incremental SSE parser, request payloads, stream bookkeeping."""
from __future__ import annotations

import json
import random

import pytest
from openai._streaming import SSEDecoder

from pdserve.bench.sse_client import (
    EndpointConfig,
    SSEParser,
    StreamError,
    _Stream,
    build_payload,
)
from pdserve.bench.workloads import SampleRequest


def _chunk(text: str, finish: str | None = None) -> str:
    return json.dumps({"id": "cmpl-1", "object": "text_completion",
                       "choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def _sample_stream(rng: random.Random, newline: str = "\n") -> tuple[bytes, list[str]]:
    """A realistic stream with keep-alives, comments, other fields, non-ASCII text; and its event data."""
    texts = ["héllo", " wörld", " 日本", " 🙂", "\\n", " x"]
    events = [_chunk(rng.choice(texts)) for _ in range(rng.randint(3, 8))]
    events.append(_chunk("", "length"))
    events.append(json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(events) - 1}}))
    events.insert(1, '{"choices": [],\n"usage": null}')
    lines = [": keep-alive", ""]
    for i, data in enumerate(events):
        if i % 3 == 1:
            lines += ["event: message", f"id: {i}", "retry: 1000"]
        lines += [f"data: {line}" for line in data.split("\n")] + [""]
        if i % 4 == 2:
            lines += [":ping", ""]
    lines += ["data: [DONE]", "", ""]
    return newline.join(lines).encode("utf-8"), events + ["[DONE]"]


def _feed_all(chunks: list[bytes]) -> list[str]:
    parser = SSEParser()
    return [data for chunk in chunks for data in parser.feed(chunk)]


def _reference(stream: bytes) -> list[str]:
    return [event.data for event in SSEDecoder().iter_bytes(iter([stream])) if event.data]


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_whole_stream_matches_openai_decoder(newline):
    stream, expected = _sample_stream(random.Random(7), newline)
    assert _feed_all([stream]) == expected
    assert _feed_all([stream]) == _reference(stream)


@pytest.mark.parametrize("newline", ["\n", "\r\n", "\r"])
def test_every_split_point_gives_the_same_events(newline):
    stream, expected = _sample_stream(random.Random(11), newline)
    for cut in range(len(stream) + 1):
        assert _feed_all([stream[:cut], stream[cut:]]) == expected, f"split at byte {cut}"


def test_byte_by_byte_and_random_multi_splits():
    rng = random.Random(3)
    stream, expected = _sample_stream(rng, "\r\n")
    assert _feed_all([stream[i : i + 1] for i in range(len(stream))]) == expected
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(2, 12)))
        pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
        assert _feed_all(pieces) == expected


def test_several_streams_merged_in_one_chunk_and_events_returned_in_order():
    parser = SSEParser()
    assert parser.feed(b"data: a\n\ndata: b\n\ndata: c\n") == ["a", "b"]
    assert parser.has_pending
    assert parser.feed(b"\n") == ["c"]
    assert not parser.has_pending


def test_field_details_follow_the_spec():
    parser = SSEParser()
    events = parser.feed(
        b"\xef\xbb\xbfdata:no-space\n\n"       # BOM at stream start, no space after the colon
        b"data:  two spaces\n\n"               # only one leading space is removed
        b"data: line1\ndata: line2\n\n"        # multi-line data joined by LF
        b"data\n\n"                            # field without colon: empty value
        b"event: ping\nid: 3\n\n"              # no data: nothing dispatched
        b": comment\n\n"                       # comment only
        b"dat: typo\n\n"                       # unknown field ignored
    )
    assert events == ["no-space", " two spaces", "line1\nline2", ""]


def test_cr_lf_split_across_chunks_is_one_line_ending():
    parser = SSEParser()
    assert parser.feed(b"data: x\r") == []
    assert parser.feed(b"\ndata: y\r") == []
    assert parser.feed(b"\n\r") == ["x\ny"]
    assert parser.feed(b"\ndata: z\r\n\r\n") == ["z"]


def test_multibyte_character_split_across_chunks():
    encoded = "data: 日本🙂\n\n".encode()
    for cut in range(len(encoded) + 1):
        assert _feed_all([encoded[:cut], encoded[cut:]]) == ["日本🙂"]


def test_truncated_stream_leaves_pending_state():
    stream, _ = _sample_stream(random.Random(5))
    truncated = stream[: stream.index(b"[DONE]")]
    parser = SSEParser()
    events = parser.feed(truncated)
    assert "[DONE]" not in events
    assert parser.has_pending


def _endpoint(**overrides) -> EndpointConfig:
    return EndpointConfig(base_url="http://h:1/v1/", model="m", **overrides)


def test_payload_length_controls():
    sample = SampleRequest("a b c", 3, 17, "short")
    vllm = build_payload(_endpoint(), sample)
    assert vllm["prompt"] == "a b c" and vllm["stream"] is True
    assert vllm["stream_options"] == {"include_usage": True}
    assert (vllm["max_tokens"], vllm["min_tokens"], vllm["ignore_eos"]) == (17, 17, True)
    assert "temperature" not in vllm
    hf = build_payload(_endpoint(length_control="generation-config", endpoint="chat", temperature=0.0), sample)
    assert hf["messages"] == [{"role": "user", "content": "a b c"}] and "prompt" not in hf
    assert json.loads(hf["generation_config"]) == {"max_new_tokens": 17, "min_new_tokens": 17, "do_sample": False}
    assert "ignore_eos" not in hf and hf["temperature"] == 0.0
    sampled = build_payload(_endpoint(length_control="generation-config", temperature=0.7), sample)
    assert json.loads(sampled["generation_config"])["do_sample"] is True
    plain = build_payload(_endpoint(length_control="max-tokens", extra_body={"top_k": 5}), sample)
    assert plain["max_tokens"] == 17 and "min_tokens" not in plain and plain["top_k"] == 5


def test_endpoint_urls():
    assert _endpoint().url == "http://h:1/v1/completions"
    assert _endpoint(endpoint="chat").url == "http://h:1/v1/chat/completions"
    assert EndpointConfig("http://h:1", "m", api_key="k").headers == {"Authorization": "Bearer k"}


def _delta(content: str) -> str:
    return json.dumps({"choices": [{"delta": {"content": content}, "finish_reason": None}]})


def test_stream_bookkeeping_times_token_chunks_only():
    """Each chunk carrying a token is timed, one whose text is empty (a token ending mid-character) too;
    the role announcement, a bare finish and the usage chunk are not tokens."""
    stream = _Stream(start=10.0, endpoint="chat")
    stream.on_event(json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}), 10.1)
    for content, now in [("a", 10.5), ("", 10.6), ("b", 10.75), ("c", 11.0)]:
        stream.on_event(_delta(content), now)
    stream.on_event(json.dumps({"choices": [{"delta": {"content": ""}, "finish_reason": "length"}]}), 11.1)
    stream.on_event(json.dumps({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 4}}), 11.2)
    stream.on_event("[DONE]", 11.3)
    assert stream.first_token == 10.5
    assert stream.itl == pytest.approx([0.1, 0.15, 0.25])
    assert "".join(stream.text) == "abc"
    assert (stream.finish_reason, stream.usage["completion_tokens"]) == ("length", 4)
    assert (stream.done, stream.end) == (True, 11.3)


@pytest.mark.parametrize("data", [
    '{"error": {"message": "engine died", "type": "server_error"}}',
    '{"object": "error", "message": "bad", "code": 500}',
    "not json",
    "[1, 2]",
])
def test_error_and_garbage_events_raise(data):
    with pytest.raises(StreamError):
        _Stream(start=0.0, endpoint="completions").on_event(data, 1.0)
