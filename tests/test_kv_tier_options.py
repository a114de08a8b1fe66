"""The KV tier options: their values, what they refuse (with the option's name), where the disk tier lives in a
systemd unit, and the /metrics series they add."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from pdserve.engine.args import add_engine_args, engine_config_from_args
from pdserve.engine.core.kv_tiers import TierStats
from pdserve.engine.core.messages import EngineStats
from pdserve.engine.engine import Engine
from pdserve.engine.model.cache import cache_root
from pdserve.server.cli import tier_folders
from pdserve.server.metrics import Metrics
from pdserve.server.systemd import render_unit
from tests.models import SLOS_SET, demo_checkpoint, engine_config


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_the_options_give_sizes_in_bytes_and_the_disk_folder():
    cache = parse("--kv-offload-memory", "8GiB", "--kv-offload-disk", "/srv/kv:1.5GiB", "--kv-verify").cache
    assert cache.kv_offload_memory == 8 << 30 and cache.kv_offload_disk == ("/srv/kv", 3 << 29) and cache.kv_verify
    assert parse("--kv-offload-disk", "20GiB").cache.kv_offload_disk == (str(cache_root() / "kv-tiers"), 20 << 30)
    off = parse().cache
    assert (off.kv_offload_memory, off.kv_offload_disk, off.kv_verify) == (None, None, False)


@pytest.mark.parametrize("argv, option", [
    (("--kv-offload-memory", "0.5"), "--kv-offload-memory"),
    (("--kv-offload-memory", "lots"), "--kv-offload-memory"),
    (("--kv-offload-disk", ":4GiB"), "--kv-offload-disk"),
    (("--kv-offload-disk", "/srv/kv:many"), "--kv-offload-disk"),
    (("--kv-offload-memory", "1GiB", "--no-enable-prefix-caching"), "--enable-prefix-caching"),
    (("--kv-offload-disk", "1GiB", "--distributed-executor-backend", "ray"), "ray"),
])
def test_values_that_cannot_work_are_refused_naming_the_option(argv, option):
    with pytest.raises(ValueError, match=option):
        parse(*argv)


def test_a_tier_too_small_for_one_block_stops_the_start(tmp_path):
    config = engine_config(demo_checkpoint(), **SLOS_SET)
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_offload_disk=(str(tmp_path), 5000)))
    with pytest.raises(ValueError, match="--kv-offload-disk: too small for one KV block"):
        Engine(config)


def test_a_systemd_unit_opens_a_tier_folder_outside_its_cache_folder():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert tier_folders(parser.parse_args(["--kv-offload-disk", "20GiB"])) == []     # the unit's cache folder
    (folder,) = tier_folders(parser.parse_args(["--kv-offload-disk", "/srv/kv:20GiB"]))
    unit = render_unit(["--kv-offload-disk", "/srv/kv:20GiB"], writable=[folder]).splitlines()
    assert "ReadWritePaths=/srv/kv" in unit and "CacheDirectory=pdserve" in unit


def test_metrics_export_each_tier():
    tiers = (TierStats("host", 100, 40, 320, 4096, 2048, 3, 0), TierStats("disk", 1000, 400, 160, 8192, 1024, 0, 2))
    metrics = Metrics(lambda: EngineStats((), 0, 0, tiers=tiers), list, names="pdserve")
    text = metrics.render().decode()
    for line in ('pdserve_kv_tier_hits_total{tier="host"} 320.0', 'pdserve_kv_tier_bad_blocks_total{tier="disk"} 2.0',
                 'pdserve_kv_tier_blocks{tier="disk"} 400.0', 'pdserve_kv_tier_capacity_blocks{tier="host"} 100.0',
                 'pdserve_kv_tier_evictions_total{tier="host"} 3.0', 'pdserve_kv_tier_bytes_in_total{tier="disk"} 8192.0'):
        assert line in text.splitlines()
