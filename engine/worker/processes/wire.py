"""The messages between the coordinator and a worker process: one per step each way, versioned.

A frame is a header (magic, version, kind, array count, JSON length), the lengths of its int32
arrays, the arrays, and a small JSON document for what is not an integer array (sampling
parameters of new rows, serialized by orjson from the dataclass; copy keys, logprobs, prompt logprobs, timings).
Token ids, positions, block tables and block ids travel as arrays; no object graph is pickled.
"""
from __future__ import annotations

import struct

import numpy as np
import orjson

from pdserve.engine.core.kv_tiers import TierCopy
from pdserve.engine.core.messages import PromptLogprobs, TokenLogprob
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.transfer.base import TransferHandle
from pdserve.engine.worker.step import (
    BlockAppend,
    BlockCopy,
    ChunkInput,
    NewRow,
    StepInput,
    StepResult,
    StepWork,
    VerifyInput,
)
from pdserve.engine.worker.kv_verify import CopyCheck
from pdserve.engine.worker.step_runner import StepOutcome
from pdserve.engine.worker.tiers.copier import TierOutcome

VERSION = 6
MAGIC = b"PDSV"
HEADER = struct.Struct("<4sHHII")           # magic, version, kind, number of arrays, JSON bytes
WORK, OUTCOME, ERROR, READY, STOP = range(5)
KIND_NAMES = ("work", "outcome", "error", "ready", "stop")


class WireError(ValueError):
    """A frame this version cannot read (another version, another kind, or damaged)."""


def _frame(kind: int, arrays: list, doc: object) -> bytes:
    arrays = [np.asarray(a, dtype=np.int32) for a in arrays]
    body = orjson.dumps(doc)
    lengths = np.array([a.size for a in arrays], dtype=np.uint32)
    return b"".join([HEADER.pack(MAGIC, VERSION, kind, len(arrays), len(body)), lengths.tobytes(),
                     *(a.tobytes() for a in arrays), body])


def _unframe(data: bytes, expected: int | None = None) -> tuple[int, list[np.ndarray], object]:
    if len(data) < HEADER.size:
        raise WireError(f"a frame of {len(data)} bytes is shorter than its header")
    magic, version, kind, count, body_len = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise WireError(f"frame {magic!r} version {version}; this side speaks {MAGIC!r} version {VERSION}")
    if expected is not None and kind != expected:
        raise WireError(f"expected a {KIND_NAMES[expected]} frame, got kind {kind}")
    offset = HEADER.size
    lengths = np.frombuffer(data, dtype=np.uint32, count=count, offset=offset)
    offset += 4 * count
    arrays = []
    for n in lengths.tolist():
        arrays.append(np.frombuffer(data, dtype=np.int32, count=n, offset=offset))
        offset += 4 * n
    if offset + body_len != len(data):
        raise WireError(f"frame length {len(data)} does not match its header")
    return kind, arrays, orjson.loads(data[offset:])


# coordinator -> worker
def encode_work(work: StepWork) -> bytes:
    s = work.step
    new, ap, ch, cp = s.new_rows, s.appends, s.chunks, work.copies
    arrays = [
        s.freed_rows,
        [x for r in new for x in (r.row, r.num_prompt_tokens, len(r.token_ids), len(r.block_ids), r.state_slot)],
        [t for r in new for t in r.token_ids],
        [b for r in new for b in r.block_ids],
        [x for a in ap for x in (a.row, a.first, len(a.block_ids))],
        [b for a in ap for b in a.block_ids],
        s.decode_rows,
        s.decode_positions,
        [x for c in ch for x in (c.row, c.start, c.num_tokens, int(c.sample), _optional(c.prompt_logprobs))],
        [len(c.src_blocks) for c in cp],
        [b for c in cp for b in c.src_blocks],
        [b for c in cp for b in c.dst_blocks],
        [x for v in s.verify for x in (v.row, v.start, len(v.token_ids))],
        [t for v in s.verify for t in v.token_ids],
        [x for c in work.tier_saves for x in (c.block, c.tier, c.slot, c.peer)],
        [x for c in work.tier_loads for x in (c.block, c.tier, c.slot, c.peer)],
        [x for pair in s.window_slots for x in pair],
    ]
    doc = {"threads": work.threads, "params": [r.params for r in new], "keys": [c.key for c in cp],
           "peers": [c.peer for c in cp], "tier_hashes": [c.digest.hex() for c in (*work.tier_saves,
                                                                                  *work.tier_loads)]}
    return _frame(WORK, arrays, doc)


def decode_work(data: bytes) -> StepWork:
    _, a, doc = _unframe(data, WORK)
    (freed, new_meta, new_tokens, new_blocks, ap_meta, ap_blocks, rows, positions, chunks, cp_n, cp_src, cp_dst,
     verify_meta, verify_tokens, tier_saves, tier_loads, window_slots) = a
    new_rows, t, b = [], 0, 0
    for (row, prompt, n_tokens, n_blocks, slot), params in zip(new_meta.reshape(-1, 5).tolist(), doc["params"]):
        new_rows.append(NewRow(row, tuple(new_tokens[t:t + n_tokens].tolist()), prompt,
                               tuple(new_blocks[b:b + n_blocks].tolist()), _params(params), slot))
        t, b = t + n_tokens, b + n_blocks
    appends, b = [], 0
    for row, first, n in ap_meta.reshape(-1, 3).tolist():
        appends.append(BlockAppend(row, first, tuple(ap_blocks[b:b + n].tolist())))
        b += n
    copies, b = [], 0
    for key, peer, n in zip(doc["keys"], doc["peers"], cp_n.tolist()):
        copies.append(BlockCopy(key, tuple(cp_src[b:b + n].tolist()), tuple(cp_dst[b:b + n].tolist()), peer))
        b += n
    step = StepInput(tuple(freed.tolist()), tuple(new_rows), tuple(appends), tuple(rows.tolist()),
                     tuple(positions.tolist()),
                     tuple(ChunkInput(r, s, n, bool(x), None if k < 0 else k)
                           for r, s, n, x, k in chunks.reshape(-1, 5).tolist()),
                     _verify_inputs(verify_meta, verify_tokens),
                     tuple(map(tuple, window_slots.reshape(-1, 2).tolist())))
    saves, loads = _tier_copies(tier_saves, tier_loads, doc["tier_hashes"])
    return StepWork(step, tuple(copies), doc["threads"], saves, loads)


def _tier_copies(saves: np.ndarray, loads: np.ndarray, hashes: list[str]):
    copies = [TierCopy(block, tier, slot, bytes.fromhex(digest), peer)
              for (block, tier, slot, peer), digest in zip([*saves.reshape(-1, 4).tolist(),
                                                            *loads.reshape(-1, 4).tolist()], hashes)]
    return tuple(copies[:len(saves) // 4]), tuple(copies[len(saves) // 4:])


def _optional(count: int | None) -> int:
    return -1 if count is None else count


def _verify_inputs(meta: np.ndarray, tokens: np.ndarray) -> tuple[VerifyInput, ...]:
    verify, t = [], 0
    for row, start, n in meta.reshape(-1, 3).tolist():
        verify.append(VerifyInput(row, start, tuple(tokens[t:t + n].tolist())))
        t += n
    return tuple(verify)


def _params(fields: dict) -> SamplingParams:
    """As the coordinator built them: checked there once, so a value a runner cannot hold fails its row there,
    not the decoding of the whole step here."""
    fields["stop"], fields["stop_token_ids"] = tuple(fields["stop"]), tuple(fields["stop_token_ids"])
    fields["logit_bias"] = tuple((token, bias) for token, bias in fields["logit_bias"])
    return SamplingParams.unchecked(**fields)


# worker -> coordinator
def encode_outcome(outcome: StepOutcome) -> bytes:
    """A step's outcome whose copies have all landed (the worker waited for them)."""
    result = outcome.result
    logprobs = None if result.logprobs is None else [
        None if lp is None else [lp.token_id, lp.logprob, lp.top] for lp in result.logprobs]
    copies = [[key, handle.nbytes, handle.seconds] for key, handle in outcome.copies]
    verified_logprobs = None if result.verified_logprobs is None else [
        None if row is None else [[lp.token_id, lp.logprob, lp.top] for lp in row] for row in result.verified_logprobs]
    prompt_logprobs = [[index, p.token_ids, p.logprobs, p.ranks, p.top] for index, p in result.prompt_logprobs]
    doc = {"seconds": outcome.seconds, "threads": outcome.threads, "logprobs": logprobs, "copies": copies,
           "verified_logprobs": verified_logprobs, "mask_seconds": outcome.mask_seconds,
           "faults": [list(fault) for fault in result.faults], "prompt_logprobs": prompt_logprobs,
           "tier": [list(outcome.tier.bad_loads), list(outcome.tier.failed_saves), outcome.tier.load_seconds],
           "check": [outcome.check.mismatches, list(outcome.check.failed)]}
    verified = result.verified
    return _frame(OUTCOME, [result.token_ids, [len(v) for v in verified], [t for v in verified for t in v]], doc)


def decode_outcome(data: bytes) -> StepOutcome:
    _, (tokens, verified_n, verified_tokens), doc = _unframe(data, OUTCOME)
    ends = np.cumsum(verified_n).tolist()
    verified = tuple(tuple(verified_tokens[end - n:end].tolist()) for n, end in zip(verified_n.tolist(), ends))
    logprobs = None if doc["logprobs"] is None else tuple(
        None if lp is None else TokenLogprob(lp[0], lp[1], tuple(tuple(t) for t in lp[2])) for lp in doc["logprobs"])
    copies = tuple((key, TransferHandle.finished(nbytes, seconds)) for key, nbytes, seconds in doc["copies"])
    verified_logprobs = None if doc["verified_logprobs"] is None else tuple(
        None if row is None else tuple(TokenLogprob(lp[0], lp[1], tuple(tuple(t) for t in lp[2])) for lp in row)
        for row in doc["verified_logprobs"])
    faults = tuple((row, why) for row, why in doc["faults"])
    prompt_logprobs = tuple((index, PromptLogprobs(tuple(ids), tuple(lps), tuple(ranks),
                                                   tuple(tuple(tuple(t) for t in top) for top in tops)))
                            for index, ids, lps, ranks, tops in doc["prompt_logprobs"])
    bad_loads, failed_saves, load_seconds = doc["tier"]
    mismatches, failed = doc["check"]
    return StepOutcome(StepResult(tuple(tokens.tolist()), logprobs, verified, verified_logprobs, faults,
                                  prompt_logprobs), copies, doc["seconds"], doc["threads"], doc["mask_seconds"],
                       TierOutcome(tuple(bad_loads), tuple(failed_saves), load_seconds),
                       CopyCheck(mismatches, tuple(failed)))


def encode_error(error: BaseException) -> bytes:
    return _frame(ERROR, [], {"error": f"{type(error).__name__}: {error}"})


def encode_message(kind: int, doc: object = None) -> bytes:
    return _frame(kind, [], doc)


def decode_message(data: bytes) -> tuple[int, object]:
    kind, _, doc = _unframe(data)
    return kind, doc


def is_stop(data: bytes) -> bool:
    """Whether `data` is a stop message (a damaged frame is not: read as work, its error is the reply)."""
    try:
        return decode_message(data)[0] == STOP
    except ValueError:
        return False
