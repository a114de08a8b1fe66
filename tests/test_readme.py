"""README.md works as written: its Python samples run unmodified against `pdserve` started as the
Quickstart says (no options but a free port), serving the default model, SmolLM2-135M-Instruct."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import unused_port

REPO = Path(__file__).resolve().parent.parent
SAMPLES = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)


class Server:
    """`python -m pdserve.server.cli --port N` (what `pdserve` runs), ready once it sends systemd's READY=1."""

    def __init__(self, tmp_path: Path, cache: Path) -> None:
        self.base = f"http://127.0.0.1:{unused_port()}"
        self.log = tmp_path / "pdserve.server.log"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(tmp_path / "notify"))
        notify.settimeout(300)
        env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"), "PDSERVE_CACHE": str(cache),
               "PYTHONPATH": str(REPO)}
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.server.cli", "--port", self.base.rsplit(":", 1)[1]],
                                         cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while b"READY=1" not in notify.recv(4096).split(b"\n"):
                pass
        except TimeoutError:
            self.stop()
            raise AssertionError(f"the server did not start; log:\n{self.log.read_text()}") from None
        finally:
            notify.close()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2):
    running = Server(tmp_path_factory.mktemp("readme-server"), smollm2[0])
    yield running
    running.stop()


def test_the_readme_has_the_samples_this_file_runs():
    assert len(SAMPLES) == 2 and "LLM(" in SAMPLES[0] and "OpenAI(" in SAMPLES[1]
    assert 'model="smollm2"' in SAMPLES[1]


@pytest.mark.parametrize("index", range(len(SAMPLES)), ids=["offline-llm", "openai-client"])
def test_readme_python_sample_runs_as_written(server, smollm2, tmp_path, index):
    env = {**os.environ, "OPENAI_BASE_URL": server.base + "/v1", "PDSERVE_CACHE": str(smollm2[0]),
           "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", SAMPLES[index]], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    if "OpenAI(" in SAMPLES[index]:
        assert "Paris" in result.stdout


def test_the_server_names_its_model_smollm2_and_answers_the_capital_of_france(server):
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    reply = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "Tell me the capital of France."}])
    assert "Paris" in reply.choices[0].message.content and reply.model == "smollm2"
    log = server.log.read_text()
    assert "devices prefill cpu, decode cpu: no GPU visible" in log and re.search(r"dtype \w+: CPU has ", log)
