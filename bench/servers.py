"""The servers bench.compare starts: how to start each, and a subprocess that is always stopped."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.installed_names import prefer_installed
from pdserve.bench.llama_cpp import find_llama_server, llama_server_argv
from pdserve.bench.metrics import RequestRecord

REPO = Path(__file__).resolve().parents[1]
SERVER_NAMES = ("pdserve-adaptive", "pdserve-disaggregated", "pdserve-colocated", "transformers")
OPTIONAL_SERVERS = ("llama.cpp",)   # run only when named in --servers
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to start one server; "{port}" in `argv` is replaced by the chosen port."""

    name: str
    title: str
    argv: tuple[str, ...]
    length_control: str = "vllm"
    require_done: bool = True
    env: dict[str, str] = field(default_factory=dict)
    unavailable: str = ""  # why it cannot run here; empty when it can


@dataclass(frozen=True, slots=True)
class ServerOutcome:
    spec: ServerSpec
    command: str
    error: str = ""
    startup_s: float = 0.0
    summary: dict | None = None
    records: tuple[RequestRecord, ...] = ()
    timeline: tuple[dict, ...] = ()          # bench.server_metrics.PlacementSampler's samples

    @property
    def ok(self) -> bool:
        return not self.error


class ManagedServer:
    """A server subprocess in its own session, stopped on exit: SIGTERM, then SIGKILL after `grace` s."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str], grace: float) -> None:
        self.argv, self.log_path, self.env, self.grace = argv, log_path, env, grace
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ManagedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=os.environ | self.env,
                                            start_new_session=True)
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM the group, wait up to `grace` s for the server, then SIGKILL whatever of it is left."""
        if self.process is None:
            return
        self._signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=self.grace)
        self._signal(signal.SIGKILL)
        self.process.wait()

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)  # NOTE: its own session: the group is the server and its children

    def log_tail(self, lines: int = 6) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def wait_ready(self, base_url: str, timeout: float) -> str:
        """Poll GET /health, then GET /v1/models, until both answer 200; return the first model id.

        Raises RuntimeError if the process exits first or `timeout` seconds pass.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exited with code {self.process.returncode} before it was ready: {self.log_tail()}")
            model = _probe(base_url)
            if model is not None:
                return model
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {timeout:g} s: {self.log_tail()}")


def _probe(base_url: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as health:
            if health.status != 200:
                return None
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5) as models:
            return json.loads(models.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_model_dir() -> str:
    from pdserve.engine.model.demo import default_model_dir as demo_dir

    return str(demo_dir("base"))


def transformers_unavailable() -> str:
    """Why `transformers serve` cannot run here ("" when it can): its serving extras, and
    accelerate (it loads models with a device_map), must be installed."""
    prefer_installed()
    try:
        from transformers.utils.import_utils import (
            is_accelerate_available,
            is_serve_available,
        )
    except ImportError:
        return "transformers is not installed"
    missing = [name for name, ok in (("fastapi+uvicorn (transformers[serving])", is_serve_available()),
                                     ("accelerate", is_accelerate_available())) if not ok]
    return f"transformers serve needs {' and '.join(missing)}, not installed here" if missing else ""


PDSERVE_DEVICES = ("--prefill-device", "cpu", "--decode-device", "cpu")
PREFIX_CACHING_AB = (("prefix-caching-on", "--enable-prefix-caching"),
                     ("prefix-caching-off", "--no-enable-prefix-caching"))
KV_TIERS_AB = (("kv-tiers-on", "--kv-offload-memory 2GiB --kv-offload-disk {folder}:8GiB"),   # a fresh folder per run
               ("kv-tiers-off", ""))
KV_TIERS_POOL = "--kv-cache-memory 28MiB"   # a pool the multiturn load's KV is several times (demo base model)


def pdserve_argv(model_dir: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.server.cli", "serve", "--model", model_dir, "--port", "{port}"]


def parse_variant(text: str) -> tuple[str, str]:
    """`"NAME=ARGS"` -> (NAME, ARGS): a pdserve server started with extra flags ARGS; ValueError otherwise."""
    name, sep, flags = text.partition("=")
    name = name.strip()
    if not sep or not re.fullmatch(r"[A-Za-z0-9._-]+", name) or name in SERVER_NAMES:
        raise ValueError(f"bad --pdserve-variant {text!r}: use NAME='FLAGS', NAME of letters, digits and ._- "
                         f"and not one of {', '.join(SERVER_NAMES)}")
    return name, flags


def variant_specs(model_dir: str, variants: list[tuple[str, str]], pdserve_args: list[str]) -> list[ServerSpec]:
    """One pdserve server per (name, flags), each with `pdserve_args` and then its own flags."""
    return [ServerSpec(name, f"pdserve {name}", (*pdserve_argv(model_dir), *PDSERVE_DEVICES, *pdserve_args,
                                                 *shlex.split(flags)))
            for name, flags in variants]


@dataclass(frozen=True, slots=True)
class LlamaCppSetup:
    """llama.cpp's server for --servers llama.cpp: its binary (None: look on PATH), the GGUF of the same
    weights, its threads, its parallel slots and the type of its K/V cache."""

    binary: str | None = None
    gguf: str | None = None
    threads: int = len(os.sched_getaffinity(0))
    slots: int = 16
    context: int = 32768
    kv_type: str = "f32"

    def spec(self) -> ServerSpec:
        binary = self._binary()
        argv = llama_server_argv(binary or "llama-server", self.gguf or "MODEL.gguf", self.threads, self.context,
                                 self.slots, self.kv_type, "{port}")
        return ServerSpec("llama.cpp", "llama.cpp llama-server", tuple(argv), unavailable=self._unavailable(binary))

    def _binary(self) -> str | None:
        try:
            return find_llama_server(self.binary)
        except FileNotFoundError:
            return None

    def _unavailable(self, binary: str | None) -> str:
        if binary is None:
            return f"llama.cpp: no llama-server binary ({self.binary or 'none on PATH'}; give --llama-server)"
        if not self.gguf or not Path(self.gguf).is_file():
            return f"llama.cpp needs --llama-gguf, a GGUF of the same weights (got {self.gguf!r})"
        return ""


def server_specs(model_dir: str, names: list[str], pdserve_args: list[str],
                 transformers_args: list[str], llama: LlamaCppSetup | None = None) -> list[ServerSpec]:
    """The servers to compare, in `names` order."""
    pdserve = pdserve_argv(model_dir)
    devices = PDSERVE_DEVICES
    hf = [sys.executable, "-m", "transformers.cli.transformers", "serve", model_dir, "--continuous-batching",
          "--device", "cpu", "--host", "127.0.0.1", "--port", "{port}"]
    specs = {f"pdserve-{mode}": ServerSpec(f"pdserve-{mode}", f"pdserve {mode}",
                                           (*pdserve, "--mode", mode, *devices, *pdserve_args))
             for mode in ("adaptive", "disaggregated", "colocated")}
    specs["transformers"] = ServerSpec("transformers", "transformers serve", (*hf, *transformers_args),
                                       length_control="generation-config", require_done=False, env=OFFLINE_ENV,
                                       unavailable=transformers_unavailable() if "transformers" in names else "")
    if "llama.cpp" in names:
        specs["llama.cpp"] = (llama or LlamaCppSetup()).spec()
    return [specs[name] for name in names]


PROGRAMS = {("-m", "pdserve.server.cli"): "pdserve", ("-m", "transformers.cli.transformers"): "transformers"}


def display_command(argv: list[str]) -> str:
    """`argv` as a shell line, `python -m pdserve.server.cli` shown as the `pdserve` command it is."""
    program = PROGRAMS.get(tuple(argv[1:3]))
    return shlex.join([program, *argv[3:]] if program else argv)
