"""The start-up profile is kept on disk: a second start of the same setup replays it (one probe step instead of the
whole profile) into the same cost models and the same derived SLOs; `refresh`, another setup, a drifted probe
step or a damaged file measure again."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace

import pytest

from pdserve.engine.args import add_engine_args, engine_config_from_args
from pdserve.engine.coordinator import profile_store
from pdserve.engine.coordinator.profile import DRIFT_PROBE_ROWS, PROBES
from pdserve.engine.coordinator.profile_store import DRIFT
from pdserve.engine.engine import Engine
from tests.models import demo_checkpoint, engine_config
from tests.test_engine_modes import run_engine


def started(config, monkeypatch, tmp_path) -> tuple[Engine, int]:
    """An engine started and stopped with PDSERVE_CACHE at `tmp_path`; and how many steps its units ran."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    engine = Engine(config)
    steps = 0
    for unit in engine.units.computes:
        submit = unit.submit

        def counted(work, submit=submit):
            nonlocal steps
            steps += bool(work.step.num_tokens)
            return submit(work)

        unit.submit = counted

    async def nothing():
        return None

    asyncio.run(run_engine(engine, nothing()))
    return engine, steps


def predictions(engine: Engine) -> list[float]:
    decode = engine.coordinator.decode[0].priced()
    return [decode[0].predict(decode[1], rows, tokens) for rows, tokens in ((1, 0), (8, 0), (0, 256), (2, 128))]


@pytest.fixture
def config():
    return engine_config(demo_checkpoint(), mode="adaptive", max_num_seqs=8, max_prefill_tokens=256)


def test_a_second_start_replays_the_kept_profile_into_the_same_costs_and_slos(config, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(profile_store, "DRIFT", 1e6)         # a loaded machine's noise is not what this tests
    first, measured = started(config, monkeypatch, tmp_path)
    [kept] = (tmp_path / "profiles").iterdir()
    with caplog.at_level(logging.INFO, logger="pdserve.engine.coordinator.profile"):
        second, replayed = started(config, monkeypatch, tmp_path)
    assert "kept from an earlier start" in caplog.text
    assert replayed == 2 * (PROBES + 1) < measured          # two probe steps, each warmed once: not the profile
    assert second.slos == first.slos and predictions(second) == pytest.approx(predictions(first), rel=1e-9)
    assert list((tmp_path / "profiles").iterdir()) == [kept]
    first.close(), second.close()


def test_refresh_another_setup_a_drifted_probe_or_a_damaged_file_measure_again(config, monkeypatch, tmp_path, caplog):
    first, measured = started(config, monkeypatch, tmp_path)
    first.close()
    refresh = replace(config, scheduler=replace(config.scheduler, refresh_profile=True))
    assert started(refresh, monkeypatch, tmp_path)[1] == measured
    other = replace(config, scheduler=replace(config.scheduler, max_prefill_tokens=128))
    assert started(other, monkeypatch, tmp_path)[1] > 2
    assert len(list((tmp_path / "profiles").iterdir())) == 2
    kept = next(p for p in (tmp_path / "profiles").iterdir() if json.loads(p.read_text())["key"]["steps"][1] == 256)
    data = json.loads(kept.read_text())
    data["profiles"][0][0][-1] *= DRIFT * 4                  # the probe step, as if kept on a slower machine
    kept.write_text(json.dumps(data))
    with caplog.at_level(logging.INFO, logger="pdserve.engine.coordinator.profile"):
        assert started(config, monkeypatch, tmp_path)[1] == measured + PROBES + 1
    assert "measured again" in caplog.text
    kept.write_text(kept.read_text()[:40])                   # torn
    assert started(config, monkeypatch, tmp_path)[1] == measured


def test_a_profile_kept_from_a_busy_machine_is_caught_by_its_largest_lent_step(config, monkeypatch, tmp_path):
    """A profile taken while other work ran is slowest where threads contend: its largest lent decode step checked
    (not its first, one-row step) shows it, and the next start measures again."""
    monkeypatch.setattr(profile_store, "DRIFT", 1e3)
    first, measured = started(config, monkeypatch, tmp_path)
    first.close()
    [kept] = (tmp_path / "profiles").iterdir()
    data = json.loads(kept.read_text())
    lent = data["profiles"][2]                               # the decode unit on lent threads
    heaviest = max((e for e in lent if e[0] == "decode" and e[1] <= DRIFT_PROBE_ROWS), key=lambda e: (e[1], -e[3]))
    heaviest[-1] *= 1e4
    kept.write_text(json.dumps(data))
    again = started(config, monkeypatch, tmp_path)[1]
    assert again == measured + 2 * (PROBES + 1)


def test_alike_units_time_each_profile_step_once(config, monkeypatch, tmp_path):
    """Adaptive mode's two CPU units (one thread each) step alike: the prefill unit takes the decode unit's
    prefill timings instead of running them again, on its own threads and on lent ones."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    engine = Engine(config)
    prefill_unit = engine.units.prefills[0]
    share = engine.layout.lending
    assert share is not None and share.decode_own == share.prefill_own
    ran = []
    submit = prefill_unit.submit
    prefill_unit.submit = lambda work: ran.append(work.step.num_tokens) or submit(work)

    async def nothing():
        return None

    asyncio.run(run_engine(engine, nothing()))
    assert not any(ran)
    decode, prefill, decode_lent, prefill_lent = json.loads(next((tmp_path / "profiles").iterdir()).read_text())[
        "profiles"]
    assert prefill == [entry for entry in decode if entry[0] == "prefill"]
    assert prefill_lent == [entry for entry in decode_lent if entry[0] == "prefill"]
    engine.close()


def test_the_command_line_spells_on_refresh_and_off():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    slos = ["--ttft-slo-ms", "900", "--itl-slo-ms", "60"]
    for argv, (on, refresh) in ((["--startup-profile"], (True, False)), ([], (True, False)),
                                (["--startup-profile", "refresh"], (True, True)),
                                (["--startup-profile", "off", *slos], (False, False)),
                                (["--no-startup-profile", *slos], (False, False))):
        sched = engine_config_from_args(parser.parse_args(argv)).scheduler
        assert (sched.startup_profile, sched.refresh_profile) == (on, refresh), argv


def test_the_drift_check_runs_no_decode_batch_past_its_row_cap():
    """A full batch's logits and activations were most of a lightly loaded server's peak memory (a restart's
    check ran a 256-row step): the check takes the heaviest decode step of at most DRIFT_PROBE_ROWS rows."""
    from pdserve.engine.coordinator.profile import _probes

    own = [["decode", 1, 1, 64, 1, 0, 0.01], ["decode", 256, 256, 64, 1, 0, 0.2]]
    lent = [["decode", rows, rows, 64, 2, 0, 0.001 * rows] for rows in (1, 8, DRIFT_PROBE_ROWS, 4 * DRIFT_PROBE_ROWS)]
    assert _probes([own, lent]) == [(0, own[0]), (1, lent[2])]
