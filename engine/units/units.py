"""The compute units of one engine, one per UnitSpec of its layout, and what they share."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.units.spec import UnitSpec
from pdserve.engine.worker.compute import Compute


@dataclass(frozen=True, slots=True)
class Units:
    """`computes[i]` runs `specs[i]` (prefill units first, then those that decode)."""

    specs: tuple[UnitSpec, ...]
    computes: tuple[Compute, ...]
    shared: tuple = ()               # what the units step over or were spawned with: closed last
    drafters: tuple = ()             # per unit that decodes: its draft model (method draft_model)
    tiers: object = None             # the KV tiers' TierStore (engine.units.tiers), None without tiers

    @property
    def prefills(self) -> tuple[Compute, ...]:
        return tuple(c for s, c in zip(self.specs, self.computes) if not s.decodes)

    @property
    def decoding(self) -> tuple[Compute, ...]:
        """The units that decode: decode units, or colocated ones."""
        return tuple(c for s, c in zip(self.specs, self.computes) if s.decodes)

    def all(self) -> tuple[Compute, ...]:
        return self.computes

    def sequence_tokens(self) -> int:
        """The most tokens one sequence can hold in the smallest pool (a prompt's blocks take their window slots
        at admission, where the model has them)."""
        return min(min(unit.num_blocks, unit.window_slots.count if unit.window_slots else unit.num_blocks)
                   * unit.block_size for unit in self.computes)

    def drafter(self, spec: UnitSpec):
        """The draft model of unit `spec` (None without the draft_model method, or for a prefill unit)."""
        return self.drafters[spec.index] if self.drafters and spec.decodes else None

    def close(self) -> None:
        for unit in self.computes:
            unit.close()
        for pool in self.shared:
            pool.close()
