"""The draft_model method's drafts, one per decode (or colocated) unit, attached to the loaded units."""
from __future__ import annotations

from dataclasses import replace

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.block_manager import blocks_for
from pdserve.engine.units.spec import Layout
from pdserve.engine.units.units import Units
from pdserve.engine.worker.compute import ThreadCompute
from pdserve.engine.worker.draft_model import draft_config, draft_proposers


def check_draft_model(config: EngineConfig, model_config: ModelConfig) -> None:
    """Before anything loads: ValueError for a draft_model the target cannot use (another vocabulary, or
    the Ray backend, whose units run elsewhere while the draft runs in this process)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return
    if config.distributed_executor_backend == "ray":
        raise ValueError("--speculative-config: method 'draft_model' runs the draft in the engine's process, "
                         "beside the decode units; with the Ray backend they run elsewhere (not supported)")
    draft_config(spec.model, model_config)


def with_draft_models(units: Units, config: EngineConfig, model_config: ModelConfig, layout: Layout) -> Units:
    """`units` with a draft model per decode (or colocated) unit where the method is draft_model: on the unit's
    device, in this process (beside the unit's speculator), run on the unit's compute thread where it has one
    here, its pool as many blocks as the unit's and room for every row's drafts."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return units
    size = config.cache.block_size
    room = config.scheduler.max_num_seqs * blocks_for(spec.num_speculative_tokens + 1, size)
    decoding = units.decoding
    runs = tuple(u.call if isinstance(u, ThreadCompute) else None for u in decoding)
    return replace(units, drafters=draft_proposers(
        spec.model, model_config, layout.dtype, tuple(u.device for u in decoding),
        tuple(u.num_blocks + room for u in decoding), runs, size, layout.max_model_len))
