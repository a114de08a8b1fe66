"""Decode CUDA graphs: bucket choice on CPU; captured equals eager on CUDA."""
from __future__ import annotations

import pytest
import torch

from pdserve.engine.actors.runner_rows import RunnerRows
from pdserve.engine.config import ModelConfig
from pdserve.engine.core.batch import Batch
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.messages import Request
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.llm import LLM
from pdserve.engine.worker.cuda_graph import batch_buckets
from pdserve.engine.worker.model_runner import ModelRunner, load_model
from pdserve.engine.worker.step import StepInput
from tests.models import demo_checkpoint, engine_config

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("max_batch, expected", [
    (1, [1]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]),
    (64, [1, 2, 4, 8, 16, 32, 48, 64]), (70, [1, 2, 4, 8, 16, 32, 48, 64, 80]),
])
def test_batch_buckets_cover_the_maximum(max_batch, expected):
    assert batch_buckets(max_batch) == expected


def decode_step(runner: ModelRunner, lengths: list[int]) -> StepInput:
    """A decode step over sequences with `lengths` tokens of context (one output token each)."""
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    generator = torch.Generator().manual_seed(0)
    seqs = []
    for i, n in enumerate(lengths):
        prompt = tuple(torch.randint(3, 1000, (n,), generator=generator).tolist())
        seq = Sequence(Request(str(i), prompt), output_token_ids=[7], num_computed_tokens=n + 1)
        seq.block_table = blocks.grow(seq.request_id, n + 1)
        seqs.append(seq)
    return RunnerRows().step_input(Batch(decode=tuple(seqs)))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_decode_matches_eager(dtype):
    config = ModelConfig.from_dir(demo_checkpoint())
    model = load_model(config, dtype, torch.device("cuda"), 1024)
    eager = ModelRunner(model, 512, 16, frozenset())
    graphed = ModelRunner(model, 512, 16, frozenset(), graph_max_batch=20, max_blocks_per_seq=64)
    graphed.kv_pool.copy_(torch.randn_like(eager.kv_pool.float()).to(dtype))
    eager.kv_pool.copy_(graphed.kv_pool)
    for lengths in ([5], [1, 900, 33], [17] * 13, list(range(1, 400, 21))):
        step = decode_step(eager, lengths)
        with torch.inference_mode():
            eager.apply(step)
            graphed.apply(step)
            expected, got = eager.logits(step), graphed.logits(step)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.gpu
@cuda
def test_engine_tokens_identical_with_and_without_cuda_graphs():
    prompts = [[5, 6, 7], list(range(3, 300)), [9] * 40]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = []
    for graphs in (False, True):
        llm = LLM(config=engine_config(demo_checkpoint(), mode="colocated", prefill_device="cuda:0",
                                       decode_device="cuda:0", cuda_graph=graphs, max_num_seqs=8))
        outputs.append([o.token_ids for o in llm.generate(prompts, params)])
        llm.close()
    assert outputs[0] == outputs[1]
