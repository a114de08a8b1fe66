"""The service-level objectives the planner serves and goodput counts: TTFT and ITL, in seconds.

Each is the user's (`--ttft-slo-ms`, `--itl-slo-ms`) or derived once at start-up from the steps the start-up
profile timed on this machine (`profile.py`; docs/adaptive.md says why each):
- ITL: twice the decode-only step of the batch at the roofline knee (the batch whose step costs twice one
  row's; a full batch where that is smaller): below the knee a row rides almost free on the weight reads,
  past it each row pays its own compute; the SLO leaves as much time again for prefill riding along
  (Sarathi-Serve's stall-free chunk budget). The one-row step is the one timed, not the cost model's
  prediction of it, which a fit to a few profile steps can get far wrong.
- TTFT: twice the first token of a typical chat prompt (a quarter of `--max-prefill-tokens`) on an idle prefill
  unit's own cores (the colocated unit in that mode): the wait a chat user would notice past, not the longest
  prompt's, under which the planner would have no reason to answer a chat sooner than a long step allows. A
  longer prompt's is scaled by its length (`Slos.ttft_for`): a document no idle unit could answer within a chat's
  bound would count late whatever the planner did, and the planner would trade every stream's gaps for it.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.actors.step_cost import StepCostModel
from pdserve.engine.core.config import SLO_HEADROOM, SchedulerConfig

HEADROOM = SLO_HEADROOM      # the derived SLOs: the measured step, and as much again (see above)
KNEE = 2.0                   # the knee batch: where a decode step has grown to twice the one-row step


@dataclass(frozen=True, slots=True)
class Slos:
    """The effective SLOs, in seconds, and where each came from."""

    ttft: float
    itl: float
    ttft_source: str = "set"         # "set" (the user's option) or how it was derived
    itl_source: str = "set"
    itl_kind: str = "mean"           # the planner's ITL miss: a stream's mean gap, or any one ("max")
    ttft_tokens: int = 0             # a derived TTFT's prompt length, past which it scales (0: stated, one bound)

    def ttft_for(self, prompt_tokens: int) -> float:
        """The TTFT SLO of a prompt of `prompt_tokens` tokens."""
        if not self.ttft_tokens or prompt_tokens <= self.ttft_tokens:
            return self.ttft
        return self.ttft * prompt_tokens / self.ttft_tokens

    def describe(self) -> str:
        kind = "" if self.itl_kind == "mean" else f", every gap ({self.itl_kind})"
        scaled = f", scaled by length past {self.ttft_tokens} tokens" if self.ttft_tokens else ""
        return (f"TTFT SLO {self.ttft * 1e3:.1f} ms ({self.ttft_source}{scaled}), "
                f"ITL SLO {self.itl * 1e3:.1f} ms ({self.itl_source}{kind})")


@dataclass(frozen=True, slots=True)
class MeasuredUnits:
    """What the SLOs are derived from: the decode and prefill units' cost models and their own threads."""

    decode: StepCostModel
    decode_threads: int | None
    prefill: StepCostModel
    prefill_threads: int | None
    one_row_step: float | None = None    # the profile's one-row decode step at the SLO's context, as timed
    typical_prompt_step: float | None = None   # the profile's prefill step of a typical prompt, as timed


def profile_context(sched: SchedulerConfig, max_model_len: int) -> int:
    """The context of each row of the full batch the ITL SLO is derived at: one full prefill step."""
    return max(1, min(sched.max_prefill_tokens, max_model_len - 2))


def prefill_step_tokens(sched: SchedulerConfig, max_model_len: int) -> int:
    return max(1, min(sched.max_prefill_tokens, max_model_len - 1))


def typical_prompt_tokens(sched: SchedulerConfig, max_model_len: int) -> int:
    """A typical chat prompt's tokens, the TTFT SLO is derived from: a quarter of a prefill step."""
    return max(1, prefill_step_tokens(sched, max_model_len) // 4)


def derive_slos(sched: SchedulerConfig, max_model_len: int, measured: MeasuredUnits | None) -> Slos:
    """The user's SLOs where set, else derived from `measured` (see the module docstring).

    Raises ValueError when an SLO is not set and nothing was measured to derive it from."""
    ttft, itl = sched.ttft_slo_ms, sched.itl_slo_ms
    context = profile_context(sched, max_model_len)
    tokens = typical_prompt_tokens(sched, max_model_len)
    itl_source = ttft_source = "set"
    ttft_tokens = 0
    if itl is None:
        step, why = _knee_step(measured, sched.max_num_seqs, context)
        itl = HEADROOM * step * 1e3
        itl_source = f"{HEADROOM:g} x the {step * 1e3:.1f} ms decode step of {why}"
    if ttft is None:
        step = _measured(measured and (measured.typical_prompt_step
                                       or measured.prefill.predict(measured.prefill_threads, 0, tokens)),
                         "--ttft-slo-ms")
        ttft = HEADROOM * step * 1e3
        ttft_source = f"{HEADROOM:g} x the {step * 1e3:.1f} ms first token of a typical {tokens}-token prompt"
        ttft_tokens = tokens
    return Slos(ttft / 1e3, itl / 1e3, ttft_source, itl_source, sched.itl_slo_kind, ttft_tokens)


def _knee_step(measured: MeasuredUnits | None, rows: int, context: int) -> tuple[float, str]:
    """The decode-only step of the knee batch (a full batch of `rows` where that is smaller), and what it is."""
    one_row = _measured(measured and (measured.one_row_step
                                      or measured.decode.predict(measured.decode_threads, 1, 0, context)),
                        "--itl-slo-ms")
    full = measured.decode.predict(measured.decode_threads, rows, 0, rows * context)
    if full is not None and full < KNEE * one_row:
        return full, f"a full batch ({rows} rows at context {context}; below the knee)"
    return KNEE * one_row, f"the knee batch ({KNEE:g} x the {one_row * 1e3:.1f} ms one-row step at context {context})"


def _measured(seconds: float | None, option: str) -> float:
    if seconds is None or seconds <= 0:
        raise ValueError(f"{option} is not set and no step was measured to derive it from")
    return seconds
