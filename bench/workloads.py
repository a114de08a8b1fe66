"""Seeded request streams for the load test (random, mixed short/long, ShareGPT)
and their arrival times.

No tokenizer is needed: prompts of about N tokens are N words drawn from a
fixed list of short, common English words (one token each in most large BPE
vocabularies). Given a tokenizer, the word count is scaled by its measured
tokens per word. The server's `usage.prompt_tokens` gives the real count.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

WORDS = tuple("""
the of and to in is it you that he was for on are with as his they be at one
have this from or had by hot word but what some we can out other were all there
when up use your how said an each she which do their time if will way about
many then them write would like so these her long make thing see him two has
look more day could go come did number sound no most people my over know water
than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every
good me give our under name very through just form sentence great think say help
low line differ turn cause much mean before move right boy old too same tell
does set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went
light kind off need house picture try us again animal point mother world near
build self earth father head stand own page should country found answer school
grow study still learn plant cover food sun four between state keep eye never
last let thought city tree cross farm hard start might story saw far sea draw
left late run while press close night real life few north open seem together
next white children begin got walk example ease paper group always music those
both mark often letter until mile river car feet care second book carry took
science eat room friend began idea fish mountain stop once base hear horse cut
sure watch color face wood main enough plain girl usual young ready above ever
red list though feel talk bird soon body dog family direct pose leave song
""".split())


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One request to send: a prompt of about `prompt_len` tokens, `output_len` tokens wanted.

    A multi-turn chat request carries its whole history in `messages` (sent instead of `prompt`)
    and says which `conversation` and 1-based `turn` it is.
    """

    prompt: str
    prompt_len: int
    output_len: int
    kind: str  # "short" | "long" | "chat" (a multi-turn conversation's turn)
    messages: tuple[dict[str, str], ...] = ()
    conversation: int = -1
    turn: int = 0


@dataclass(frozen=True, slots=True)
class TrafficSpec:
    """When requests go out: Poisson/gamma arrivals, a concurrency cap, a count or time bound."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_prompts: int = 1000
    duration: float | None = None
    seed: int = 0
    num_warmups: int = 0


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str = "random"  # random | mixed | sharegpt | edit (bench.edit_workload) | multiturn (bench.multiturn)
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    short_input_len: int = 128
    long_input_len: int = 2048
    output_len: int = 128
    long_fraction: float = 0.1
    dataset_path: str | None = None
    sharegpt_output_len: int | None = None
    long_threshold: int = 1024
    tokens_per_word: float = 1.0  # of the target tokenizer over WORDS; see tokens_per_word()
    num_conversations: int = 16   # multiturn: conversations, turns each, shared system prompt and
    num_turns: int = 4            # user message tokens (answers are output_len tokens), seconds
    system_prompt_len: int = 512  # between an answer and the next turn
    user_message_len: int = 64
    think_time: float = 0.0
    document_len: int = 0         # multiturn: tokens of a document of its own each conversation's first message pastes


def word_prompt(rng: random.Random, num_tokens: int, tokens_per_word: float = 1.0) -> str:
    """A prompt of about `num_tokens` tokens: round(num_tokens / tokens_per_word) words drawn from WORDS."""
    return " ".join(rng.choices(WORDS, k=max(1, round(num_tokens / tokens_per_word))))


def tokens_per_word(tokenizer_path: str | Path) -> float:
    """How many tokens a WORDS word averages under a tokenizer.json (or a model folder holding one).

    Raises FileNotFoundError when there is no tokenizer file.
    """
    from tokenizers import Tokenizer

    path = Path(tokenizer_path)
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {tokenizer_path}")
    sample = word_prompt(random.Random(0), 4096)
    return len(Tokenizer.from_file(str(path)).encode(sample, add_special_tokens=False).ids) / 4096


def approx_tokens(text: str) -> int:
    """About how many tokens `text` is (4 characters a token), at least 1."""
    return max(1, math.ceil(len(text) / 4))


def build_workload(spec: WorkloadSpec) -> Iterator[SampleRequest]:
    """An endless, deterministic stream of requests for `spec` (same seed, same stream).

    Raises ValueError on an unknown workload name or bad parameters.
    """
    rng = random.Random(spec.seed)
    if spec.name == "random":
        return random_requests(rng, spec)
    if spec.name == "mixed":
        return mixed_requests(rng, spec)
    if spec.name == "sharegpt":
        return sharegpt_requests(rng, spec)
    if spec.name == "edit":
        return edit_requests(rng, spec)
    if spec.name == "multiturn":
        raise ValueError("the multiturn workload depends on the answers: bench.multiturn runs it")
    raise ValueError(f"unknown workload {spec.name!r} (random, mixed, sharegpt, edit, multiturn)")


def _length_range(length: int, ratio: float) -> tuple[int, int]:
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))


def _kind(prompt_len: int, threshold: int) -> str:
    return "long" if prompt_len >= threshold else "short"


def random_requests(rng: random.Random, spec: WorkloadSpec) -> Iterator[SampleRequest]:
    """Input and output lengths uniform in [L·(1-r), L·(1+r)] (vLLM's random dataset)."""
    if not 0.0 <= spec.random_range_ratio < 1.0:
        raise ValueError("random_range_ratio must be in [0, 1)")
    if spec.random_input_len < 1 or spec.random_output_len < 1:
        raise ValueError("random input and output lengths must be at least 1")
    input_range = _length_range(spec.random_input_len, spec.random_range_ratio)
    output_range = _length_range(spec.random_output_len, spec.random_range_ratio)
    return _random_stream(rng, input_range, output_range, spec.long_threshold, spec.tokens_per_word)


def _random_stream(rng: random.Random, input_range: tuple[int, int], output_range: tuple[int, int],
                   long_threshold: int, tokens_per_word: float) -> Iterator[SampleRequest]:
    while True:
        prompt_len = rng.randint(*input_range)
        output_len = rng.randint(*output_range)
        prompt = word_prompt(rng, prompt_len, tokens_per_word)
        yield SampleRequest(prompt, prompt_len, output_len, _kind(prompt_len, long_threshold))


def mixed_requests(rng: random.Random, spec: WorkloadSpec) -> Iterator[SampleRequest]:
    """Short chats with a share `long_fraction` of long-document prompts, evenly spread.

    Request i is long when floor((i+1)·f + u) > floor(i·f + u), u a seeded phase
    in [0, 1): exactly the fraction f over any run of 1/f requests.
    """
    if not 0.0 <= spec.long_fraction <= 1.0:
        raise ValueError("long_fraction must be in [0, 1]")
    if min(spec.short_input_len, spec.long_input_len, spec.output_len) < 1:
        raise ValueError("short_input_len, long_input_len and output_len must be at least 1")
    return _mixed_stream(rng, spec, phase=rng.random())


def _mixed_stream(rng: random.Random, spec: WorkloadSpec, phase: float) -> Iterator[SampleRequest]:
    fraction = spec.long_fraction
    for i in itertools.count():
        is_long = math.floor((i + 1) * fraction + phase) > math.floor(i * fraction + phase)
        prompt_len = spec.long_input_len if is_long else spec.short_input_len
        prompt = word_prompt(rng, prompt_len, spec.tokens_per_word)
        yield SampleRequest(prompt, prompt_len, spec.output_len, "long" if is_long else "short")


def load_sharegpt(path: str | Path, fixed_output_len: int | None) -> list[tuple[str, int, int]]:
    """(prompt, prompt_len, output_len) of each usable conversation in a ShareGPT JSON file.

    Takes the first two turns; drops pairs shorter than 4 tokens or longer than
    1024 (prompt) / 2048 (total) tokens, as vLLM does. Raises ValueError if none is left.
    """
    entries = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = []
    for entry in entries:
        turns = (entry.get("conversations") or entry.get("conversation") or []) if isinstance(entry, dict) else []
        if len(turns) < 2 or not all(isinstance(turn, dict) for turn in turns[:2]):
            continue
        prompt, completion = turns[0].get("value", ""), turns[1].get("value", "")
        prompt_len = approx_tokens(prompt)
        output_len = fixed_output_len or approx_tokens(completion)
        if prompt_len < 4 or (fixed_output_len is None and output_len < 4):
            continue
        if prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        pairs.append((prompt, prompt_len, output_len))
    if not pairs:
        raise ValueError(f"{path}: no usable conversation (need >= 2 turns, 4..1024 prompt tokens)")
    return pairs


def sharegpt_requests(rng: random.Random, spec: WorkloadSpec) -> Iterator[SampleRequest]:
    """The file's conversations in a seeded order, cycled as often as needed."""
    if not spec.dataset_path:
        raise ValueError("the sharegpt workload needs --dataset-path")
    pairs = load_sharegpt(spec.dataset_path, spec.sharegpt_output_len)
    rng.shuffle(pairs)
    return (SampleRequest(prompt, prompt_len, output_len, _kind(prompt_len, spec.long_threshold))
            for prompt, prompt_len, output_len in itertools.cycle(pairs))


def edit_requests(rng: random.Random, spec: WorkloadSpec) -> Iterator[SampleRequest]:
    """Repeat or lightly edit a passage of about `random_input_len` tokens (bench.edit_workload); the
    output wanted is `random_output_len` tokens."""
    from pdserve.bench.edit_workload import edit_prompts

    if spec.random_output_len < 1:
        raise ValueError("the edit workload needs --random-output-len >= 1")
    for prompt in edit_prompts(rng, spec.random_input_len, spec.dataset_path):
        prompt_len = approx_tokens(prompt)
        yield SampleRequest(prompt, prompt_len, spec.random_output_len, _kind(prompt_len, spec.long_threshold))


def arrival_offsets(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Seconds after the start at which each request is due: gamma gaps, shape=burstiness, mean 1/rate."""
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
        return
    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate * burstiness)
    offset = 0.0
    while True:
        yield offset
        offset += float(rng.gamma(burstiness, scale))


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset-name", "--workload", choices=("random", "mixed", "sharegpt", "edit", "multiturn"),
                       default=None, help="default: sharegpt with --dataset-path, else random; multiturn: chat "
                                          "conversations that resend their history (/v1/chat/completions); edit: "
                                          "repeat or lightly edit a passage of --random-input-len tokens from "
                                          "local files, sent as chat (output overlaps input: speculative "
                                          "decoding's case)")
    group.add_argument("--dataset-path", default=None,
                       help="ShareGPT-format JSON file; for edit, a text file or folder (default: pdserve's sources)")
    group.add_argument("--sharegpt-output-len", type=int, default=None, help="override each ShareGPT output length")
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in L*(1-r)..L*(1+r)")
    group.add_argument("--short-input-len", type=int, default=128, help="mixed: prompt tokens of a short chat")
    group.add_argument("--long-input-len", type=int, default=2048, help="mixed: prompt tokens of a long document")
    group.add_argument("--output-len", type=int, default=128, help="mixed, multiturn: output tokens of every request")
    group.add_argument("--long-fraction", type=float, default=0.1, help="mixed: share of long-document prompts")
    group.add_argument("--long-threshold", type=int, default=1024,
                       help="random/sharegpt: prompts of at least this many tokens are tagged long")
    group.add_argument("--tokenizer", default=None,
                       help="tokenizer.json or model folder: size random/mixed/multiturn prompts in its tokens "
                            "(default: one token per word)")
    add_multiturn_arguments(parser)


def add_multiturn_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-turn chat",
                                      "--dataset-name multiturn; --request-rate is in conversations/s")
    group.add_argument("--num-conversations", type=int, default=16)
    group.add_argument("--num-turns", type=int, default=4, help="turns of each conversation")
    group.add_argument("--system-prompt-len", type=int, default=512, help="tokens of the system prompt they share")
    group.add_argument("--user-message-len", type=int, default=64, help="tokens of each user message")
    group.add_argument("--think-time", type=float, default=0.0, help="seconds between an answer and the next turn")
    group.add_argument("--document-len", type=int, default=0,
                       help="tokens of a document of its own that each conversation's first message pastes (0: none)")


def add_traffic_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("traffic")
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests/s (Poisson; multiturn: conversations/s); inf = all at once")
    group.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    group.add_argument("--max-concurrency", type=int, default=None,
                       help="cap on requests in flight (multiturn: conversations)")
    group.add_argument("--num-prompts", type=int, default=1000)
    group.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--num-warmups", type=int, default=0, help="unrecorded requests sent first, one at a time")


def workload_from_args(args: argparse.Namespace) -> WorkloadSpec:
    name = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    return WorkloadSpec(
        name=name, seed=args.seed, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        short_input_len=args.short_input_len, long_input_len=args.long_input_len, output_len=args.output_len,
        long_fraction=args.long_fraction, dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len, long_threshold=args.long_threshold,
        tokens_per_word=tokens_per_word(args.tokenizer) if args.tokenizer else 1.0,
        num_conversations=args.num_conversations, num_turns=args.num_turns,
        system_prompt_len=args.system_prompt_len, user_message_len=args.user_message_len,
        think_time=args.think_time, document_len=args.document_len,
    )


def warmup_spec(workload: WorkloadSpec) -> WorkloadSpec:
    """The same workload on another seed: warm-up prompts never repeat measured ones."""
    return replace(workload, seed=workload.seed + 1_000_003)


def traffic_from_args(args: argparse.Namespace) -> TrafficSpec:
    if not args.request_rate > 0 or not args.burstiness > 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--num-prompts and --max-concurrency must be at least 1")
    return TrafficSpec(args.request_rate, args.burstiness, args.max_concurrency, args.num_prompts,
                       args.duration, args.seed, args.num_warmups)
