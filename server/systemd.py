"""systemd integration without dependencies: sd_notify, the watchdog heartbeat, the unit file."""
from __future__ import annotations

import asyncio
import logging
import os
import shlex
import socket
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from string import Template

logger = logging.getLogger(__name__)

UNIT_TEMPLATE = Path(__file__).with_name("pdserve.service.in")
CACHE_DIR = "/var/cache/pdserve"
RAY_TMP_DIR = "/tmp/ray"         # the local Ray node's session (sockets, logs) that a driver joins
# `ray start` on this host, which the serve process joins as the Ray driver (--distributed-executor-backend ray)
RAY_UNIT = """After=ray.service
Wants=ray.service
# ray.service runs this host's Ray node as the same User=, e.g.:
#   ExecStart=<ray> start --head --block --port 6379 --node-ip-address <private address> --include-dashboard false
# (or --address <head>:6379 on the other nodes) with RAY_AUTH_MODE=token in its environment.
"""


def sd_notify(message: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send `message` ("READY=1", "WATCHDOG=1", ...) to $NOTIFY_SOCKET; False when there is none.

    A socket name starting with '@' is in the abstract namespace. Never blocks: a message the
    manager's full queue cannot take is dropped.
    """
    address = env.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except BlockingIOError:
        logger.debug("sd_notify(%r): the manager's queue is full; dropped", message)
        return False
    except OSError as e:
        logger.warning("sd_notify(%r) to %r failed: %s", message, env.get("NOTIFY_SOCKET"), e)
        return False
    return True


def watchdog_interval(env: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None when no watchdog is set for us."""
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec), 1) / 2e6
    except ValueError:
        return None


async def watchdog(interval: float, env: Mapping[str, str] = os.environ, alive=lambda: True) -> None:
    """Ping the watchdog from the event loop while `alive()`: a blocked loop or a dead engine stops the pings."""
    while True:
        if alive():
            sd_notify("WATCHDOG=1", env)
        await asyncio.sleep(interval)


def render_unit(serve_args: Sequence[str], *, user: str | None = None, description: str | None = None,
                shutdown_timeout: float = 30.0, watchdog_sec: int = 30, ray: bool = False,
                writable: Sequence[str] = ()) -> str:
    """A systemd unit running `python -m pdserve.server.cli serve <serve_args>` with this interpreter.

    `ray`: the server is the driver of this host's Ray node (ray.service): it starts after it and sees
    its session under /tmp/ray (no private /tmp). `writable`: folders outside the cache folder the service
    writes (a disk KV tier's), opened in ProtectSystem=strict."""
    command = [sys.executable, "-m", "pdserve.server.cli", "serve", *serve_args]
    package_root = Path(__file__).resolve().parent.parent
    return Template(UNIT_TEMPLATE.read_text()).substitute(
        description=description or "pdserve: disaggregated LLM inference server (OpenAI-compatible API)",
        exec_start=_escape_exec(shlex.join(command)),
        working_directory=_escape_specifiers(str(package_root)),
        user_line=f"User={user}" if user else "DynamicUser=yes",
        cache_dir=CACHE_DIR,
        extra_env=_path_env(package_root),
        stop_timeout=int(shutdown_timeout) + 15,
        watchdog_sec=watchdog_sec,
        ray_unit=RAY_UNIT if ray else "",
        ray_service=f"ReadWritePaths={RAY_TMP_DIR}\nEnvironment=RAY_AUTH_MODE=token\n" if ray else "",
        private_tmp="no" if ray else "yes",
        writable_paths="".join(f"ReadWritePaths={_escape_specifiers(path)}\n" for path in writable),
    )


def _escape_specifiers(value: str) -> str:
    return value.replace("%", "%%")


def _escape_exec(value: str) -> str:
    """ExecStart expands '%' specifiers and '$' variables: double them."""
    return _escape_specifiers(value).replace("$", "$$")


def _path_env(package_root: Path) -> str:
    """Environment=PYTHONPATH for a source checkout; nothing when the package is installed."""
    installed = {Path(p).resolve() for p in sysconfig.get_paths().values() if p}
    if package_root in installed:
        return ""
    return f'Environment="PYTHONPATH={_escape_specifiers(str(package_root))}"\n'
