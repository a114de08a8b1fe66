"""Checkpoints and engine settings shared by the engine tests (generated locally, never fetched)."""
from __future__ import annotations

import functools
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.model.demo import make_model
from pdserve.engine.modes import MODES
from pdserve.engine.units.layout import make_layout
from pdserve.engine.units.spec import Layout, parse_devices
from tests.hf_models import make_hf_checkpoint

_ROOT = Path(tempfile.mkdtemp(prefix="pdserve-tests-"))


@functools.cache
def demo_checkpoint(arch: str = "llama") -> Path:
    return make_model(_ROOT / f"demo-tiny-{arch}", size="tiny", arch=arch)


@functools.cache
def hf_checkpoint(arch: str) -> Path:
    """A transformers-written checkpoint, with the demo tokenizer files beside it."""
    out = make_hf_checkpoint(arch, _ROOT / f"hf-{arch}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_checkpoint() / name, out / name)
    return out


# both SLOs given and no start-up profile: no profile steps through the units (for tests that patch a unit's
# steps or arm a PDSERVE_FAULT, which counts every step a unit runs)
SLOS_SET = dict(ttft_slo_ms=1000.0, itl_slo_ms=100.0, startup_profile=False)
SLO_FLAGS = ("--ttft-slo-ms", "1000", "--itl-slo-ms", "100", "--no-startup-profile")


def engine_config(model: Path, **overrides) -> EngineConfig:
    """float32, a small KV budget; `max_prefill_tokens`, `max_num_seqs` etc. pass through."""
    scheduler_keys = {"max_prefill_tokens", "max_num_seqs", "max_model_len", "max_queue", "ttft_slo_ms",
                      "itl_slo_ms", "startup_profile"}
    cache_keys = {"block_size", "kv_cache_memory", "kv_watermark", "enable_prefix_caching"}
    scheduler = replace(SchedulerConfig(max_model_len=2048),
                        **{k: overrides.pop(k) for k in list(overrides) if k in scheduler_keys})
    cache = replace(CacheConfig(kv_cache_memory="64MiB"),
                    **{k: overrides.pop(k) for k in list(overrides) if k in cache_keys})
    return EngineConfig(model=str(model), dtype="float32", scheduler=scheduler, cache=cache, **overrides)


def layout_of(config: EngineConfig, model_config, mode: str, prefill: str, decode: str,
              dtype: torch.dtype = torch.float32) -> Layout:
    """The layout `mode` gives `config` on these devices (comma-separated lists), without CPU cores."""
    return make_layout(config, model_config, MODES[mode](), parse_devices(prefill), parse_devices(decode), dtype, ())
