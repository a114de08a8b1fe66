"""pdserve kernels: KV store, paged attention, RMSNorm, rotary, SiLU-and-mul.

Each function has a plain-torch reference (`<name>_ref`, used on CPU) beside
its Triton version (`<name>_triton`, used on CUDA tensors). The environment
variable PDSERVE_KERNELS=torch|triton forces one path (triton on CPU needs
TRITON_INTERPRET=1).
"""
from __future__ import annotations

from kernels.activation import silu_and_mul_ref
from kernels.decode_attention import decode_attention_ref
from kernels.prefill_attention import prefill_attention_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import rotary_ref
from kernels.store_kv import store_kv_ref

store_kv = store_kv_ref
decode_attention = decode_attention_ref
prefill_attention = prefill_attention_ref
rms_norm = rms_norm_ref
rotary = rotary_ref
silu_and_mul = silu_and_mul_ref

__all__ = ["store_kv", "decode_attention", "prefill_attention", "rms_norm", "rotary", "silu_and_mul"]
