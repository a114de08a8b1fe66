"""The warm-up compiles every Triton kernel variant serving can hit, before the first request.

Kernel launches are replaced by `tests.triton_keys.KeyRecorder`, which computes the key Triton's JIT
would compile each launch under on a GPU (Triton's own binder, with the CUDA launch parameters of
sm_90), so the test runs on CPU: the keys of a real serving run, with the real schedulers and
random prompts, must all have been produced by the warm-up already.
"""
from __future__ import annotations

import random
import sys
from dataclasses import replace

import pytest
import torch

from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.worker.cuda_graph import batch_buckets
from pdserve.engine.worker.startup.warmup import warm_up, warmup_shapes
from tests.models import demo_checkpoint, engine_config
from tests.triton_keys import KeyRecorder

pytest.importorskip("triton.backends.nvidia.compiler")
# NOTE: more sequences than requests, and prompts that fit the prefill pool all at once: the prefill
# scheduler stalls today when a queue head it cannot admit blocks admitted chunked prompts behind it
MAX_NUM_SEQS, MAX_PREFILL_TOKENS, MAX_MODEL_LEN = 32, 64, 512
ROLES = {"colocated": ("colocated",), "disaggregated": ("prefill", "decode")}


def test_shapes_cover_the_batch_buckets_and_the_prefill_budget():
    shapes = warmup_shapes("colocated", 128, 2048, 8192)
    decode = sorted({s.num_seqs for s in shapes if s.kind == "decode"})
    prefill = [s for s in shapes if s.kind == "prefill"]
    assert decode == batch_buckets(128)
    assert {s.new_tokens for s in prefill if s.num_seqs == 1 and not s.context} == {2**k for k in range(12)}
    assert any(s.num_seqs == 128 and s.num_seqs * s.new_tokens == 2048 for s in prefill)
    assert any(s.context > 0 for s in prefill) and any(s.kind == "mixed" for s in shapes)
    assert not any(s.kind != "decode" for s in warmup_shapes("decode", 128, 2048, 8192))
    assert not any(s.kind != "prefill" for s in warmup_shapes("prefill", 128, 2048, 8192))
    assert max(s.new_tokens for s in warmup_shapes("prefill", 4, 2048, 100)) == 99


def cuda_launch_parameters(monkeypatch) -> None:
    """Let the wrappers choose what they would on an sm_90 GPU (tiles, dot precision) for CPU tensors."""
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    for name in ("pdserve.kernels.prefill_attention", "pdserve.kernels.decode_attention"):
        monkeypatch.setattr(sys.modules[name], "INTERPRETED", False)
    monkeypatch.setattr(sys.modules["pdserve.kernels.prefill_attention"], "target_arch", lambda device: 90)


def random_prompts(rng: random.Random, count: int) -> list[list[int]]:
    lengths = [1, 2, 15, 16, 17, 63, 64, 65, 200] + [rng.randrange(1, 100) for _ in range(count - 9)]
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


def serve_and_warm(monkeypatch, mode: str, honour_do_not_specialize: bool = True) -> tuple[set, set]:
    """(keys of a warm-up of every actor, keys of serving 24 random requests afterwards)."""
    cuda_launch_parameters(monkeypatch)
    config = engine_config(demo_checkpoint(), mode=mode, max_num_seqs=MAX_NUM_SEQS,
                           max_prefill_tokens=MAX_PREFILL_TOKENS, max_model_len=MAX_MODEL_LEN)
    llm = LLM(config=replace(config, dtype="bfloat16"))
    try:
        recorder = KeyRecorder(monkeypatch, honour_do_not_specialize)
        for actor, role in zip(llm.engine.actors, ROLES[mode]):
            warm_up(actor.runner, warmup_shapes(role, MAX_NUM_SEQS, MAX_PREFILL_TOKENS, MAX_MODEL_LEN))
        warmed, recorder.keys = recorder.distinct(), []
        rng = random.Random(7)
        prompts = random_prompts(rng, 24)
        params = [SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True)
                  for _ in prompts]
        outputs = llm.generate(prompts, params)
        assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
        return warmed, recorder.distinct()
    finally:
        llm.close()


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_serving_compiles_nothing_the_warm_up_did_not(monkeypatch, mode):
    warmed, served = serve_and_warm(monkeypatch, mode)
    assert served <= warmed, f"{len(served - warmed)} kernel variants first compiled while serving"
    names = {key[0] for key in warmed}
    assert names == {"_prefill_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_store_kv_kernel",
                     "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"}
    assert len(warmed) <= 10          # one variant per call site: runtime sizes are not specialized on


def test_without_do_not_specialize_serving_would_compile_again(monkeypatch):
    """The check has teeth: with Triton's default specialization, serving meets variants the warm-up missed."""
    warmed, served = serve_and_warm(monkeypatch, "colocated", honour_do_not_specialize=False)
    assert served - warmed


def test_runtime_sizes_are_not_specialized_on():
    from pdserve.kernels.decode_attention import _decode_reduce_kernel, _decode_split_kernel
    from pdserve.kernels.prefill_attention import _prefill_kernel
    from pdserve.kernels.store_kv import _store_kv_kernel

    def skipped(kernel):
        return set(getattr(kernel, "kwargs", {}).get("do_not_specialize") or kernel.do_not_specialize)

    assert {"layer", "num_seqs", "num_tiles", "stride_bts"} <= skipped(_prefill_kernel)
    assert {"layer", "num_splits", "stride_bts"} <= skipped(_decode_split_kernel)
    assert {"num_splits"} <= skipped(_decode_reduce_kernel) and {"layer"} <= skipped(_store_kv_kernel)


def test_warm_up_leaves_the_step_timer_at_zero():
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.worker.model_runner import ModelRunner, load_model

    model = load_model(ModelConfig.from_dir(demo_checkpoint()), torch.float32, torch.device("cpu"), 128)
    runner = ModelRunner(model, 32, 16, frozenset())
    assert warm_up(runner, warmup_shapes("colocated", 2, 16, 128)) == len(warmup_shapes("colocated", 2, 16, 128))
    assert runner.forward_seconds == 0.0
