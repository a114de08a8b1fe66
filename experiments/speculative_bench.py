"""One stream with and without speculative decoding (each --variant: n-gram and suffix by default), on prompts
whose answer overlaps them (an edit of a code passage; a prose passage quoted) and on one whose answer does
not, in one process: tok/s of each and the ratios.

    python experiments/speculative_bench.py --model smollm2 --max-tokens 256 --repeats 3 \
        --variant 'ngram={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                          "prompt_lookup_max": 4}' \
        --variant 'suffix={"method": "suffix", "num_speculative_tokens": 16}'

The engines (same weights, same mode) take turns, one engine alive at a time (an idle second engine in
the process halves the other's speed), each round building each; each figure is the median of --repeats
greedy requests, each after one warm-up request whose answer is then dropped from the suffix method's cache of
earlier outputs (--keep-cache leaves it there: the case of a request repeated).
With --llama-server and --llama-gguf (the same weights as --model, e.g. `python -m pdserve.bench.reference_model`'s
F32 pair), llama.cpp's `llama-server` runs the same token prompts after pdserve, without and with its own
n-gram speculation (`--llama-spec`), one request at a time, stopping at EOS as pdserve's requests do.
`--proposer-cpu` instead times each variant's proposer alone (time.thread_time per call) on edit contexts of
--context-tokens tokens (the prompt and a copied answer so far), no engine built.
Prints one summary line per workload and writes everything as JSON to --result-json.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import orjson

from pdserve.bench.edit_workload import DEFAULT_QUOTE_FILE, REPO, edit_prompts, quote_prompt
from pdserve.bench.llama_cpp import find_llama_server, llama_server, timed_completions
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.core.speculative import SpeculativeConfig, Speculator
from pdserve.engine.llm import LLM
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.text.tokenizer import Tokenizer

OPEN_ENDED = "Write a long story about a lighthouse keeper who finds a map in a bottle. Use vivid detail."


DEFAULT_PASSAGE_FILE = REPO / "engine" / "core" / "block_manager.py"   # NOTE: one file, so that new files elsewhere
#                                                                   do not change which passage a seed picks


def prompts(llm: LLM, passage_tokens: int, seed: int, path: str, quote_path: str | None = None
            ) -> dict[str, list[int]]:
    """{"overlap": an edit prompt over a passage of `path`, "quote": a prose passage of `quote_path` to repeat
    (when given), "no_overlap": an open-ended story}, chat-templated."""
    edit = next(edit_prompts(random.Random(seed), passage_tokens, path))
    chat = llm.tokenizer.encode_chat
    sets = {"overlap": chat([{"role": "user", "content": edit}])}
    if quote_path:
        sets["quote"] = chat([{"role": "user", "content": quote_prompt(random.Random(seed), passage_tokens,
                                                                       quote_path)}])
    return sets | {"no_overlap": chat([{"role": "user", "content": OPEN_ENDED}])}


def tokens_per_second(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, int]:
    started = time.perf_counter()
    [output] = llm.generate([prompt], params)
    return len(output.token_ids) / (time.perf_counter() - started), len(output.token_ids)


def counters(llm: LLM) -> dict:
    stats = [a for a in llm.engine.stats().actors if a.spec_accepted_per_position]
    return {"drafts": sum(a.spec_drafts for a in stats), "draft_tokens": sum(a.spec_draft_tokens for a in stats),
            "accepted_tokens": sum(a.spec_accepted_tokens for a in stats)}


DEFAULT_VARIANTS = ('ngram={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                    '"prompt_lookup_max": 4}',
                    'suffix={"method": "suffix", "num_speculative_tokens": 16}')


def variants(specs: list[str] | None) -> dict[str, str]:
    """{name: speculative config JSON} from NAME=JSON strings (checked here, before any engine is built)."""
    out = {}
    for spec in specs or DEFAULT_VARIANTS:
        name, sep, text = spec.partition("=")
        if not sep or name == "plain":
            raise ValueError(f"--variant must look like NAME=JSON (NAME not 'plain'), got {spec!r}")
        SpeculativeConfig.from_json(text)
        out[name] = text
    return out


def forget_outputs(llm: LLM) -> None:
    """Empty every suffix cache, so that the measured request does not find the warm-up's answer there."""
    for actor in llm.engine.actors:
        if actor.speculator is not None:
            actor.speculator.forget_outputs()


def run(args: argparse.Namespace) -> dict:
    configs = {"plain": {}, **{name: {"speculative_config": text} for name, text in variants(args.variant).items()}}
    base = EngineConfig(model=args.model, mode=args.mode, dtype=args.dtype,      # NOTE: every request prefills, as
                        cache=CacheConfig(enable_prefix_caching=False))     # llama-server's cache_prompt: false
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rates: dict = {}
    spent: dict = {}
    lengths: dict = {}
    prompt_sets = None
    for _ in range(args.repeats):
        for key, extra in configs.items():           # NOTE: one engine at a time: an idle second one halves the speed
            llm = LLM(config=base, **extra)
            try:
                prompt_sets = prompt_sets or prompts(llm, args.passage_tokens, args.seed, args.dataset_path,
                                                     args.quote_path)
                for name, prompt in prompt_sets.items():
                    tokens_per_second(llm, prompt, params)                       # warm-up
                    if not args.keep_cache:
                        forget_outputs(llm)
                    before = counters(llm)
                    rate, lengths[name, key] = tokens_per_second(llm, prompt, params)
                    rates.setdefault(name, {}).setdefault(key, []).append(rate)
                    after = counters(llm)
                    for k in after:
                        spent.setdefault((name, key), {}).setdefault(k, 0)
                        spent[name, key][k] += after[k] - before[k]
            finally:
                llm.close()
    results = {"_prompts": prompt_sets}
    for name, prompt in prompt_sets.items():
        medians = {key: statistics.median(values) for key, values in rates[name].items()}
        results[name] = {"prompt_tokens": len(prompt), "tok_s": rates[name], "median_tok_s": medians,
                         "output_tokens": {key: lengths[name, key] for key in configs}}
        line = [f"{name:>10}: plain {medians['plain']:.1f} tok/s"]
        for key in configs:
            if key == "plain":
                continue
            used = spent[name, key]
            rate = used["accepted_tokens"] / used["draft_tokens"] if used["draft_tokens"] else None
            results[name][key] = {"ratio": medians[key] / medians["plain"], "acceptance_rate": rate, **used}
            line.append(f"{key} {medians[key]:.1f} tok/s ({medians[key] / medians['plain']:.2f}x, acceptance "
                        f"{'n/a' if rate is None else f'{rate:.1%}'})")
        print(", ".join(line) + f" ({args.repeats} runs, medians; outputs "
              f"{'/'.join(str(lengths[name, key]) for key in configs)} tokens)")
    return results


def llama_cpp_rates(args: argparse.Namespace, prompt_sets: dict[str, list[int]]) -> dict:
    """{workload: {"plain"|"spec": median tok/s}} of llama-server over the same prompts, one at a time."""
    binary = find_llama_server(args.llama_server)
    variants = {"plain": (), "spec": tuple(args.llama_spec.split())}
    rates: dict = {name: {} for name in prompt_sets}
    for variant, extra in variants.items():
        with llama_server(binary, args.llama_gguf, args.threads, 4096, 1, extra=extra) as url:
            for name, prompt in prompt_sets.items():
                timed_completions(url, [prompt], args.max_tokens, ignore_eos=False)          # warm-up
                runs = []
                for _ in range(args.repeats):
                    seconds, [response] = timed_completions(url, [prompt], args.max_tokens, ignore_eos=False)
                    runs.append(response["usage"]["completion_tokens"] / seconds)
                rates[name][variant] = statistics.median(runs)
    for name, pair in rates.items():
        print(f"{name:>10}: llama.cpp plain {pair['plain']:.1f} tok/s, llama.cpp {args.llama_spec!r} "
              f"{pair['spec']:.1f} tok/s")
    return rates


def edit_context(tokenizer: Tokenizer, rng: random.Random, context_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt, answer) token ids: an edit prompt quoting about half the context, the answer its copy."""
    passages, answer = edit_prompts(rng, context_tokens // 2, None), []
    while len(answer) < context_tokens // 2:                   # NOTE: a short file gives a short passage: add more
        passage = next(passages).split("\n\n", 1)[-1]
        answer += tokenizer.encode(passage + "\n", add_special_tokens=False)
    text = tokenizer.decode(answer)
    return tokenizer.encode_chat([{"role": "user", "content": f"Repeat this exactly:\n\n{text}"}]), answer


def proposer_cpu(args: argparse.Namespace, calls: int = 200) -> dict:
    """{variant: CPU microseconds per proposer call, median and p99}: `calls` decode steps of one row whose
    answer so far grows by the copied passage (every call sees one more token), after 10 earlier requests'
    answers went into the suffix cache."""
    tokenizer = Tokenizer.from_dir(resolve_model(args.model).path)
    rng, results = random.Random(args.seed), {}
    contexts = [edit_context(tokenizer, rng, args.context_tokens) for _ in range(11)]
    prompt, answer = contexts[-1]
    start = max(1, min(len(answer), args.context_tokens - len(prompt)) - calls)
    for name, text in variants(args.variant).items():
        speculator = Speculator(SpeculativeConfig.from_json(text))
        for i, (_, earlier) in enumerate(contexts[:-1]):
            speculator.retire(Sequence(Request(f"old{i}", (0,), SamplingParams()), list(earlier)))
        seq = Sequence(Request("row", tuple(prompt), SamplingParams(max_tokens=1 << 20, temperature=0.0)),
                       list(answer[:start]))
        spent = []
        for token in answer[start:start + calls]:
            began = time.thread_time()
            speculator.drafts(seq, 64)
            spent.append(time.thread_time() - began)
            seq.output_token_ids.append(token)
        spent.sort()
        results[name] = {"context_tokens": seq.num_tokens, "calls": len(spent),
                         "median_us": 1e6 * statistics.median(spent), "p99_us": 1e6 * spent[int(0.99 * (len(spent) - 1))]}
        print(f"{name:>10}: proposer {results[name]['median_us']:.0f} us median, {results[name]['p99_us']:.0f} us p99 "
              f"CPU per call at {seq.num_tokens} context tokens ({len(spent)} calls)")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="as pdserve's --model (default: smollm2 when installed)")
    parser.add_argument("--mode", default="colocated", choices=("colocated", "disaggregated", "adaptive"))
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--variant", action="append", default=None, metavar="NAME=JSON",
                        help="a speculative config to compare with plain decoding (repeatable; default: "
                             "n-gram as measured before, and suffix)")
    parser.add_argument("--keep-cache", action="store_true",
                        help="leave the warm-up's answer in the suffix cache (a repeated request's case)")
    parser.add_argument("--proposer-cpu", action="store_true", help="time the proposers alone (no engine)")
    parser.add_argument("--context-tokens", type=int, default=2048, help="context length for --proposer-cpu")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--passage-tokens", type=int, default=300, help="size of the passage the edit prompt quotes")
    parser.add_argument("--dataset-path", default=str(DEFAULT_PASSAGE_FILE),
                        help="text file or folder the edit prompt's passage comes from")
    parser.add_argument("--quote-path", default=str(DEFAULT_QUOTE_FILE),
                        help="text file the quote prompt's prose passage comes from ('' for none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (default: on PATH)")
    parser.add_argument("--llama-gguf", default=None, help="the same weights as --model, for llama-server")
    parser.add_argument("--llama-spec", default="--spec-type ngram-simple --spec-ngram-simple-size-n 3 "
                                                "--spec-ngram-simple-size-m 4",
                        help="llama-server's speculation flags for its 'spec' run")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    args = parser.parse_args(argv)
    if args.proposer_cpu:
        results = proposer_cpu(args)
    else:
        results = run(args)
    if args.proposer_cpu:
        pass
    elif args.llama_gguf:
        results["llama.cpp"] = llama_cpp_rates(args, results.pop("_prompts"))
    else:
        results.pop("_prompts")
    if args.result_json:
        with open(args.result_json, "wb") as f:
            f.write(orjson.dumps({"args": vars(args), "results": results}, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
