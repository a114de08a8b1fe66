"""Named accelerators for the roofline cost model, from their makers' published figures."""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True, slots=True)
class Hardware:
    """One accelerator: dense 16-bit tensor FLOP/s, memory bandwidth (bytes/s) and capacity (bytes), and the
    bandwidth (bytes/s, one direction) of the link a KV hand-off crosses between two of them."""

    name: str
    flops: float
    memory_bandwidth: float
    memory: float
    link_bandwidth: float
    link: str
    source: str


HARDWARE = {hw.name: hw for hw in (
    Hardware("h200", 989e12, 4.8e12, 141 * GB, 450 * GB, "NVLink 4 (900 GB/s both ways)",
             "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity, 4.8 TB/s HBM3e"),
    Hardware("h100", 989e12, 3.35e12, 80 * GB, 450 * GB, "NVLink 4 (900 GB/s both ways)",
             "NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity, 3.35 TB/s HBM3"),
    Hardware("a100", 312e12, 2.039e12, 80 * GB, 300 * GB, "NVLink 3 (600 GB/s both ways)",
             "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense, 2,039 GB/s HBM2e"),
    Hardware("l40s", 362e12, 864 * GB, 48 * GB, 32 * GB, "PCIe Gen4 x16 (64 GB/s both ways)",
             "NVIDIA L40S datasheet: BF16 362 TFLOPS dense (733 with sparsity), 864 GB/s GDDR6, PCIe Gen4 x16"),
)}
MEASURED = "measured"
HARDWARE_CHOICES = (*HARDWARE, MEASURED)


def hardware_table() -> str:
    """The table above as Markdown (docs/planning.md and `pdserve plan --help` show it)."""
    rows = ["| hardware | TFLOP/s (dense bf16) | memory TB/s | memory GB | link | source |", "|---|---:|---:|---:|---|---|"]
    rows += [f"| {h.name} | {h.flops / 1e12:g} | {h.memory_bandwidth / 1e12:g} | {h.memory / GB:g} | {h.link} | "
             f"{h.source} |" for h in HARDWARE.values()]
    return "\n".join(rows)
