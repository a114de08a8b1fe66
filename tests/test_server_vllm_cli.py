"""`pdserve serve` takes a vLLM command line: the options whose meaning pdserve has, under vLLM's names; an option
it cannot honour exits 2 naming what to use instead. One server is started as a vLLM user would start vLLM (plus
TLS and CORS), and driven with the official openai client and raw CORS requests."""
from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp.test_utils import unused_port

from pdserve.server.cli import main
from pdserve.server.options import add_serve_arguments, server_config_from_args

ORIGIN = "http://app.example"


def config_of(command: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return server_config_from_args(parser.parse_args(command.split()))


def test_vllm_option_names_carry_vllms_meaning(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    config = config_of(f"demo:tiny --dtype half --max-model-len 32k --max-num-seqs 8 --max-num-batched-tokens 512 "
                       f"--gpu-memory-utilization 0.5 --enforce-eager --seed 7 --enable-auto-tool-choice "
                       f"--tool-call-parser llama3_json --served-model-name a b --api-key k --block-size 32 "
                       f"--no-enable-prefix-caching --trust-remote-code -tp 1 --kv-cache-dtype float16 "
                       f"--chat-template {tmp_path / 't.jinja'} --reasoning-parser deepseek_r1 "
                       f"--uvicorn-log-level trace --disable-uvicorn-access-log --distributed-executor-backend mp")
    engine = config.engine
    assert (engine.model, engine.dtype, engine.scheduler.max_model_len, engine.scheduler.max_num_seqs) == (
        "demo:tiny", "float16", 32000, 8)
    assert (engine.scheduler.max_prefill_tokens, engine.cache.gpu_memory_utilization, engine.cuda_graph) == (
        512, 0.5, False)
    assert (engine.seed, engine.cache.block_size, engine.cache.enable_prefix_caching, engine.workers) == (
        7, 32, False, "process")
    assert (config.served_model_names, config.api_key, config.tool_call_parser, config.reasoning_parser) == (
        ("a", "b"), "k", "llama3_json", "deepseek_r1")
    assert (config.chat_template, config.http_log_level, config.access_log) == (
        "{{ messages[0].content }}", "debug", False)
    assert config_of("--max-prefill-tokens 64 --no-cuda-graph --kv-cache-memory 1GiB --max-model-len 2K").engine \
        .scheduler.max_prefill_tokens == 64
    assert config_of("--kv-cache-memory-bytes 2Gi").engine.cache.kv_cache_memory == str(2 * 2**30)
    assert config_of("--chat-template {{messages}}\\n").chat_template == "{{messages}}\n"


@pytest.mark.parametrize("command,replacement", [
    ("-tp 2", "--prefill-device cuda:0,cuda:1"),
    ("--tensor-parallel-size 4", "--prefill-device cuda:0,cuda:1"),
    ("--pipeline-parallel-size 2", "--decode-device"),
    ("-dp 2", "--mode colocated"),
    ("--quantization awq", "--quantization int8"),
    ("-q gptq", "--quantization gguf"),
    ("--kv-cache-dtype fp8", "--kv-cache-dtype auto"),
    ("--kv-cache-dtype bfloat16", "--dtype bfloat16"),
    ("--tool-call-parser mistral", "use hermes or llama3_json"),
    ("--reasoning-parser gpt_oss", "use deepseek_r1 or qwen3"),
    ("--no-enable-chunked-prefill", "raise that to --max-model-len"),
    ("--gpu-memory-utilization 0.8 --kv-cache-memory 4GiB", "give one"),
    ("demo:tiny --model demo", "give one"),
    ("--chat-template no/such/file.jinja", "no such file"),
    ("--chat-template {%bad", "--chat-template"),
    ("--ssl-keyfile key.pem", "need --ssl-certfile"),
    ("--generation-config no/such/folder", "expected auto, vllm or a folder"),
    ("--override-generation-config {\"beam_width\":2}", "temperature"),
])
def test_an_option_pdserve_cannot_honour_exits_2_naming_the_replacement(command, replacement, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *command.split()])
    assert exit_.value.code == 2
    assert replacement in capsys.readouterr().err


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, tiny_model_dir, certificate):
    """`pdserve serve MODEL` with a vLLM command line, over TLS, for browser pages on ORIGIN; ready on READY=1."""
    folder, port = tmp_path_factory.mktemp("vllm-server"), unused_port()
    cert, key = certificate
    command = [sys.executable, "-m", "pdserve.server.cli", "serve", str(tiny_model_dir), "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", "tiny", "--api-key", "secret", "--dtype", "float",
               "--max-model-len", "1K", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
               "--gpu-memory-utilization", "0.9", "--enforce-eager", "--seed", "0", "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--enable-prefix-caching", "--block-size", "16", "--trust-remote-code",
               "-tp", "1", "--kv-cache-dtype", "auto", "--generation-config", "auto", "--disable-log-requests",
               "--disable-log-stats", "--uvicorn-log-level", "warning", "--ssl-certfile", str(cert),
               "--ssl-keyfile", str(key), "--allowed-origins", f'["{ORIGIN}"]',
               # pdserve's own, for a light and quick start on a test machine:
               "--mode", "colocated", "--no-startup-profile", "--ttft-slo-ms", "1000", "--itl-slo-ms", "100"]
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(folder / "notify"))
    notify.settimeout(300)
    log = folder / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env={**os.environ, "NOTIFY_SOCKET": str(folder / "notify")}, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        while b"READY=1" not in notify.recv(4096).split(b"\n"):
            pass
    except TimeoutError:
        proc.kill()
        raise AssertionError(f"the server did not start:\n{log.read_text()}") from None
    finally:
        notify.close()
    yield f"https://127.0.0.1:{port}", log
    proc.terminate()
    assert proc.wait(timeout=60) == 0


def tls_client(base: str, cert: Path) -> openai.AsyncOpenAI:
    context = ssl.create_default_context(cafile=str(cert))
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="secret", max_retries=0,
                              http_client=openai.DefaultAsyncHttpxClient(verify=context))


async def test_a_vllm_command_line_serves_over_tls(vllm_server, certificate):
    base, log = vllm_server
    async with tls_client(base, certificate[0]) as c:
        assert [m.id for m in (await c.models.list()).data] == ["tiny"]
        whole = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=6, temperature=0)
        stream = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=0, stream=True)
        streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert streamed == whole.choices[0].message.content and whole.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0,
                                      http_client=openai.DefaultAsyncHttpxClient(verify=ssl.create_default_context(
                                          cafile=str(certificate[0])))) as c:
            await c.models.list()
    assert "POST /v1/chat/completions" not in log.read_text()     # --uvicorn-log-level warning: no access log


async def test_cors_preflight_and_headers_for_the_allowed_origin_only(vllm_server, certificate):
    base, _ = vllm_server
    context = ssl.create_default_context(cafile=str(certificate[0]))
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
        async with session.options(base + "/v1/chat/completions", headers={"Origin": ORIGIN, **preflight}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
        async with session.options(base + "/v1/chat/completions", headers={"Origin": "http://evil.example",
                                                                           **preflight}) as r:
            assert r.status == 400 and "Access-Control-Allow-Origin" not in r.headers
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
        headers = {"Origin": ORIGIN, "Authorization": "Bearer secret"}
        async with session.post(base + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
        async with session.get(base + "/v1/models", headers={"Origin": ORIGIN}) as r:     # an error, too
            assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
        async with session.get(base + "/v1/models", headers={"Origin": "http://evil.example",
                                                              "Authorization": "Bearer secret"}) as r:
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
