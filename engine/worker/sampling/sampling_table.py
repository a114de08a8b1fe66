"""Per-row sampling state kept by the runner: parameters resident on the device, flags and counts on the host.

A row's parameters are written to device-resident tables when the row joins (one pinned upload of
the rows added since the last step), so a step's `SamplingBatch` is two `index_select`s on the
device plus host flags read from one bitfield per row (vLLM's persistent batch). Output counts
live on the host (a step's count is known when it is launched; a verifying row's once its tokens
are read back, before the row is scheduled again). Penalised rows keep their token counts on the
device and update them with one scatter per step, instead of re-tensorising their whole history.
Nothing here makes the host wait for the GPU.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.transfer.host_copy import upload

_FIELDS = {"greedy": bool, "temperature": np.float32, "top_k": np.int64, "top_p": np.float32,
           "min_p": np.float32, "seed": np.int64, "seeded": bool, "penalised": bool,
           "repetition": np.float32, "frequency": np.float32, "presence": np.float32,
           "logprobs": np.int32, "min_tokens": np.int32, "num_outputs": np.int32, "penalty_slot": np.int32,
           "kind": np.int32}
_FLOATS = ("temperature", "top_p", "min_p", "repetition", "frequency", "presence")   # columns of the device tables
_INTS = ("greedy", "top_k", "seed")

# bits of a row's "kind": what its sampling needs
RANDOM, PENALISED, LOGPROBS, TOP_K, TOP_P, MIN_P, SEEDED, UNSEEDED, MIN_TOKENS = (1 << i for i in range(9))
_NOT_PLAIN = RANDOM | PENALISED | LOGPROBS
MIN_TEMPERATURE = 1e-2      # vLLM's floor: logits divided by less can overflow float32 and the softmax gives NaN


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
    logprob_index: torch.Tensor | None = None     # [R] long: logprob_rows on the device
    penalty_entries: np.ndarray | None = None     # [P]: penalty_rows on the host


class SamplingTable:
    """Sampling parameters and penalty state of every row of one runner."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device) -> None:
        self.vocab_size, self.eos_token_ids, self.device = vocab_size, frozenset(eos_token_ids), device
        self.arrays = {name: np.zeros(0, dtype=dtype) for name, dtype in _FIELDS.items()}
        self.stop_ids: list[tuple[int, ...]] = []
        self.floats = torch.zeros(0, len(_FLOATS), dtype=torch.float32, device=device)   # [rows, 6], _FLOATS
        self.ints = torch.zeros(0, len(_INTS), dtype=torch.int64, device=device)          # [rows, 3], _INTS
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free_slots: list[int] = []
        self._joined: dict[int, None] = {}       # rows added since their parameters were last uploaded
        self._knobs = self._host_knobs if device.type == "cpu" else self._device_knobs    # NOTE: chosen once

    def add(self, row: int, params: SamplingParams, prompt: Sequence[int], outputs: Sequence[int]) -> None:
        self._ensure(row + 1)
        a, vocab = self.arrays, self.vocab_size
        greedy = params.greedy
        values = {"greedy": greedy, "temperature": 1.0 if greedy else max(params.temperature, MIN_TEMPERATURE),
                  "top_k": params.top_k if not greedy and 0 < params.top_k < vocab else vocab,
                  "top_p": 1.0 if greedy else params.top_p, "min_p": 0.0 if greedy else params.min_p,
                  "seed": params.seed or 0, "seeded": params.seed is not None and not greedy,
                  "penalised": params.has_penalties, "repetition": params.repetition_penalty,
                  "frequency": params.frequency_penalty, "presence": params.presence_penalty,
                  "logprobs": -1 if params.logprobs is None else params.logprobs,
                  "min_tokens": params.min_tokens, "num_outputs": len(outputs), "penalty_slot": -1}
        for name, value in values.items():
            a[name][row] = value
        a["kind"][row] = _kind(values, vocab)
        stops = self.eos_token_ids.union(params.stop_token_ids)
        self.stop_ids[row] = tuple(t for t in sorted(stops) if t < vocab)
        if params.has_penalties:
            a["penalty_slot"][row] = self._penalty_slot(prompt, outputs)
        if self.device.type != "cpu":
            self._joined[row] = None

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
            index = upload(slots[penalised].astype(np.int64), self.device)
            chosen = tokens[upload(np.flatnonzero(penalised), self.device)]
            self.output_counts.index_put_((index, chosen.long()), torch.ones_like(chosen, dtype=torch.float32),
                                          accumulate=True)

    def record_emitted(self, rows: np.ndarray, emitted: torch.Tensor, counts: torch.Tensor) -> None:
        """Count on the device the tokens verifying `rows` emitted: emitted [R, L] long, the first
        counts[r] of row r valid (counts [R] long, on the device). The host's counts follow later, at
        `settle_emitted`, once the counts are read back (nothing reads them for these rows before)."""
        slots = self.arrays["penalty_slot"][rows]
        penalised = np.flatnonzero(slots >= 0)
        if len(penalised):
            width = emitted.shape[1]
            index = upload(np.repeat(slots[penalised].astype(np.int64), width), self.device)
            picked = upload(penalised, self.device)
            valid = torch.arange(width, device=emitted.device) < counts[picked].unsqueeze(1)    # [P, L]
            self.output_counts.index_put_((index, emitted[picked].flatten()), valid.flatten().float(),
                                          accumulate=True)

    def settle_emitted(self, rows: np.ndarray, counts: Sequence[int]) -> None:
        """The host side of `record_emitted`, with the counts read back."""
        np.add.at(self.arrays["num_outputs"], rows, np.asarray(counts, dtype=np.int32))

    def batch(self, rows: np.ndarray, ahead: np.ndarray | None = None,
              device_rows: torch.Tensor | None = None) -> SamplingBatch:
        """The SamplingBatch of `rows` (host int array), one entry per row in order.

        `ahead[i]`: entry i samples that many outputs past the row's recorded ones (a draft position;
        its penalty counts are the caller's to add). `device_rows`: `rows` on the device, if at hand."""
        a = self.arrays
        kinds = a["kind"][rows]
        kind = int(np.bitwise_or.reduce(kinds)) if len(kinds) else 0
        outputs = a["num_outputs"][rows] if ahead is None else a["num_outputs"][rows] + ahead
        below_min = np.flatnonzero(outputs < a["min_tokens"][rows]) if kind & MIN_TOKENS else np.zeros(0, np.int64)
        if not kind & _NOT_PLAIN and not len(below_min):
            return _plain_greedy_batch(len(rows))
        seeded = np.flatnonzero(kinds & SEEDED) if kind & SEEDED else ()
        seeded_rows = upload(seeded, self.device, np.int64) if len(seeded) else None
        top_k = a["top_k"][rows] if kind & TOP_K else None
        logprob_rows = np.flatnonzero(kinds & LOGPROBS) if kind & LOGPROBS else np.zeros(0, np.int64)
        penalty_rows = np.flatnonzero(kinds & PENALISED) if kind & PENALISED else ()
        slots = upload(a["penalty_slot"][rows[penalty_rows]], self.device, np.int64) if len(penalty_rows) else None
        penalty_index = upload(penalty_rows, self.device, np.int64) if len(penalty_rows) else None
        knobs = self._knobs(rows, device_rows, seeded, seeded_rows, penalty_rows, penalty_index)
        return SamplingBatch(
            num_rows=len(rows), plain_greedy=False, all_greedy=not kind & RANDOM, **knobs,
            max_top_k=int(top_k[top_k < self.vocab_size].max()) if top_k is not None else None,
            use_top_p=bool(kind & TOP_P), use_min_p=bool(kind & MIN_P), seeded_rows=seeded_rows,
            positions=upload(outputs[seeded], self.device, np.int64) if len(seeded) else None,
            any_unseeded=bool(kind & UNSEEDED),
            stop_mask=self._stop_mask(rows, below_min),
            penalty_rows=penalty_index,
            output_counts=self.output_counts[slots] if slots is not None else None,
            prompt_seen=self.prompt_seen[slots] if slots is not None else None,
            logprob_rows=tuple(logprob_rows.tolist()), logprob_counts=tuple(a["logprobs"][rows[logprob_rows]].tolist()),
            logprob_index=upload(logprob_rows, self.device, np.int64) if len(logprob_rows) else None,
            penalty_entries=np.asarray(penalty_rows, dtype=np.int64) if len(penalty_rows) else None)

    def _device_knobs(self, rows, device_rows, seeded, seeded_rows, penalty_rows, penalty_index) -> dict:
        """The per-row knobs gathered on the device from the resident tables (CUDA)."""
        self._upload_joined()
        if device_rows is None:
            device_rows = upload(rows.astype(np.int64), self.device)
        floats, ints = self.floats[device_rows], self.ints[device_rows]       # [B, 6], [B, 3]
        return dict(greedy=ints[:, 0].bool(), temperature=floats[:, 0], top_k=ints[:, 1], top_p=floats[:, 1],
                    min_p=floats[:, 2], seeds=ints[seeded_rows, 2] if len(seeded) else None,
                    penalties=floats[penalty_index, 3:6] if penalty_index is not None else None)

    def _host_knobs(self, rows, device_rows, seeded, seeded_rows, penalty_rows, penalty_index) -> dict:
        """The per-row knobs gathered from the host arrays, as tensors sharing their memory (CPU)."""
        a = {name: self.arrays[name][rows] for name in ("greedy", "temperature", "top_k", "top_p", "min_p")}
        t = torch.from_numpy
        penalties = None
        if len(penalty_rows):
            picked = rows[penalty_rows]
            penalties = t(np.stack([self.arrays[n][picked] for n in ("repetition", "frequency", "presence")], 1))
        return dict(greedy=t(a["greedy"]), temperature=t(a["temperature"]), top_k=t(a["top_k"]), top_p=t(a["top_p"]),
                    min_p=t(a["min_p"]), seeds=t(self.arrays["seed"][rows[seeded]]) if len(seeded) else None,
                    penalties=penalties)

    def _upload_joined(self) -> None:
        """Write the parameters of rows added since the last step into the device tables (one upload each)."""
        if not self._joined:
            return
        rows = np.fromiter(self._joined, dtype=np.int64, count=len(self._joined))
        self._joined.clear()
        a = self.arrays
        floats = np.stack([a[name][rows] for name in _FLOATS], 1).astype(np.float32)
        ints = np.stack([a[name][rows].astype(np.int64) for name in _INTS], 1)
        index = upload(rows, self.device)
        self.floats[index] = upload(floats, self.device)
        self.ints[index] = upload(ints, self.device)

    def _stop_mask(self, rows: np.ndarray, masked: np.ndarray) -> torch.Tensor | None:
        pairs = [(i, t) for i in masked.tolist() for t in self.stop_ids[rows[i]]]
        if not pairs:
            return None
        return upload(np.array(pairs, dtype=np.int64).T, self.device)

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
        self.floats = torch.cat([self.floats, self.floats.new_zeros(capacity - len(self.floats), len(_FLOATS))])
        self.ints = torch.cat([self.ints, self.ints.new_zeros(capacity - len(self.ints), len(_INTS))])


def _kind(values: dict, vocab: int) -> int:
    """The bits of a row's sampling needs, from its table values."""
    random = not values["greedy"]
    bits = ((RANDOM, random), (PENALISED, values["penalised"]), (LOGPROBS, values["logprobs"] >= 0),
            (TOP_K, values["top_k"] < vocab), (TOP_P, values["top_p"] < 1.0), (MIN_P, values["min_p"] > 0.0),
            (SEEDED, values["seeded"]), (UNSEEDED, random and not values["seeded"]),
            (MIN_TOKENS, values["min_tokens"] > 0))
    return sum(bit for bit, on in bits if on)


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
    return upload(torch.bincount(ids, minlength=vocab_size).to(torch.float32).numpy(), device)
