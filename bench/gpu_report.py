"""The one results table of bench/gpu_check.sh, from the files its parts left in one folder.

    python -m pdserve.bench.gpu_report --raw DIR --out OUT

Reads DIR/parts.tsv (part, exit status, seconds, limit), DIR/gpu_tests.xml and the JSON files of
the benchmarks; writes OUT/gpu_check.md (the table for bench/RESULTS.md, section "GPU") and
OUT/gpu_check.json (everything it read), and prints the table. A part that failed or ran out of
time shows so in its rows instead of hiding the others.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import xml.etree.ElementTree as ElementTree
from pathlib import Path

PARTS = {"gpu tests": None, "kernel benchmark": "kernel_bench.json", "graph decode": "decode_graph_bench.json",
         "parity": "gpu_parity.json", "kv transfer": "transfer_bench.json", "first request": "first_request.json"}


def read_parts(raw: Path) -> dict[str, dict]:
    path = raw / "parts.tsv"
    if not path.exists():
        return {}
    rows = csv.reader(path.read_text().splitlines(), delimiter="\t")
    return {name: {"rc": int(rc), "seconds": int(seconds), "limit": int(limit)} for name, rc, seconds, limit in rows}


def part_status(parts: dict, name: str) -> str:
    part = parts.get(name)
    if part is None:
        return "not run"
    if part["rc"] in (124, 137):
        return f"TIMEOUT after {part['limit']} s"
    return "ran" if part["rc"] == 0 else f"FAILED (exit {part['rc']})"


def load(raw: Path, name: str | None):
    if name is None or not (raw / name).exists():
        return None
    return json.loads((raw / name).read_text())


def test_rows(raw: Path, status: str) -> list[list[str]]:
    path = raw / "gpu_tests.xml"
    if not path.exists():
        return [["GPU tests (`pytest -m gpu`)", "no report", "all pass", status]]
    suite = ElementTree.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    bad = counts["failures"] + counts["errors"]
    text = f"{passed} passed, {bad} failed, {counts['skipped']} skipped"
    return [["GPU tests (`pytest -m gpu`)", text, "all pass", "ok" if bad == 0 and passed else "MISS"]]


def kernel_rows(result: dict | None, status: str) -> list[list[str]]:
    if result is None:
        return [["kernel benchmark", "-", "-", status]]
    ceilings = result["ceilings"]
    copy, flops = ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"]
    rows = [["copy ceiling / matmul ceiling (measured)", f"{copy / 1e9:.4g} GB/s / {flops / 1e12:.3g} TFLOP/s",
             "-", "-"]]
    for row in result["rows"]:
        rate = row["rate_triton"] if row["triton_ms"] is not None else row["rate_torch"]
        unit, scale = ("GB/s", 1e9) if row["bound"] == "bandwidth" else ("TFLOP/s", 1e12)
        target = "-" if row["target_fraction"] is None else f">= {row['target_fraction']:.0%} of ceiling"
        verdict = "-" if row["meets_target"] is None else "ok" if row["meets_target"] else "MISS"
        rows.append([f"{row['name']} ({row['shape']})", f"{rate / scale:.4g} {unit} = "
                     f"{row['fraction_of_ceiling']:.0%} of ceiling", target, verdict])
    return rows


def graph_rows(result: dict | None, status: str) -> list[list[str]]:
    if result is None:
        return [["CUDA-graph decode vs eager", "-", ">= 3x at batch 1", status]]
    rows = []
    for row in result["rows"]:
        speedup = row["speedup"]
        verdict = "-" if speedup is None or row["batch"] != 1 else "ok" if speedup >= 3.0 else "MISS"
        measured = f"eager {row['eager_ms']:.2f} ms" + ("" if speedup is None else
                                                        f", graph {row['graph_ms']:.2f} ms: {speedup:.1f}x")
        rows.append([f"decode step, batch {row['batch']}, context {row['context']}", measured,
                     ">= 3x" if row["batch"] == 1 else "-", verdict])
    return rows


def parity_rows(result: dict | None, status: str) -> list[list[str]]:
    if result is None:
        return [["both modes on one GPU vs CPU, greedy", "-", "identical", status]]
    return [[f"{row['mode']} on {row['device']} vs CPU, greedy fp32", f"{row['identical']}/{row['sequences']} "
             f"sequences identical (first differences {row['first_difference']})", "identical",
             "ok" if row["identical"] == row["sequences"] else "MISS"] for row in result["rows"]]


def transfer_rows(result: dict | None, status: str) -> list[list[str]]:
    if result is None:
        return [["KV copy", "-", "-", status]]
    where = f"{result['src']} -> {result['dst']} (peers: {result['peer_access']})"
    rows = []
    for row in result["rows"]:
        measured = f"skipped: {row['skipped']}" if "skipped" in row else f"{row['gb_per_s']:.1f} GB/s".replace(
            "nan GB/s", "not measured off CUDA")
        verdict = "-" if "skipped" in row else "ok" if row["exact"] else "MISS (bytes differ)"
        rows.append([f"KV copy {where}, {row['backend']}", measured, "bytes exact", verdict])
    return rows


def first_request_rows(result: dict | None, status: str) -> list[list[str]]:
    if result is None:
        return [["TTFT of the first request after READY", "-", "<= 2x the last's", status]]
    requests = result["requests"]
    measured = (f"READY in {result['ready_seconds']:.0f} s; TTFT first {requests[0]['ttft_ms']:.1f} ms, "
                f"last {requests[-1]['ttft_ms']:.1f} ms ({result['first_over_last']:.2f}x)")
    return [[f"TTFT of request 1 vs {len(requests)} after READY", measured, "<= 2x",
             "ok" if result["meets_target"] else "MISS"]]


def report(raw: Path) -> tuple[str, dict]:
    parts = read_parts(raw)
    data = {name: load(raw, file) for name, file in PARTS.items()}
    status = {name: part_status(parts, name) for name in PARTS}
    rows = (test_rows(raw, status["gpu tests"]) + kernel_rows(data["kernel benchmark"], status["kernel benchmark"])
            + graph_rows(data["graph decode"], status["graph decode"]) + parity_rows(data["parity"], status["parity"])
            + transfer_rows(data["kv transfer"], status["kv transfer"])
            + first_request_rows(data["first request"], status["first request"]))
    timing = ", ".join(f"{name} {p['seconds']} s ({part_status(parts, name)})" for name, p in parts.items())
    lines = [f"## GPU check, {datetime.date.today().isoformat()}: {_device()}", "",
             f"Command: `bash bench/gpu_check.sh`. Parts: {timing or 'none recorded'}.", "",
             "| check | measured | target | status |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n", {"parts": parts, **data}


def _device() -> str:
    try:
        import torch
        import triton

        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
        return f"{name}, torch {torch.__version__}, triton {triton.__version__}"
    except Exception as exc:  # NOTE: the report must come out even when the stack does not import
        return f"device unknown ({type(exc).__name__})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--raw", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    text, data = report(Path(args.raw))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.md").write_text(text)
    (out / "gpu_check.json").write_text(json.dumps(data, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
