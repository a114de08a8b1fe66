"""Run the app on uvloop with our own signal handling, so SIGTERM drains instead of dropping streams."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

from aiohttp import web

from pdserve.engine.llm import new_event_loop
from pdserve.server.app import create_app
from pdserve.server.config import ServerConfig
from pdserve.server.options_http import ssl_context
from pdserve.server.state import STATE
from pdserve.server.systemd import sd_notify, watchdog, watchdog_interval

logger = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def run(config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT (then drain and return 0) or until the engine is dead (return 1)."""
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        status = loop.run_until_complete(serve(config))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
    if status and _threads_left():                 # a compute thread stuck in a step would block the exit
        logger.critical("exiting with a compute thread still stuck in a step")
        logging.shutdown()
        os._exit(status)
    return status


def _threads_left() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]


async def serve(config: ServerConfig) -> int:
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, handle_signals=False,
                           shutdown_timeout=5.0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, _on_signal, sig, stop)
    tasks: set[asyncio.Task] = set()
    dead = None
    try:
        sd_notify("STATUS=loading the model")
        await runner.setup()                                  # loads the model and starts the engine
        tls = ssl_context(config.tls) if config.tls is not None else None
        await web.TCPSite(runner, config.host, config.port, ssl_context=tls).start()
        engine = app[STATE].engine
        _announce_ready(runner, tasks, lambda: engine.dead is None, "https" if tls else "http")
        dead = await _stopped_or_dead(stop, engine)
        if dead is not None:
            logger.critical("the engine is dead, exiting: %s", dead)
            sd_notify(f"STATUS=engine dead: {dead}")
        await _drain(app, config)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runner.cleanup()                                # closes the sockets, stops the engine
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
    return 0 if dead is None else 1


async def _stopped_or_dead(stop: asyncio.Event, engine) -> str | None:
    """None after a stop signal; why the engine died if it did first."""
    stopped, died = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(engine.wait_dead())
    await asyncio.wait((stopped, died), return_when=asyncio.FIRST_COMPLETED)
    for waiter in (stopped, died):
        waiter.cancel()
    return None if stop.is_set() else engine.dead


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    logger.info("%s received: draining", sig.name)
    stop.set()


def _announce_ready(runner: web.AppRunner, tasks: set[asyncio.Task], alive, scheme: str) -> None:
    where = ", ".join(f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
                      for host, port, *_ in runner.addresses)
    logger.info("listening on %s", where)
    sd_notify(f"READY=1\nSTATUS=listening on {where}")
    interval = watchdog_interval()
    if interval is not None:
        tasks.add(asyncio.get_running_loop().create_task(watchdog(interval, alive=alive), name="pdserve-watchdog"))


async def _drain(app: web.Application, config: ServerConfig) -> None:
    state = app[STATE]
    sd_notify("STOPPING=1\nSTATUS=draining")
    if await state.drain(config.shutdown_timeout):
        logger.info("drained: every stream finished")
    else:
        logger.info("drained: aborted the streams still running after %gs (%d not closed in time)",
                    config.shutdown_timeout, len(state.generations))
