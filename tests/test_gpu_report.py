"""bench/gpu_check.sh's table: a part that fails or times out shows so, and the others still report."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from pdserve.bench.gpu_report import report


def test_a_timed_out_part_is_marked_and_the_others_still_report(tmp_path):
    (tmp_path / "parts.tsv").write_text("gpu tests\t1\t80\t110\nkernel benchmark\t124\t70\t70\n"
                                        "parity\t0\t30\t70\nfirst request\t0\t40\t85\n")
    (tmp_path / "gpu_parity.json").write_text(json.dumps({"rows": [
        {"mode": "colocated", "device": "cuda:0", "sequences": 5, "identical": 5, "first_difference": [None] * 5},
        {"mode": "disaggregated", "device": "cuda:0", "sequences": 5, "identical": 4,
         "first_difference": [None, None, 17, None, None]}]}))
    (tmp_path / "first_request.json").write_text(json.dumps({
        "ready_seconds": 31.0, "first_over_last": 1.1, "meets_target": True,
        "requests": [{"ttft_ms": 22.0}] + [{"ttft_ms": 5.0}] * 8 + [{"ttft_ms": 20.0}]}))
    text, data = report(tmp_path)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["kernel benchmark"].endswith("TIMEOUT after 70 s |")
    assert rows["CUDA-graph decode vs eager"].endswith("not run |")
    assert "4/5 sequences identical" in rows["disaggregated on cuda:0 vs CPU, greedy fp32"]
    assert rows["disaggregated on cuda:0 vs CPU, greedy fp32"].endswith("MISS |")
    assert rows["TTFT of request 1 vs 10 after READY"].endswith("ok |")
    assert rows["GPU tests (`pytest -m gpu`)"].endswith("FAILED (exit 1) |")
    assert data["parts"]["kernel benchmark"]["rc"] == 124


def test_the_check_script_parses_and_lints():
    assert subprocess.run(["bash", "-n", "bench/gpu_check.sh"]).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    result = subprocess.run(["shellcheck", "bench/gpu_check.sh"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
