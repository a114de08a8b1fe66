"""The draft model of `--speculative-config '{"method": "draft_model", "model": PATH}'`: a smaller model with
the target's vocabulary that proposes each drafting row's next k tokens greedily, over its own paged KV.

It lives beside the decode unit's speculator, in the engine's process, on the decode unit's device: the
scheduler asks for drafts while it plans a step (no step of that unit is in flight then: speculation
turns async scheduling off), so thread and process workers alike get them without a new message. Its
forwards run on the unit's compute thread (thread workers: its cores, its CUDA stream, its OpenMP team),
or on a thread of its own beside a worker process's unit, never on the event loop's thread.

Per request it remembers how many of the request's tokens its KV holds (`cached`) and the drafts it fed
after them (`fed`). A proposal first keeps the fed drafts the request's tokens now confirm (the accepted
ones), so the positions of rejected drafts are rolled back; then one forward catches up on the tokens
not yet seen (the bonus token and any it did not feed), taking the first draft from its last position,
and k - 1 decode forwards feed each draft to get the next. Greedy drafts are deterministic given the
context, i.e. one-hot proposals, which the verification's rule accepts exactly (engine.worker.spec_verify).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from pdserve import kernels
from pdserve.engine.core.block_manager import BlockManager, NoFreeBlocks
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.forward_batch import ForwardBatch
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.model.resolve import resolve_model
from pdserve.engine.worker.memory import kv_layout
from pdserve.engine.worker.model_runner import load_model

FORWARD_DECAY = 0.9        # weight of the older measurements in the seconds of one draft forward


@dataclass(slots=True)
class DraftRow:
    """One request's draft KV: the first `cached` of its tokens, then the drafts `fed` after them."""

    cached: int = 0
    fed: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Catchup:
    """A row of one proposal: the tokens its first forward feeds, from position `start`, and its k."""

    request_id: str
    tokens: np.ndarray
    start: int
    k: int


def draft_config(path: str, target: ModelConfig) -> ModelConfig:
    """The draft checkpoint's config; ValueError unless its vocabulary is the target's."""
    config = ModelConfig.from_dir(resolve_model(path).path)
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"--speculative-config: the draft model {path} has a vocabulary of {config.vocab_size} "
                         f"tokens, the target {target.model_dir.name} {target.vocab_size}: draft_model needs "
                         f"the target's tokenizer")
    return config


def load_draft_model(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                     max_model_len: int) -> CausalLM:
    """The draft's weights on `device` (the engine's own loader); ValueError on a vocabulary mismatch."""
    return load_model(draft_config(path, target), dtype, device, max_model_len)


Run = Callable[..., object]     # run(fn, *args): fn(*args) on some thread, waited for


def own_thread() -> Run:
    """A thread of its own for a draft whose unit has no compute thread in this process (a worker process's)."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="pdserve-draft")
    return lambda fn, *args: executor.submit(fn, *args).result()


class DraftModelProposer:
    """Greedy drafts from `model` over a KV pool of `num_blocks` blocks of its own (engine.core.speculative's
    `DraftModel`), its forwards run by `run` (the decode unit's compute thread; default: a thread of its
    own), never on the caller's. A row that finds no free block drafts nothing that step."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, run: Run | None = None) -> None:
        self.model = model
        self.run = run or own_thread()
        model.use_backend(kernels.choose_backend(model.embed_tokens.weight))
        self.device = model.embed_tokens.weight.device
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv_pool = kv_layout(model.config, block_size).allocate(num_blocks, model.embed_tokens.weight.dtype,
                                                                    self.device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.rows: dict[str, DraftRow] = {}
        self.forward_seconds: float | None = None

    def reset(self) -> None:
        self.blocks = BlockManager(self.num_blocks, self.block_size)
        self.rows = {}

    def release(self, request_id: str) -> None:
        self.rows.pop(request_id, None)
        self.blocks.free(request_id)

    def propose(self, rows) -> list[tuple[int, ...]]:
        """Per (request id, its tokens, k): k greedy draft tokens (none where the pool is full)."""
        return self.run(self._propose, rows)

    @torch.inference_mode()
    def _propose(self, rows) -> list[tuple[int, ...]]:
        catchups = [self._catch_up(request_id, tokens, k) for request_id, tokens, k in rows]
        live = [c for c in catchups if c is not None]
        drafts: dict[str, list[int]] = {c.request_id: [] for c in live}
        if live:
            self._first(live, drafts)
            self._continue(live, drafts)
        for c in live:
            self.rows[c.request_id] = DraftRow(c.start + len(c.tokens), tuple(drafts[c.request_id][:-1]))
        return [tuple(drafts[c.request_id]) if c is not None else () for c in catchups]

    def _catch_up(self, request_id: str, tokens: np.ndarray, k: int) -> Catchup | None:
        """What the row feeds first: its tokens after the KV's confirmed prefix, blocks grown for its drafts."""
        row = self.rows.get(request_id) or DraftRow()
        confirmed = min(row.cached, len(tokens) - 1)
        for draft in row.fed:                          # the accepted drafts' KV is already there
            if confirmed >= len(tokens) - 1 or tokens[confirmed] != draft:
                break
            confirmed += 1
        try:
            self.blocks.grow(request_id, len(tokens) + k - 1)
        except NoFreeBlocks:                           # NOTE: changes nothing; its KV stays for the next step
            return None
        self.rows[request_id] = DraftRow(confirmed)
        return Catchup(request_id, np.array(tokens[confirmed:], dtype=np.int64), confirmed, k)

    def _first(self, live: list[Catchup], drafts: dict[str, list[int]]) -> None:
        """One forward over every row's catch-up tokens; each row's first draft from its last position."""
        lengths = [len(c.tokens) for c in live]
        starts = [c.start for c in live]
        ids = np.concatenate([c.tokens for c in live])
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        owners = np.repeat(np.arange(len(live)), lengths)
        tables = self._tables([c.request_id for c in live])
        batch = ForwardBatch(
            input_ids=self._upload(ids), positions=self._upload(positions),
            slot_mapping=self._upload(self._slots(tables, owners, positions)),
            block_tables=self._upload(tables, torch.int32),
            context_lens=self._upload(np.add(starts, lengths), torch.int32),
            cu_seqlens_q=self._upload(np.concatenate([[0], np.cumsum(lengths)]), torch.int32),
            logits_indices=self._upload(np.cumsum(lengths) - 1))
        steady = sum(lengths) <= 2 * len(live)
        for c, token in zip(live, self._greedy(batch, steady)):
            drafts[c.request_id].append(token)

    def _continue(self, live: list[Catchup], drafts: dict[str, list[int]]) -> None:
        """Decode forwards: each row feeds its newest draft until it has k."""
        for j in range(1, max(c.k for c in live)):
            rows = [c for c in live if c.k > j]
            positions = np.array([c.start + len(c.tokens) + j - 1 for c in rows])
            tables = self._tables([c.request_id for c in rows])
            batch = ForwardBatch(
                input_ids=self._upload(np.array([drafts[c.request_id][-1] for c in rows])),
                positions=self._upload(positions),
                slot_mapping=self._upload(self._slots(tables, np.arange(len(rows)), positions)),
                block_tables=self._upload(tables, torch.int32),
                context_lens=self._upload(positions + 1, torch.int32), cu_seqlens_q=None,
                logits_indices=self._upload(np.arange(len(rows))))
            for c, token in zip(rows, self._greedy(batch, True)):
                drafts[c.request_id].append(token)

    def _greedy(self, batch: ForwardBatch, measured: bool) -> list[int]:
        started = time.perf_counter()
        hidden = self.model(batch, self.kv_pool)                               # hidden: [T, H]
        tokens = self.model.compute_logits(hidden[batch.logits_indices]).argmax(dim=-1).tolist()
        if measured:
            seconds = time.perf_counter() - started
            old = self.forward_seconds
            self.forward_seconds = seconds if old is None else FORWARD_DECAY * old + (1 - FORWARD_DECAY) * seconds
        return tokens

    def _tables(self, request_ids: list[str]) -> np.ndarray:
        tables = [self.blocks.table(r) for r in request_ids]
        out = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)     # [S, max_blocks]
        for i, table in enumerate(tables):
            out[i, :len(table)] = table
        return out

    def _slots(self, tables: np.ndarray, owners: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return tables[owners, positions // self.block_size] * self.block_size + positions % self.block_size

    def _upload(self, array, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.as_tensor(np.asarray(array), dtype=dtype).to(self.device)


def draft_proposers(path: str, target: ModelConfig, dtype: torch.dtype, devices: tuple[torch.device, ...],
                    num_blocks: tuple[int, ...], runs: tuple[Run | None, ...], block_size: int, max_model_len: int
                    ) -> tuple[DraftModelProposer, ...]:
    """One proposer per decode unit (on `devices`, pools of `num_blocks`, forwards run by `runs`); units on
    one device share the weights."""
    models: dict[torch.device, CausalLM] = {}
    for device in dict.fromkeys(devices):
        models[device] = load_draft_model(path, target, dtype, device, max_model_len)
    return tuple(DraftModelProposer(models[d], n, block_size, run) for d, n, run in zip(devices, num_blocks, runs))

