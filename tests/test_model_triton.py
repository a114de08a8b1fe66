"""The whole model through the Triton kernels (the interpreter on CPU) against the torch path."""
from __future__ import annotations

import os

import pytest

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.kernels._triton import HAS_TRITON
from tests.models import SLOS_SET, demo_checkpoint, engine_config, hf_checkpoint

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def greedy_tokens(mode: str, model=None, prompts=([5, 9, 300, 41], list(range(3, 60)), [700] * 23),
                  max_tokens: int = 6, **config) -> list[tuple[int, ...]]:
    llm = LLM(config=engine_config(model or demo_checkpoint(), mode=mode, max_prefill_tokens=32, block_size=16,
                                   **config))
    try:
        outputs = llm.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_triton_kernels_give_the_same_greedy_tokens(monkeypatch, mode):
    if os.environ.get("TRITON_INTERPRET") != "1" and not __import__("torch").cuda.is_available():
        pytest.fail("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does it)")
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    expected = greedy_tokens(mode)
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    assert greedy_tokens(mode) == expected


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "smollm3", "qwen3.5", "qwen3-next"])
def test_triton_kernels_serve_every_layer_kind(monkeypatch, arch):
    """Windows shorter than the prompt (two prefill chunks), soft-caps, local and global rotary tables, q/k
    norms, NoPE layers, GeGLU, Gated DeltaNet layers' conv and recurrent states (the kernels' sinks:
    test_kernels_triton.py)."""
    run = dict(model=hf_checkpoint(arch), prompts=[list(range(3, 50))], max_tokens=3, **SLOS_SET)
    monkeypatch.setenv("PDSERVE_KERNELS", "torch")
    expected = greedy_tokens("colocated", **run)
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    assert greedy_tokens("colocated", **run) == expected
