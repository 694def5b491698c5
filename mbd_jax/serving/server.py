"""`mbd-jax serve`: the data and admin apps on two uvicorn servers, the engine thread, SIGTERM drain.

Startup: the HTTP ports open at once (/health 200, /ready 503) while the engine thread loads and
compiles every shape; /ready turns 200 when it can serve.

SIGTERM (or SIGINT) drains: the ports keep listening and answer 503 to new work (/ready too) for
at least drain_min_s and until the in-flight requests finish, at most drain_timeout_s; requests
still running then end with a 503 error (an error event on streams). Exit codes: 0 after a clean
drain, 3 when accepted requests were cut by the drain timeout, 1 when the engine failed for good
(the process exits then rather than serve without an engine; /health says 503 meanwhile).

Across several processes (--coordinator ...), process 0 serves HTTP and drives the engine; the
others only mirror its engine calls (engine/mirror.py) and exit when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import logging.handlers
import os
import pathlib
import signal
import socket
import ssl
import time
from collections.abc import Sequence

import jax
import uvicorn

from mbd_jax import canvas_model, chat, compile_cache
from mbd_jax.build_info import code_version
from mbd_jax.cache.prefix_store import PrefixStore, model_identity
from mbd_jax.checkpoint import load_model
from mbd_jax.config import (MonitoringConfig, ServeConfig, ServerConfig, model_version,
                            resolve_model_path)
from mbd_jax.decoding.voting import record_shape
from mbd_jax.engine import Engine, mirror
from mbd_jax.engine.canvas_engine import CanvasEngine
from mbd_jax.errors import UserError
from mbd_jax.parallel import multihost
from mbd_jax.serving import access, keys
from mbd_jax.serving.app import Service
from mbd_jax.serving.routes import build_apps
from mbd_jax.serving.connections import connection_budget, guarded_protocol, quiet_repeats
from mbd_jax.serving.metrics import Metrics
from mbd_jax.serving.scheduler import Scheduler

log = logging.getLogger("mbd_jax.serving")

EXIT_OK, EXIT_ENGINE_FAILED, EXIT_DRAIN_CUT = 0, 1, 3


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the service drains on SIGTERM itself."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def load_api_keys(path: str | None, given: Sequence[str] = ()) -> list[keys.ApiKey]:
    """MBD_API_KEYS (plain, comma-separated), the key file (plain or named: keys.py) and the
    keys given on the command line (plain), each name and key once."""
    plain = [k.strip() for k in os.environ.get("MBD_API_KEYS", "").split(",") if k.strip()]
    found = [*map(keys.plain, plain), *(keys.load_key_file(path) if path else []),
             *map(keys.plain, given)]
    keys.check_unique(found)
    return found


def build_engine(cfg: ServeConfig, mesh: jax.sharding.Mesh | None = None) -> Engine | CanvasEngine:
    """The service's engine (on every process of a multi-process launch)."""
    if canvas_model.is_canvas_model(cfg.model):
        return build_canvas_engine(cfg, mesh)
    model = load_model(cfg.model, mesh=mesh, runtime=dataclasses.asdict(cfg.runtime))
    if model.tokenizer is None:
        raise UserError(f"model {cfg.model}: the service needs a tokenizer")
    if cfg.generation.block_size not in (None, model.cfg.block_size):
        raise UserError(f"generation.block_size {cfg.generation.block_size} does not match the "
                        f"model's block_size {model.cfg.block_size}")
    s = cfg.server
    store = None
    if cfg.cache.enabled and jax.process_count() > 1:
        log.warning("the prefix cache is off: it runs on one process (cache.enabled ignored)")
    elif cfg.cache.enabled:
        c = cfg.cache
        store = PrefixStore(model_identity(model.cfg, model.path.parent), model.cfg.block_size,
                            ram_bytes=c.ram_capacity_mb << 20, storage_path=c.storage_path,
                            disk_bytes=(c.disk_capacity_mb << 20) if c.storage_path else 0,
                            ttl_s=c.ttl_s)
    limit = max(cfg.generation.max_new_tokens_limit, cfg.generation.thinking_max_new_tokens)
    steps, positions = record_shape(cfg.decoding.max_nfe, limit, model.cfg.max_seq_len)
    engine = Engine(model.cfg, model.params, batch_size=s.max_batch_size, buffer_size=s.buffer_size,
                    prefill_chunk=s.prefill_chunk, kv_pool_tokens=s.kv_pool_tokens,
                    tokenizer=model.tokenizer, record_steps=steps, record_len=positions,
                    prefix_store=store, mesh=mesh)
    return engine


def build_canvas_engine(cfg: ServeConfig, mesh: jax.sharding.Mesh | None) -> CanvasEngine:
    """The engine of a uniform-noise canvas model (DiffusionGemma) on one process's devices
    (`mesh`; multi-process serving is not built for this family)."""
    if jax.process_count() > 1:
        raise UserError(f"model {cfg.model}: a diffusion_gemma model is served by one process "
                        "(multi-process serving is not built for this family yet)")
    model = canvas_model.load(cfg.model, quantization=cfg.runtime.quantization)
    if model.tokenizer is None:
        raise UserError(f"model {cfg.model}: the service needs a tokenizer")
    s = cfg.server
    return CanvasEngine(model.cfg, model.params, batch_size=s.max_batch_size,
                        kv_pool_tokens=s.kv_pool_tokens, prefill_chunk=s.prefill_chunk,
                        tokenizer=model.tokenizer, defaults=model.decoding, mesh=mesh)


def build_service(cfg: ServeConfig, api_keys: list[keys.ApiKey], profile_dir: str = "profiles",
                  mesh: jax.sharding.Mesh | None = None) -> Service:
    t0 = time.monotonic()
    engine = build_engine(cfg, mesh)
    load_seconds = time.monotonic() - t0
    if jax.process_count() > 1:  # process 0: every engine call goes to the followers first
        engine = mirror.EngineLeader(engine)
    metrics = Metrics(engine)
    metrics.model_load.set(load_seconds)
    config_path = resolve_model_path(cfg.model)
    model_dir = config_path.parent
    where = model_dir if config_path.name == "config.yaml" else config_path  # a dir, or a preset
    version = model_version(model_dir) if where == model_dir else ""
    metrics.model_info.labels(name=engine.cfg.name, path=str(where), version=version,
                              code_version=code_version()).set(1)
    log.info("model %s%s from %s: loaded in %.1f s", engine.cfg.name,
             f" {version}" if version else "", where, load_seconds)
    metrics.queue_limit.set(cfg.server.queue_size)
    scheduler = Scheduler(engine, cfg, metrics)
    template = chat.for_model(model_dir, engine.cfg.chat_template)
    return Service(cfg=cfg, scheduler=scheduler, metrics=metrics, template=template,
                   model_name=cfg.server.served_model_name or engine.cfg.name,
                   api_keys=api_keys, profile_dir=pathlib.Path(profile_dir))


def listen(cfg: ServeConfig) -> list[socket.socket]:
    """The listening sockets (data port, then the admin port unless it is 0), bound before the
    model loads: a port in use is one `error:` line at once, not a traceback after compiling."""
    s, sockets = cfg.server, []
    for name, host, port in (("--port", s.host, s.port), ("--admin-port", s.admin_host, s.admin_port)):
        if port == 0:
            continue
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(2048)
            sock.set_inheritable(True)
        except OSError as e:
            for other in sockets:
                other.close()
            raise UserError(f"cannot listen on {host}:{port} ({name}): {e.strerror}") from None
        sockets.append(sock)
    return sockets


def tls_context(s: ServerConfig) -> ssl.SSLContext | None:
    """The data port's TLS context (None: plain HTTP), loaded before the model so a wrong file is
    one error line at start, naming the field."""
    if s.ssl_certfile is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)  # TLS 1.2+, no client certificate
    try:
        ctx.load_cert_chain(s.ssl_certfile, s.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise UserError(f"server.ssl_certfile {s.ssl_certfile} / server.ssl_keyfile "
                        f"{s.ssl_keyfile}: cannot load the certificate and key "
                        f"({getattr(e, 'strerror', None) or e})") from None
    return ctx


async def _serve(svc: Service, sockets: list[socket.socket], tls: ssl.SSLContext | None) -> int:
    """Runs both servers until a drain or an engine failure ends them; returns the exit code."""
    s = svc.cfg.server
    data, admin = build_apps(svc, admin_port=bool(s.admin_port))
    level = svc.cfg.monitoring.log_level
    protocol = guarded_protocol(connection_budget(len(sockets), s.max_connections),
                                s.header_timeout_s, svc.metrics)

    def config(app, context: ssl.SSLContext | None) -> uvicorn.Config:
        return uvicorn.Config(app, log_level=level, log_config=None,  # our handlers (setup_logging)
                              lifespan="off", access_log=False,
                              timeout_graceful_shutdown=5, timeout_keep_alive=s.keep_alive_s,
                              http=protocol, ssl_context_factory=(
                                  None if context is None else lambda *_: context))

    servers = [_Server(config(app, context))
               for app, context in ((data, tls), (admin, None))[: len(sockets)]]
    quiet_repeats()  # after uvicorn.Config set up its loggers
    loop = asyncio.get_running_loop()
    draining, failed = asyncio.Event(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, draining.set)
    svc.scheduler.on_fatal = lambda: loop.call_soon_threadsafe(failed.set)
    code = EXIT_OK

    def stop_servers() -> None:
        for server in servers:
            server.should_exit = True

    async def drain():
        nonlocal code
        await draining.wait()
        if not svc.scheduler.ready:  # nothing accepted yet: nothing to drain or announce
            log.info("stopping during warm-up")
            svc.scheduler.draining = True  # no further warm-up program compiles
            stop_servers()
            return
        log.info("draining: %d requests in flight", svc.scheduler.in_flight())
        svc.scheduler.draining = True
        start = loop.time()
        while svc.scheduler.in_flight() and loop.time() < start + s.drain_timeout_s:
            await asyncio.sleep(0.05)
        cut = svc.scheduler.abort_all(503, f"the server shut down before this request finished "
                                           f"(drain_timeout_s {s.drain_timeout_s:g})")
        if cut:
            svc.metrics.rejected.labels("drain_timeout").inc(cut)
            log.error("drain timeout: %d accepted requests were cut", cut)
            code = EXIT_DRAIN_CUT
        await asyncio.sleep(max(0.0, start + s.drain_min_s - loop.time()))
        await asyncio.sleep(0.2)  # let the last responses flush
        stop_servers()

    async def engine_failed():
        nonlocal code
        await failed.wait()
        code = EXIT_ENGINE_FAILED
        await asyncio.sleep(0.5)  # let the error responses flush
        stop_servers()

    svc.scheduler.start()
    watchers = [asyncio.create_task(drain()), asyncio.create_task(engine_failed())]
    await asyncio.gather(*(server.serve(sockets=[sock]) for server, sock in zip(servers, sockets)))
    for w in watchers:
        w.cancel()
    return code


def setup_logging(m: MonitoringConfig) -> None:
    """The process's log: stderr, or monitoring.log_file rotated by size."""
    handler: logging.Handler = logging.StreamHandler()
    if m.log_file:
        try:
            handler = logging.handlers.RotatingFileHandler(m.log_file, maxBytes=m.log_max_bytes,
                                                           backupCount=m.log_backups)
        except OSError as e:
            raise UserError(f"monitoring.log_file {m.log_file}: {e.strerror}") from None
    logging.basicConfig(level=m.log_level.upper(), handlers=[handler], force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # orbax (through absl) narrates every checkpoint read at INFO: only when debugging
    logging.getLogger("absl").setLevel(logging.DEBUG if m.log_level == "debug" else logging.WARNING)
    access.setup(m)


def serve(cfg: ServeConfig, api_keys: list[keys.ApiKey], mesh: jax.sharding.Mesh | None = None) -> int:
    setup_logging(cfg.monitoring)
    cache = compile_cache.enable(cfg.server.compile_cache, "server.compile_cache")  # first compile
    cfg = multihost.share(cfg)  # process 0's config builds every process's engine
    if not multihost.is_leader():  # a follower: mirror process 0's engine calls until it stops
        mirror.follow(build_engine(cfg, mesh))
        return 0
    sockets = listen(cfg)
    tls = tls_context(cfg.server)
    log.info("compilation cache: %s", cache or "off")
    if not api_keys:
        log.warning("no API keys configured (--api-key, --api-key-file or MBD_API_KEYS): the "
                    "service is open")
    svc = build_service(cfg, api_keys, mesh=mesh)
    code = EXIT_ENGINE_FAILED
    try:
        code = asyncio.run(_serve(svc, sockets, tls))
    finally:
        stopped = svc.scheduler.stop()  # closes the engine (and tells the followers to exit)
    code = EXIT_ENGINE_FAILED if svc.scheduler.error is not None else code
    if not stopped:  # the compile running now (warm-up or background) is abandoned, not awaited
        log.info("stopped during warm-up" if not svc.scheduler.ready else
                 "stopped while compiling a prefill bucket in the background")
        logging.shutdown()
        os._exit(code)
    return code
