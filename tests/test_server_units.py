"""Server pieces that need no engine: request parsing, metrics text, sd_notify, the unit file, the CLI."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.core.messages import ActorStats, EngineStats
from pdserve.engine.core.sampling_params import SamplingParams
from pdserve.server import cli
from pdserve.server.errors import APIError
from pdserve.server.config import RequestLimits
from pdserve.server.metrics import Metrics
from pdserve.server.protocol import load_json_object, parse_chat, parse_completion
from pdserve.server.systemd import render_unit, sd_notify, watchdog, watchdog_interval
from pdserve.server.systemd_paths import service_paths, unreadable

LIMITS = RequestLimits()

# request parsing

def test_completion_prompt_forms_and_sampling_fields():
    parsed = parse_completion({"prompt": ["a", "b"], "temperature": 1, "top_k": 5, "stop": "##", "seed": 3,
                               "stop_token_ids": [7, 8], "logprobs": 2, "n": 3, "priority": -1,
                               "stream": True, "stream_options": {"include_usage": True}, "unknown": {"x": 1}},
                              RequestLimits(max_n=4, allow_client_priority=True))
    assert parsed.prompts == ("a", "b") and parsed.n == 3 and parsed.priority == -1
    assert parsed.stream and parsed.include_usage and parsed.max_tokens is None
    params = parsed.sampling_params(prompt_len=10, max_model_len=64)
    assert params == SamplingParams(max_tokens=54, temperature=1.0, top_k=5, stop=("##",), seed=3,
                                    stop_token_ids=(7, 8), logprobs=2)
    assert isinstance(params.temperature, float)
    assert parse_completion({"prompt": [5, 6, 7]}, LIMITS).prompts == ((5, 6, 7),)
    assert parse_completion({"prompt": [[5], [6, 7]]}, LIMITS).prompts == ((5,), (6, 7))


def test_chat_messages_logprobs_and_max_completion_tokens():
    parsed = parse_chat({"messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]},
                                      {"role": "assistant", "content": None, "name": "bot"}],
                         "logprobs": True, "top_logprobs": 4, "max_tokens": 3, "max_completion_tokens": 9},
                        RequestLimits(max_n=1))
    assert parsed.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                               {"role": "assistant", "content": "", "name": "bot"})
    assert parsed.max_tokens == 9 and parsed.max_tokens_param == "max_completion_tokens"
    assert parsed.sampling["logprobs"] == 4
    user = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_chat(user | {"logprobs": True}, LIMITS).sampling["logprobs"] == 0
    assert parse_chat(user, LIMITS).sampling["logprobs"] is None


@pytest.mark.parametrize("body", [b"", b"nul", b"\"text\"", b"{\"a\": NaN}", b"{\"a\": 1e999}"])
def test_bodies_that_are_not_json_objects(body):
    with pytest.raises(APIError) as e:
        load_json_object(body)
    assert e.value.status == 400 and e.value.body()["error"]["code"] == "invalid_json"


def test_context_window_arithmetic():
    parsed = parse_completion({"prompt": "x", "max_tokens": 6}, LIMITS)
    assert parsed.sampling_params(prompt_len=10, max_model_len=16).max_tokens == 6
    for prompt_len, param in ((11, "max_tokens"), (16, "prompt"), (40, "prompt")):
        with pytest.raises(APIError) as e:
            parsed.sampling_params(prompt_len=prompt_len, max_model_len=16)
        assert e.value.param == param and e.value.code == "context_length_exceeded"


# metrics

def test_metrics_text_parses_and_reads_the_engine_at_scrape_time():
    current = {"stats": None}
    transfers = [[0.002, 0.004], []]
    metrics = Metrics(lambda: current["stats"], lambda: transfers.pop(0) if transfers else [])
    assert "pdserve_kv_blocks_used" not in metrics.render().decode()      # no engine yet
    current["stats"] = EngineStats((ActorStats("colocated", 3, 2, 17, 64, 9, 1.0),), running=3, waiting=2,
                                   num_unfinished=5)
    metrics.observe_finished("length", prompt_tokens=7, output_tokens=4, e2e=0.3)
    metrics.ttft.observe(0.05)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    value = {(s.name, tuple(s.labels.items())): s.value for f in families.values() for s in f.samples}
    unit = (("actor", "colocated"), ("unit", "colocated"))      # a role's only unit is named after it
    assert value[("pdserve_kv_blocks_used", unit)] == 17
    assert value[("pdserve_kv_blocks_total", unit)] == 64
    assert value[("pdserve_requests_running", ())] == 3 and value[("pdserve_requests_waiting", ())] == 2
    assert value[("pdserve_kv_transfer_seconds_count", ())] == 2
    assert value[("pdserve_kv_transfer_seconds_sum", ())] == pytest.approx(0.006)
    assert value[("pdserve_requests_finished_total", (("finish_reason", "length"),))] == 1
    assert value[("pdserve_requests_finished_total", (("finish_reason", "abort"),))] == 0
    assert value[("pdserve_prompt_tokens_total", ())] == 7 and value[("pdserve_generation_tokens_total", ())] == 4
    assert families["pdserve_time_to_first_token_seconds"].type == "histogram"
    other = Metrics(lambda: None, lambda: [])
    assert "pdserve_prompt_tokens_total 0.0" in other.render().decode()          # registries are separate


# systemd

@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = name = str(tmp_path / "notify")
    else:
        name = f"@pdserve-test-{uuid.uuid4().hex}"
        address = "\0" + name[1:]
    sock.bind(address)
    sock.settimeout(10)
    yield sock, name
    sock.close()


def test_sd_notify_reaches_path_and_abstract_sockets(notify_socket):
    sock, name = notify_socket
    assert sd_notify("READY=1\nSTATUS=up", {"NOTIFY_SOCKET": name})
    assert sock.recv(4096) == b"READY=1\nSTATUS=up"
    assert not sd_notify("READY=1", {})


def test_sd_notify_never_blocks_on_a_full_queue(notify_socket):
    sock, name = notify_socket
    sent = [sd_notify("WATCHDOG=1", {"NOTIFY_SOCKET": name}) for _ in range(2000)]
    assert sent[0] and not sent[-1]                      # the kernel queue filled up; later pings are dropped
    assert sock.recv(64) == b"WATCHDOG=1"


async def test_watchdog_pings_from_the_loop(notify_socket):
    sock, name = notify_socket
    env = {"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "20000", "WATCHDOG_PID": str(os.getpid())}
    interval = watchdog_interval(env)
    assert interval == pytest.approx(0.01)
    assert watchdog_interval({**env, "WATCHDOG_PID": "1"}) is None and watchdog_interval({}) is None
    task = asyncio.get_running_loop().create_task(watchdog(interval, env))
    try:
        loop = asyncio.get_running_loop()
        pings = [await loop.run_in_executor(None, sock.recv, 64) for _ in range(3)]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert pings == [b"WATCHDOG=1"] * 3


async def test_the_watchdog_goes_silent_once_the_engine_is_dead(notify_socket):
    sock, name = notify_socket
    sock.setblocking(False)
    env = {"NOTIFY_SOCKET": name}
    alive = [True]
    task = asyncio.get_running_loop().create_task(watchdog(0.01, env, alive=lambda: alive[0]))
    try:
        await asyncio.sleep(0.05)
        alive[0] = False
        await asyncio.sleep(0.02)                          # a ping already under way may still land
        while True:
            try:
                sock.recv(64)
            except BlockingIOError:
                break
        await asyncio.sleep(0.1)
        with pytest.raises(BlockingIOError):
            sock.recv(64)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_systemd_unit_command(capsys):
    assert cli.main(["systemd-unit", "--model", "/srv/models/my 100%", "--port", "9000", "--mode", "colocated",
                     "--shutdown-timeout", "12", "--unit-user", "llm"]) == 0
    unit = capsys.readouterr().out
    lines = unit.splitlines()
    exec_start = next(line for line in lines if line.startswith("ExecStart="))
    assert exec_start == (f"ExecStart={sys.executable} -m pdserve.server.cli serve --model '/srv/models/my 100%%' "
                          "--port 9000 --mode colocated --shutdown-timeout 12")
    for line in ("Type=notify", "Restart=on-failure", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "PrivateTmp=yes", "ProtectHome=read-only", "Environment=PDSERVE_CACHE=/var/cache/pdserve",
                 "CacheDirectory=pdserve", "User=llm", "TimeoutStopSec=27", "WatchdogSec=30"):
        assert line in lines, line
    with pytest.raises(SystemExit):
        cli.main(["systemd-unit", "--port", "not-a-port"])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_file_passes_systemd_analyze(tmp_path):
    path = tmp_path / "pdserve-test.service"
    path.write_text(render_unit(["--model", "demo:tiny", "--host", "0.0.0.0"]))
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    problems = [line for line in result.stderr.splitlines() if path.name in line]
    assert result.returncode == 0 and not problems, result.stderr


def test_a_unit_run_from_a_virtualenv_under_tmp_is_refused_naming_private_tmp():
    folder = Path(tempfile.mkdtemp(prefix="pdserve-venv-", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(folder / "venv")],
                       check=True)
        result = subprocess.run([str(folder / "venv" / "bin" / "python"), "-m", "pdserve.server.cli", "systemd-unit",
                                 "--model", "demo:tiny", "--unit-user", "root"], capture_output=True, text=True)
    finally:
        shutil.rmtree(folder)
    assert result.returncode == 2 and result.stdout == ""
    assert f"the interpreter {folder}/venv/bin/python lies in /tmp" in result.stderr
    assert "PrivateTmp=yes hides" in result.stderr and "/opt/pdserve" in result.stderr


def test_the_dynamic_user_cannot_read_a_closed_home():
    root = Path(tempfile.mkdtemp(prefix="pdserve-home-"))          # NOTE: pytest's own tmp_path is in a 0700 folder
    try:
        check_a_closed_home(root)
    finally:
        shutil.rmtree(root)


def check_a_closed_home(root: Path) -> None:
    home = root / "home" / "alice"
    (home / "models").mkdir(parents=True)
    model = home / "models" / "tiny.gguf"
    model.write_bytes(b"GGUF")
    for folder in (root, root / "home", home / "models"):
        folder.chmod(0o755)
    model.chmod(0o644)
    home.chmod(0o700)
    problem = unreadable({"the model": model}, None, private_tmp=False)
    owner = pwd.getpwuid(os.getuid()).pw_name
    assert problem == (f"the service's dynamic user (DynamicUser=yes) cannot read the model {model}: {home} is mode "
                       f"0700 (owner {owner}); pass --unit-user {owner}, or install pdserve and the model where that "
                       "user can read them, e.g. a virtualenv under /opt/pdserve")
    assert unreadable({"the model": model}, owner, private_tmp=False) is None        # its owner can
    assert "PrivateTmp=yes" in unreadable({"the model": model}, owner, private_tmp=True)
    home.chmod(0o711)
    assert unreadable({"the model": model}, None, private_tmp=False) is None
    model.chmod(0o600)
    assert "is mode 0600" in unreadable({"the model": model}, None, private_tmp=False)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_units_systemd_unit_writes_pass_systemd_analyze(tmp_path, capsys):
    if unreadable(service_paths("demo:tiny"), "root", private_tmp=True) is not None:
        pytest.skip("this checkout or interpreter lies in /tmp, where no unit's service could run it")
    assert cli.main(["systemd-unit", "demo:tiny", "--host", "0.0.0.0", "--unit-user", "root",
                     "--max-num-batched-tokens", "1024", "--enforce-eager"]) == 0
    path = tmp_path / "pdserve-cli.service"
    path.write_text(capsys.readouterr().out)
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    problems = [line for line in result.stderr.splitlines() if path.name in line]
    assert result.returncode == 0 and not problems, result.stderr


# the CLI

def test_no_command_serves_with_default_options(monkeypatch):
    seen = []
    serve = dataclasses.replace(cli.COMMANDS["serve"], run=lambda args: seen.append(args) or 0)
    monkeypatch.setitem(cli.COMMANDS, "serve", serve)
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert cli.main([]) == 0 and cli.main(["--port", "9001", "--max-body-bytes", "1MiB", "--max-n", "2",
                                           "--max-total-tokens-per-request", "4096", "--allow-client-priority"]) == 0
    default, custom = (cli.server_config_from_args(args) for args in seen)
    assert default.limits == LIMITS and not default.limits.allow_client_priority
    assert custom.limits == RequestLimits(max_n=2, max_total_tokens=4096, allow_client_priority=True)
    assert (default.host, default.port, default.api_key, default.engine.model) == ("127.0.0.1", 8000, None, None)
    assert default.engine.cache == CacheConfig() and default.engine.scheduler == SchedulerConfig()
    assert custom.port == 9001 and custom.max_body_bytes == 2**20
    assert default.served_model_names == () and default.engine.prefill_device is None


def test_served_model_name_takes_one_or_more_names():
    parser = cli.argparse.ArgumentParser()
    cli.add_serve_arguments(parser)
    config = cli.server_config_from_args(parser.parse_args(["--served-model-name", "smol", "gpt-3.5-turbo"]))
    assert config.served_model_names == ("smol", "gpt-3.5-turbo")


def test_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    parser = cli.argparse.ArgumentParser()
    cli.add_serve_arguments(parser)
    assert cli.server_config_from_args(parser.parse_args([])).api_key == "from-env"
    assert cli.server_config_from_args(parser.parse_args(["--api-key", "flag"])).api_key == "flag"


def test_delegated_commands(tmp_path, tiny_model_dir, capsys):
    assert cli.main(["make-model", str(tmp_path / "m"), "--size", "tiny"]) == 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert cli.main(["generate", "--model", str(tiny_model_dir), "--kv-cache-memory", "64MiB",
                     "--max-model-len", "64", "--max-tokens", "3", "--ignore-eos", "hello"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["prompt"] == "hello" and len(record["token_ids"]) == 3
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0 and "--request-rate" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["no-such-command"])
    assert e.value.code == 2


def test_serve_does_not_import_the_benchmark_stack():
    code = ("import sys; from pdserve.server import cli; p = cli.argparse.ArgumentParser(); cli.add_serve_arguments(p); "
            "import pdserve.server.serve; print(sorted(m for m in ('matplotlib', 'pdserve.bench') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(cli.__file__))).stdout
    assert out.strip() == "[]"


def test_adaptive_placement_and_lending_are_exported():
    from pdserve.server.metrics import Metrics

    stats = EngineStats((ActorStats("prefill", 0, 1, 2, 10, 3, 0.0, role="lent", lent_steps=4, unit="prefill"),
                         ActorStats("decode", 1, 0, 2, 10, 3, 0.0, role="decode", local_prefills=5,
                                    remote_prefills=2, unit="decode")), 1, 1)
    text = Metrics(lambda: stats, lambda: []).render().decode()
    for line in ('pdserve_prefills_total{placement="local"} 5.0', 'pdserve_prefills_total{placement="remote"} 2.0',
                 'pdserve_lent_steps_total{actor="prefill",unit="prefill"} 4.0',
                 'pdserve_actor_role{actor="prefill",role="lent",unit="prefill"} 1.0',
                 'pdserve_actor_role{actor="decode",role="decode",unit="decode"} 1.0',
                 'pdserve_prefix_cache_hits_total{actor="decode",unit="decode"} 0.0'):
        assert line in text


def test_each_unit_is_labelled_and_its_routing_counted():
    from pdserve.server.metrics import Metrics

    stats = EngineStats(tuple(ActorStats(role, 0, 0, 0, 10, 1, 0.0, unit=f"{role}{i}", routed_prefill=3 * i + 1,
                                         routed_decode=2 * i) for role in ("prefill", "decode") for i in (0, 1)), 0, 0)
    text = Metrics(lambda: stats, lambda: []).render().decode()
    for line in ('pdserve_routed_total{phase="prefill",unit="prefill1"} 4.0',
                 'pdserve_routed_total{phase="decode",unit="decode1"} 2.0',
                 'pdserve_kv_blocks_total{actor="decode",unit="decode0"} 10.0',
                 'pdserve_actor_steps{actor="prefill",unit="prefill1"} 1.0'):
        assert line in text
