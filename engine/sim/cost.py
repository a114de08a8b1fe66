"""What one step costs: the step's work in a few counts (`StepShape`), and two models of its seconds,
a roofline of a named accelerator and a linear fit of steps measured on this machine's units."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdserve.engine.core.batch import attention_pairs
from pdserve.engine.sim.hardware import Hardware
from pdserve.engine.config import ModelConfig
from pdserve.engine.worker.step import StepInput

DEFAULT_STEP_OVERHEAD_S = 1e-3   # host work and launches a step cannot hide; an assumption (--step-overhead-ms)


@dataclass(frozen=True, slots=True)
class StepShape:
    """A step's work: prefill (chunk and draft-verify) tokens and the context pairs their attention reads,
    decode rows and their summed context, rows sampled (the LM head), and the KV the chunks read back."""

    prefill_tokens: int = 0
    prompt_chunks: int = 0
    prefill_pairs: int = 0
    prefix_tokens: int = 0
    decode_rows: int = 0
    decode_context: int = 0
    sampled: int = 0

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_rows


def step_shape(step: StepInput) -> StepShape:
    """The counts of `step` (a chunk of n tokens from `start` attends n*start + n(n+1)/2 pairs)."""
    spans = [(c.start, c.num_tokens) for c in step.chunks] + [(v.start, len(v.token_ids)) for v in step.verify]
    return StepShape(prefill_tokens=sum(n for _, n in spans), prompt_chunks=len(step.chunks),
                     prefill_pairs=sum(attention_pairs(start, n) for start, n in spans),
                     prefix_tokens=sum(start for start, _ in spans),
                     decode_rows=len(step.decode_rows),
                     decode_context=sum(p + 1 for p in step.decode_positions),
                     sampled=len(step.sampled_rows) + sum(len(v.token_ids) for v in step.verify))


@dataclass(frozen=True, slots=True)
class Roofline:
    """max(FLOPs / peak, bytes / bandwidth) + a fixed overhead per step: the weights are read once per step (an
    expert layer's: the experts its tokens touch; its FLOPs: the active parameters), each decode row reads its
    context's KV, a chunk reads its prefix's KV and every new token writes its own. A recurrent layer costs the
    same at any context: each token updates and reads its state, each sequence of the step reads and writes it."""

    shape: ModelConfig
    hardware: Hardware
    dtype_bytes: int = 2
    overhead: float = DEFAULT_STEP_OVERHEAD_S

    def flops(self, s: StepShape) -> float:
        m = self.shape
        linear = 2 * s.tokens * m.num_layers * m.layer_params + 2 * s.sampled * m.lm_head_params
        attention = 4 * m.num_kv_layers * m.num_heads * m.head_dim * (s.prefill_pairs + s.decode_context)
        la = m.linear_attention
        recurrent = 0 if la is None else 8 * s.tokens * m.num_recurrent_layers * la.recurrent_state_floats
        return float(linear + attention + recurrent)

    def bytes(self, s: StepShape) -> float:
        kv_token = self.shape.kv_elements_per_token() * self.dtype_bytes
        kv = kv_token * (s.decode_context + s.prefix_tokens + s.prefill_tokens)
        states = 2 * self.shape.state_bytes() * (s.decode_rows + s.prompt_chunks)
        return float(self.shape.params_read(s.tokens) * self.dtype_bytes + kv + states)

    def seconds(self, s: StepShape, threads: int | None = None) -> float:
        hw = self.hardware
        return max(self.flops(s) / hw.flops, self.bytes(s) / hw.memory_bandwidth) + self.overhead

    def transfer_seconds(self, nbytes: int) -> float:
        return nbytes / self.hardware.link_bandwidth


FEATURES = ("step", "prefill_tokens", "prefill_pairs", "decode_rows", "decode_context", "prompt_path")


def features(s: StepShape) -> tuple[float, ...]:
    """The counts a fitted cost weighs; `prompt_path`: the step prefills a prompt chunk, a price per step of its
    own (as in the step cost model, engine.actors.step_cost)."""
    return (1.0, float(s.prefill_tokens), float(s.prefill_pairs), float(s.decode_rows), float(s.decode_context),
            float(s.prompt_chunks > 0))


@dataclass(frozen=True, slots=True)
class FittedCost:
    """Seconds = coefficients . (1, prefill tokens, prefill pairs, decode rows, decode context), one set per
    CPU thread count (or one, keyed 0, for a GPU unit), fitted to steps measured on this machine; KV copies
    at the measured bytes per second."""

    coefficients: Mapping[int, tuple[float, ...]]
    copy_bandwidth: float
    synchronous_copies: bool = True          # CPU units copy inside the step (the torch backend)
    overhead: float = 0.0                    # host work per step beyond the runner's (--step-overhead-ms)

    def seconds(self, s: StepShape, threads: int | None = None) -> float:
        c = self.coefficients[self._key(threads)]
        return sum(w * x for w, x in zip(c, features(s))) + self.overhead

    def _key(self, threads: int | None) -> int:
        if threads in self.coefficients:
            return threads
        return min(self.coefficients, key=lambda k: abs(k - (threads or 0)))   # nearest measured count

    def transfer_seconds(self, nbytes: int) -> float:
        return nbytes / self.copy_bandwidth

    def to_json(self) -> dict:
        return {"features": list(FEATURES), "coefficients": {str(k): list(v) for k, v in self.coefficients.items()},
                "copy_bandwidth": self.copy_bandwidth, "synchronous_copies": self.synchronous_copies}

    @classmethod
    def from_json(cls, data: dict) -> FittedCost:
        """Raises ValueError for a fit of other features (a profile written by an older pdserve)."""
        if data.get("features") != list(FEATURES):
            raise ValueError(f"a fitted cost of features {data.get('features')}, not {list(FEATURES)}: measure again")
        return cls({int(k): tuple(v) for k, v in data["coefficients"].items()}, data["copy_bandwidth"],
                   data.get("synchronous_copies", True))


def fit(samples: Sequence[tuple[StepShape, float]]) -> tuple[float, ...]:
    """Coefficients of `features` for (shape, seconds) samples minimising the squared relative error (each step
    weighed by its own time: a one-row decode step counts as much as a long prefill chunk, whose absolute error
    would otherwise set the intercept), none negative (a negative one is dropped and the rest refitted); raises
    ValueError with fewer samples than features."""
    import numpy as np

    if len(samples) < len(FEATURES):
        raise ValueError(f"a fit needs at least {len(FEATURES)} measured steps, got {len(samples)}")
    weight = np.array([1.0 / max(t, 1e-9) for _, t in samples])
    x = np.array([features(s) for s, _ in samples]) * weight[:, None]
    y = np.array([t for _, t in samples]) * weight
    keep = list(range(len(FEATURES)))
    while True:
        solution = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (solution >= 0).all() or len(keep) == 1:
            coefficients = [0.0] * len(FEATURES)
            for i, value in zip(keep, solution):
                coefficients[i] = max(float(value), 0.0)
            return tuple(coefficients)
        keep = [i for i, value in zip(keep, solution) if value >= 0] or keep[:1]
