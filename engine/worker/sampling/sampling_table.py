"""Per-row sampling state kept by the runner: parameters as arrays, penalty counts on the device.

A step's `SamplingBatch` is gathered from these arrays with numpy indexing, so building it costs
no Python per row; penalised rows keep their token counts on the device and update them with one
scatter per step, instead of re-tensorising their whole history.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.core.sampling_params import SamplingParams

_FIELDS = {"greedy": bool, "temperature": np.float32, "top_k": np.int64, "top_p": np.float32,
           "min_p": np.float32, "seed": np.int64, "seeded": bool, "penalised": bool,
           "repetition": np.float32, "frequency": np.float32, "presence": np.float32,
           "logprobs": np.int32, "min_tokens": np.int32, "num_outputs": np.int32, "penalty_slot": np.int32}


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Everything the sampler needs for B rows, on the logits' device (the knob tensors are None when
    `plain_greedy`: argmax needs none of them)."""

    num_rows: int
    plain_greedy: bool                  # argmax alone: no filters, logprobs, masks or penalties
    all_greedy: bool
    greedy: torch.Tensor | None         # [B] bool
    temperature: torch.Tensor | None    # [B] fp32, 1 for greedy rows
    top_k: torch.Tensor | None          # [B] long, vocab_size when disabled
    top_p: torch.Tensor | None          # [B] fp32
    min_p: torch.Tensor | None          # [B] fp32
    max_top_k: int | None               # None: no row uses top-k
    use_top_p: bool
    use_min_p: bool
    seeded_rows: torch.Tensor | None    # [R] long: random rows with a seed
    seeds: torch.Tensor | None          # [R] long
    positions: torch.Tensor | None      # [R] long: output position being sampled
    any_unseeded: bool                  # some random row draws from the default generator
    stop_mask: torch.Tensor | None      # [2, n] long (row, token) set to -inf: min_tokens not reached
    penalty_rows: torch.Tensor | None   # [P] long
    output_counts: torch.Tensor | None  # [P, V] fp32
    prompt_seen: torch.Tensor | None    # [P, V] bool
    penalties: torch.Tensor | None      # [P, 3] fp32: repetition, frequency, presence
    logprob_rows: tuple[int, ...]       # rows that asked for logprobs
    logprob_counts: tuple[int, ...]     # their number of top alternatives


class SamplingTable:
    """Sampling parameters and penalty state of every row of one runner."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device) -> None:
        self.vocab_size, self.eos_token_ids, self.device = vocab_size, frozenset(eos_token_ids), device
        self.arrays = {name: np.zeros(0, dtype=dtype) for name, dtype in _FIELDS.items()}
        self.stop_ids: list[tuple[int, ...]] = []
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free_slots: list[int] = []

    def add(self, row: int, params: SamplingParams, prompt: Sequence[int], outputs: Sequence[int]) -> None:
        self._ensure(row + 1)
        a, vocab = self.arrays, self.vocab_size
        greedy = params.greedy
        values = {"greedy": greedy, "temperature": 1.0 if greedy else params.temperature,
                  "top_k": params.top_k if not greedy and 0 < params.top_k < vocab else vocab,
                  "top_p": 1.0 if greedy else params.top_p, "min_p": 0.0 if greedy else params.min_p,
                  "seed": params.seed or 0, "seeded": params.seed is not None and not greedy,
                  "penalised": params.has_penalties, "repetition": params.repetition_penalty,
                  "frequency": params.frequency_penalty, "presence": params.presence_penalty,
                  "logprobs": -1 if params.logprobs is None else params.logprobs,
                  "min_tokens": params.min_tokens, "num_outputs": len(outputs), "penalty_slot": -1}
        for name, value in values.items():
            a[name][row] = value
        stops = self.eos_token_ids.union(params.stop_token_ids)
        self.stop_ids[row] = tuple(t for t in sorted(stops) if t < vocab)
        if params.has_penalties:
            a["penalty_slot"][row] = self._penalty_slot(prompt, outputs)

    def free(self, row: int) -> None:
        slot = int(self.arrays["penalty_slot"][row])
        if slot >= 0:
            self._free_slots.append(slot)
            self.arrays["penalty_slot"][row] = -1

    def record(self, rows: np.ndarray, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled for `rows` (tokens [S'] on the device, not read back)."""
        self.arrays["num_outputs"][rows] += 1
        slots = self.arrays["penalty_slot"][rows]
        penalised = slots >= 0
        if penalised.any():
            index = torch.from_numpy(slots[penalised].astype(np.int64)).to(self.device)
            chosen = tokens[torch.from_numpy(np.flatnonzero(penalised)).to(self.device)]
            self.output_counts.index_put_((index, chosen.long()), torch.ones_like(chosen, dtype=torch.float32),
                                          accumulate=True)

    def batch(self, rows: np.ndarray, ahead: np.ndarray | None = None) -> SamplingBatch:
        """The SamplingBatch of `rows` (host int array), one entry per row in order.

        `ahead[i]`: entry i samples that many outputs past the row's recorded ones (a draft position;
        its penalty counts are the caller's to add)."""
        if self._plain_greedy(rows):
            return _plain_greedy_batch(len(rows))
        a = {name: values[rows] for name, values in self.arrays.items()}
        if ahead is not None:
            a["num_outputs"] = a["num_outputs"] + ahead
        below_min = a["num_outputs"] < a["min_tokens"]
        random = ~a["greedy"]
        plain = not (random.any() or a["penalised"].any() or below_min.any() or (a["logprobs"] >= 0).any())
        to = self._tensor
        seeded = np.flatnonzero(a["seeded"])
        top_k = a["top_k"][a["top_k"] < self.vocab_size]
        logprob_rows = np.flatnonzero(a["logprobs"] >= 0)
        penalty_rows = np.flatnonzero(a["penalised"])
        slots = a["penalty_slot"][penalty_rows].astype(np.int64)
        return SamplingBatch(
            num_rows=len(rows), plain_greedy=plain, all_greedy=not random.any(),
            greedy=to(a["greedy"]), temperature=to(a["temperature"]), top_k=to(a["top_k"]),
            top_p=to(a["top_p"]), min_p=to(a["min_p"]),
            max_top_k=int(top_k.max()) if len(top_k) else None,
            use_top_p=bool((a["top_p"] < 1.0).any()), use_min_p=bool((a["min_p"] > 0.0).any()),
            seeded_rows=to(seeded) if len(seeded) else None,
            seeds=to(a["seed"][seeded]) if len(seeded) else None,
            positions=to(a["num_outputs"][seeded].astype(np.int64)) if len(seeded) else None,
            any_unseeded=bool((random & ~a["seeded"]).any()),
            stop_mask=self._stop_mask(rows, np.flatnonzero(below_min)),
            penalty_rows=to(penalty_rows) if len(penalty_rows) else None,
            output_counts=self.output_counts[to(slots)] if len(slots) else None,
            prompt_seen=self.prompt_seen[to(slots)] if len(slots) else None,
            penalties=to(np.stack([a["repetition"], a["frequency"], a["presence"]], 1)[penalty_rows])
            if len(penalty_rows) else None,
            logprob_rows=tuple(logprob_rows.tolist()), logprob_counts=tuple(a["logprobs"][logprob_rows].tolist()))

    def _plain_greedy(self, rows: np.ndarray) -> bool:
        a = self.arrays
        return bool(a["greedy"][rows].all() and not a["penalised"][rows].any() and (a["logprobs"][rows] < 0).all()
                    and (a["num_outputs"][rows] >= a["min_tokens"][rows]).all())

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(values))
        return tensor.to(self.device, non_blocking=True) if self.device.type != "cpu" else tensor

    def _stop_mask(self, rows: np.ndarray, masked: np.ndarray) -> torch.Tensor | None:
        pairs = [(i, t) for i in masked.tolist() for t in self.stop_ids[rows[i]]]
        if not pairs:
            return None
        return torch.tensor(pairs, dtype=torch.long).T.to(self.device)

    def _penalty_slot(self, prompt: Sequence[int], outputs: Sequence[int]) -> int:
        if not self._free_slots:
            self._grow_penalty_pool()
        slot = self._free_slots.pop()
        self.output_counts[slot] = token_counts(outputs, self.vocab_size, self.device)
        self.prompt_seen[slot] = token_counts(prompt, self.vocab_size, self.device) > 0
        return slot

    def _grow_penalty_pool(self) -> None:
        old = self.output_counts.shape[0]
        new = max(4, 2 * old)
        self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(new - old, self.vocab_size)])
        self.prompt_seen = torch.cat([self.prompt_seen, self.prompt_seen.new_zeros(new - old, self.vocab_size)])
        self._free_slots += range(new - 1, old - 1, -1)

    def _ensure(self, rows: int) -> None:
        capacity = len(self.stop_ids)
        if rows <= capacity:
            return
        capacity = max(rows, 2 * capacity, 16)
        for name, values in self.arrays.items():
            grown = np.zeros(capacity, dtype=values.dtype)
            grown[:len(values)] = values
            self.arrays[name] = grown
        self.stop_ids += [()] * (capacity - len(self.stop_ids))


def _plain_greedy_batch(num_rows: int) -> SamplingBatch:
    """Argmax rows only: the sampler reads nothing else."""
    return SamplingBatch(num_rows=num_rows, plain_greedy=True, all_greedy=True, greedy=None, temperature=None,
                         top_k=None, top_p=None, min_p=None, max_top_k=None, use_top_p=False, use_min_p=False,
                         seeded_rows=None, seeds=None, positions=None, any_unseeded=False, stop_mask=None,
                         penalty_rows=None, output_counts=None, prompt_seen=None, penalties=None,
                         logprob_rows=(), logprob_counts=())


def token_counts(token_ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each vocabulary id occurs in `token_ids`: [vocab_size] fp32 (ids >= vocab_size ignored)."""
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    return torch.bincount(ids, minlength=vocab_size).to(torch.float32).to(device)
