"""Shared helpers for the kernel tests: paged batches, naive attention, NaN-poisoned outputs."""
from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from pathlib import Path

import torch


def request_triton_interpreter() -> None:
    """Ask for TRITON_INTERPRET=1 where there is no GPU; effective only if triton is not imported yet."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def run_interpreted(test_file: str) -> None:
    """Run the tests of `test_file` in a fresh pytest process with TRITON_INTERPRET=1 (Triton fixes that choice
    when it is imported, so a process that imported it otherwise cannot run them) and assert that they passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": "."}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                            cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]

NUM_LAYERS = 2
LAYER = 1


def make_paged_batch(context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: str = "cpu", filler: int = -1, seed: int = 0):
    """A random pool with each sequence's blocks at shuffled ids; returns (pool, block_tables, lens)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    width = max(blocks_per_seq + [1]) + 1
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim, generator=gen)
    block_ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(context_lens), width), filler, dtype=torch.int32)
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = block_ids[used:used + count]
        used += count
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return pool.to(device=device, dtype=dtype), tables.to(device), lens.to(device)


def naive_kv(pool: torch.Tensor, tables: torch.Tensor, seq: int, position: int, kv_head: int):
    block_size = pool.shape[3]
    block = int(tables[seq, position // block_size])
    row = pool[block, LAYER, :, position % block_size, kv_head].double()
    return row[0], row[1]


def naive_attention(q_row: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, seq: int,
                    kv_head: int, num_visible: int, scale: float, window: int = 0, softcap: float = 0.0,
                    sink: float | None = None) -> torch.Tensor:
    """One query vector against positions [0, num_visible) of one sequence (its last `window` of them when
    window > 0), plain loops + softmax; scores soft-capped when softcap > 0; `sink` joins the denominator."""
    scores, values = [], []
    for position in range(max(0, num_visible - window) if window else 0, num_visible):
        k, v = naive_kv(pool, tables, seq, position, kv_head)
        score = float(q_row.double() @ k) * scale
        scores.append(softcap * math.tanh(score / softcap) if softcap else score)
        values.append(v)
    peak = max(scores + ([] if sink is None else [sink]))
    weights = [math.exp(s - peak) for s in scores]
    total = sum(weights) + (0.0 if sink is None else math.exp(sink - peak))
    return sum(w / total * v for w, v in zip(weights, values))


def naive_decode(q, pool, tables, lens, scale, window=0, softcap=0.0, sinks=None):
    num_seqs, num_q_heads, _ = q.shape
    group = num_q_heads // pool.shape[4]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for seq in range(num_seqs):
        for head in range(num_q_heads):
            if int(lens[seq]):
                out[seq, head] = naive_attention(q[seq, head], pool, tables, seq, head // group, int(lens[seq]),
                                                 scale, window, softcap, None if sinks is None else float(sinks[head]))
    return out


def naive_prefill(q, pool, tables, cu_seqlens, lens, scale, window=0, softcap=0.0, sinks=None):
    num_q_heads = q.shape[1]
    group = num_q_heads // pool.shape[4]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for seq in range(len(lens)):
        start, end, total = int(cu_seqlens[seq]), int(cu_seqlens[seq + 1]), int(lens[seq])
        for i in range(end - start):
            visible = total - (end - start) + i + 1
            for head in range(num_q_heads):
                out[start + i, head] = naive_attention(q[start + i, head], pool, tables, seq, head // group,
                                                       visible, scale, window, softcap,
                                                       None if sinks is None else float(sinks[head]))
    return out


def cu_seqlens_of(q_lens: list[int], device: str = "cpu") -> torch.Tensor:
    bounds = [0]
    for n in q_lens:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


@contextlib.contextmanager
def poisoned_outputs():
    """Within the block, torch.empty / torch.empty_like return NaN-filled float tensors."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **k: poison(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like
