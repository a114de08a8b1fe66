"""pdserve.bench.compare with pdserve variants: the --prefix-caching-ab preset's commands and defaults, and an
A/B run on the multi-turn workload against stub servers (one serves, one fails fast on its option)."""
from __future__ import annotations

import json
import sys

import pytest

from pdserve.bench import compare, loadtest, servers
from pdserve.bench.compare_report import TARGETS
from tests.test_bench_loadtest import _fake_spec

AB_TARGET = TARGETS[-1].what


def _shown(spec: servers.ServerSpec) -> str:
    return servers.display_command([part.replace("{port}", "9") for part in spec.argv])


def test_prefix_caching_ab_preset():
    args = compare.parse_args(["--prefix-caching-ab", "--pdserve-args", "--mode colocated"])
    assert (args.dataset_name, args.section, args.servers) == ("multiturn", "prefix-caching", "")
    on, off = compare.selected_specs(args, "/m")
    common = "pdserve serve --model /m --port 9 --prefill-device cpu --decode-device cpu --mode colocated"
    assert _shown(on) == f"{common} --enable-prefix-caching" and on.title == "pdserve prefix-caching-on"
    assert _shown(off) == f"{common} --no-enable-prefix-caching" and off.name == "prefix-caching-off"
    assert (TARGETS[-1].server, TARGETS[-1].references) == (on.name, (off.name,))
    plain = compare.parse_args([])
    assert (plain.dataset_name, plain.section, plain.servers.split(",")) == ("mixed", "default",
                                                                              list(servers.SERVER_NAMES))
    chosen = compare.parse_args(["--prefix-caching-ab", "--dataset-name", "random", "--section", "no shared"])
    assert (chosen.dataset_name, chosen.section) == ("random", "no shared")
    assert [a.result_json.rsplit("/", 1)[1] for a in (args, plain, chosen)] == [
        "compare_prefix_caching.json", "compare.json", "compare_no_shared.json"]
    assert args.plot.endswith("bench/out/compare_prefix_caching.png")
    assert args.report.endswith("bench/out/compare_prefix_caching.md")


def test_kv_tiers_ab_preset():
    args = compare.parse_args(["--kv-tiers-ab"])
    assert (args.dataset_name, args.section, args.servers) == ("multiturn", "kv-tiers", "")
    on, off = compare.selected_specs(args, "/m")
    common = f"pdserve serve --model /m --port 9 --prefill-device cpu --decode-device cpu {servers.KV_TIERS_POOL}"
    assert _shown(on) == (f"{common} --kv-offload-memory 2GiB --kv-offload-disk {args.kv_tiers_folder}:8GiB")
    assert _shown(off) == common and off.name == "kv-tiers-off"
    assert args.result_json.endswith("compare_kv_tiers.json")
    targets = {t.what: (t.server, t.references) for t in TARGETS}
    assert targets["turn >= 2 median TTFT with KV tiers <= 0.3 x without"] == (on.name, (off.name,))
    assert targets["output tok/s with KV tiers >= 0.97 x without"] == (on.name, (off.name,))
    never_evicts = compare.parse_args(["--kv-tiers-ab", "--pdserve-args", "--kv-cache-memory 2GiB"])
    assert _shown(compare.selected_specs(never_evicts, "/m")[1]).endswith("--kv-cache-memory 2GiB")


def test_variants_join_the_named_servers():
    args = compare.parse_args(["--servers", "pdserve-colocated", "--pdserve-variant", "big-blocks=--block-size 32"])
    colocated, big = compare.selected_specs(args, "/m")
    assert colocated.name == "pdserve-colocated" and _shown(big).endswith("--decode-device cpu --block-size 32")
    for bad in (["--pdserve-variant", "no-flags"], ["--pdserve-variant", "a/b=--x"],
                ["--pdserve-variant", "transformers=--x"], ["--pdserve-variant", "a=", "--pdserve-variant", "a=--y"],
                ["--servers", ""], ["--servers", "vllm"]):
        with pytest.raises(ValueError):
            compare.selected_specs(compare.parse_args(bad), "/m")


def test_llama_cpp_is_run_only_when_named_and_says_what_it_lacks(tmp_path):
    assert "llama.cpp" not in compare.parse_args([]).servers.split(",")
    binary, gguf = tmp_path / "llama-server", tmp_path / "model-f32.gguf"
    binary.write_text("#!/bin/sh\n")
    gguf.write_bytes(b"GGUF")
    [ready] = compare.selected_specs(compare.parse_args(
        ["--servers", "llama.cpp", "--llama-server", str(binary), "--llama-gguf", str(gguf), "--llama-slots", "4"]), "/m")
    assert not ready.unavailable
    assert _shown(ready).startswith(f"{binary} -m {gguf} -t ") and "-np 4 -kvu -ctk f32 -ctv f32" in _shown(ready)
    assert _shown(ready).endswith("--host 127.0.0.1 --port 9")
    [no_gguf] = compare.selected_specs(compare.parse_args(["--servers", "llama.cpp", "--llama-server", str(binary)]),
                                       "/m")
    assert "needs --llama-gguf" in no_gguf.unavailable
    [no_binary] = compare.selected_specs(compare.parse_args(
        ["--servers", "llama.cpp", "--llama-server", str(tmp_path / "none"), "--llama-gguf", str(gguf)]), "/m")
    assert "no llama-server binary" in no_binary.unavailable


FAILS_FAST = ("import sys; print('pdserve serve: error: unrecognized arguments: --no-enable-prefix-caching'); "
              "sys.exit(2)")


def _ab_args(tmp_path) -> tuple:
    args = compare.parse_args([
        "--prefix-caching-ab", "--num-conversations", "3", "--num-turns", "3", "--system-prompt-len", "20",
        "--user-message-len", "4", "--output-len", "3", "--request-rate", "inf", "--num-warmups", "1",
        "--disable-tqdm", "--result-json", str(tmp_path / "ab.json"), "--plot", str(tmp_path / "ab.png"),
        "--log-dir", str(tmp_path / "logs"), "--report", str(tmp_path / "ab.md"),
        "--server-timeout", "60"])
    return args, loadtest.options_from_args(args)


def test_ab_run_on_the_multiturn_workload(tmp_path):
    args, options = _ab_args(tmp_path)
    on = _fake_spec("prefix-caching-on", "pdserve prefix-caching-on", "ok")
    failing = servers.ServerSpec("prefix-caching-off", "pdserve prefix-caching-off", (sys.executable, "-c", FAILS_FAST))
    assert compare.run_comparison([on, failing], args, options, "MODEL", "python -m pdserve.bench.compare --ab") == 1
    document = json.loads((tmp_path / "ab.json").read_text())
    served, refused = document["servers"]
    assert served["ok"] and served["summary"]["completed"] == 9
    assert sorted(served["summary"]["turns"]) == ["1", "2", "3"]
    assert {(r["conversation"], r["turn"]) for r in served["requests"]} == {(c, t) for c in range(3) for t in (1, 2, 3)}
    assert served["summary"]["prefix_cache_hit_rate"] is None               # the stub has no /metrics
    assert "exited with code 2" in refused["error"] and "unrecognized arguments" in refused["error"]
    assert document["targets"][AB_TARGET] == "n/a (pdserve prefix-caching-off failed)"
    section = (tmp_path / "ab.md").read_text()
    assert "# Serving comparison (prefix-caching): pdserve prefix-caching-on vs pdserve prefix-caching-off" in section
    assert "| turn 3 median TTFT (ms) |" in section and "3 conversations at inf conv/s" in section
    assert "transformers serve never sends" not in section

    off = _fake_spec("prefix-caching-off", "pdserve prefix-caching-off", "ok")
    assert compare.run_comparison([on, off], args, options, "MODEL", "python -m pdserve.bench.compare --ab") == 0
    verdict = json.loads((tmp_path / "ab.json").read_text())["targets"][AB_TARGET]
    assert " vs " in verdict and verdict.endswith("met")


def test_step_trace_gives_each_server_its_own_fresh_trace_file(tmp_path):
    spec = servers.ServerSpec("prefix-caching-off", "pdserve prefix-caching-off", ("pdserve", "serve"))
    old = tmp_path / "prefix-caching-off.steps.jsonl"
    old.write_text('{"step": 1}\n')                          # a trace of an earlier run
    traced = compare.parse_args(["--step-trace"])
    assert compare._step_trace(spec, traced, tmp_path) == {"PDSERVE_STEP_TRACE": str(old)} and not old.exists()
    assert compare._step_trace(spec, compare.parse_args([]), tmp_path) == {}
