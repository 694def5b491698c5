"""Multi-process launch: one JAX process per host, one device mesh across all of them.

JAX is multi-controller: every process runs the same program and must make the same jitted calls
in the same order with the same host inputs. Process 0 owns I/O (reads prompts, serves HTTP,
prints, writes files) and broadcasts over the device collectives what the others need:

- offline (generate, eval, bench): `share` sends the prompts and decode configs once; the rest
  of an `Engine.generate` is a pure function of them, so every process computes the same host
  arrays and makes the same calls;
- the service: process 0's scheduler decides when to admit, prefill, decode and cancel from
  timing and client traffic, so `EngineLeader` sends every state-changing engine call to the
  followers (`follow`) before making it itself.

    mbd-jax serve --mesh expert=-1 --coordinator host0:1234 --num-processes 2 --process-id 0
    (or MBD_COORDINATOR / MBD_NUM_PROCESSES / MBD_PROCESS_ID; docs/multihost.md)
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import threading
import time
from typing import Any

import jax
import numpy as np

from mbd_jax.errors import UserError

log = logging.getLogger(__name__)

ENV = {"coordinator": "MBD_COORDINATOR", "num_processes": "MBD_NUM_PROCESSES",
       "process_id": "MBD_PROCESS_ID"}
HEARTBEAT_S = 10.0  # an idle leader pings the followers this often (env MBD_HEARTBEAT_S)


def heartbeat_seconds() -> float:
    """MBD_HEARTBEAT_S, else HEARTBEAT_S: how often an idle leader pings the followers (they
    wait in a collective)."""
    value = os.environ.get("MBD_HEARTBEAT_S")
    if value is None:
        return HEARTBEAT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise UserError(f"MBD_HEARTBEAT_S={value!r}: give a number of seconds > 0")
    return seconds


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("devices and processes (docs/multihost.md)")
    g.add_argument("--mesh", help="device mesh, e.g. data=1,expert=4,tensor=2 (one size may be -1 "
                                  "to fill); default: one device, or expert=-1 across processes")
    g.add_argument("--coordinator", help=f"HOST:PORT of process 0 (env {ENV['coordinator']})")
    g.add_argument("--num-processes", type=int, help=f"processes in the job (env {ENV['num_processes']})")
    g.add_argument("--process-id", type=int, help=f"this process, 0..N-1 (env {ENV['process_id']})")


def initialize(args: argparse.Namespace) -> None:
    """Joins the multi-process job the flags (or environment) describe; nothing for one process.
    Must run before any JAX computation."""
    values = {}
    for name, env in ENV.items():
        value = getattr(args, name, None)
        if value is None and os.environ.get(env):
            value = os.environ[env]
        values[name] = value
    if values["coordinator"] is None and values["num_processes"] is None:
        if values["process_id"] is not None:
            raise UserError("--process-id needs --coordinator and --num-processes")
        return
    missing = [f"--{k.replace('_', '-')}" for k, v in values.items() if v is None]
    if missing:
        raise UserError(f"a multi-process launch needs {', '.join(missing)} too "
                        f"(or {', '.join(ENV[k] for k, v in values.items() if v is None)})")
    coordinator = str(values["coordinator"])
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--coordinator {coordinator!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
    try:
        n, pid = int(values["num_processes"]), int(values["process_id"])
    except ValueError:
        raise UserError("--num-processes and --process-id must be integers") from None
    if n < 1 or not 0 <= pid < n:
        raise UserError(f"--process-id {pid} must be in [0, --num-processes {n})")
    # CPU devices talk over gloo (TCP); GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=n, process_id=pid)
    log.info("process %d of %d: %d local devices, %d in all", pid, n, jax.local_device_count(),
             jax.device_count())


def mesh_from_args(args: argparse.Namespace) -> jax.sharding.Mesh:
    """The --mesh of a command (default: one device; across processes, every device on
    `expert`). Process 0's flag decides for all."""
    from mbd_jax.parallel import mesh as meshlib

    spec = share(getattr(args, "mesh", None))
    if spec is None:
        if jax.process_count() == 1:
            return meshlib.single_device_mesh()
        spec = "expert=-1"
    return meshlib.make_mesh(meshlib.parse_mesh(spec))


def is_leader() -> bool:
    """Process 0: the one that does I/O."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here for the others (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def share(obj: Any) -> Any:
    """Process 0's `obj` on every process (pickled, broadcast over the device collectives);
    `obj` itself with one process."""
    if jax.process_count() == 1:
        return obj
    from jax.experimental import multihost_utils

    payload = pickle.dumps(obj) if is_leader() else b""
    n = int(multihost_utils.broadcast_one_to_all(np.array([len(payload)], np.int32))[0])
    words = max(64, 1 << (-(-n // 4) - 1).bit_length())  # power-of-two int32 buckets
    buf = np.zeros(words * 4, np.uint8)
    buf[: len(payload)] = np.frombuffer(payload, np.uint8)
    out = multihost_utils.broadcast_one_to_all(buf.view(np.int32))
    return pickle.loads(np.asarray(out).view(np.uint8)[:n].tobytes())


class EngineLeader:
    """Process 0's engine in a multi-process service: every state-changing call is first sent
    to the followers, which make the same call on their engine (`follow`). Reads (cfg,
    host_view, result_of, ...) go straight to the engine. An idle leader sends a heartbeat every
    heartbeat_seconds() so the followers' wait never times out."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.heartbeat_s = heartbeat_seconds()
        self._lock = threading.Lock()  # one call (send + make) at a time, in one order
        self._last = time.monotonic()
        self._closed = False
        threading.Thread(target=self._heartbeat, name="mbd-heartbeat", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _call(self, command: tuple, fn, *args):
        with self._lock:
            share(command)
            self._last = time.monotonic()
            return fn(*args)

    def _heartbeat(self) -> None:
        while not self._closed:
            time.sleep(1.0)
            with self._lock:
                if not self._closed and time.monotonic() - self._last > self.heartbeat_s:
                    share(("noop",))
                    self._last = time.monotonic()

    def warmup(self, progress=None) -> None:
        """The followers compile silently; `progress` reports process 0's steps."""
        self._call(("warmup",), self.engine.warmup, progress)

    def empty_state(self):
        return self._call(("empty_state",), self.engine.empty_state)

    def begin_admit(self, requests, prefetched=None):  # (no prefix cache across processes)
        return self._call(("begin_admit", requests), self.engine.begin_admit, requests)

    def prefill_step(self, adm) -> bool:
        return self._call(("prefill_step",), self.engine.prefill_step, adm)

    def finish_admit(self, state, adm):
        return self._call(("finish_admit",), self.engine.finish_admit, state, adm)

    def decode_call(self, state, max_steps=None):
        return self._call(("decode_call", max_steps), self.engine.decode_call, state, max_steps)

    def cancel(self, state, rows):
        return self._call(("cancel", list(rows)), self.engine.cancel, state, rows)

    def release(self, rows) -> None:
        self._call(("release", [int(r) for r in rows]), self.engine.release, rows)

    def reset_buffers(self) -> None:
        self._call(("reset_buffers",), self.engine.reset_buffers)

    def close(self) -> None:
        """Tells the followers to exit."""
        with self._lock:
            if not self._closed:
                self._closed = True
                share(("stop",))


def follow(engine) -> None:
    """A follower process of the service: makes the leader's engine calls until it stops."""
    state = adm = None
    while True:
        command = share(None)
        name, args = command[0], command[1:]
        if name == "stop":
            return
        try:
            if name == "warmup":
                engine.warmup()
            elif name == "empty_state":
                state = engine.empty_state()
            elif name == "begin_admit":
                adm = engine.begin_admit(*args)
            elif name == "prefill_step":
                engine.prefill_step(adm)
            elif name == "finish_admit":
                state = engine.finish_admit(state, adm)
            elif name == "decode_call":
                state = engine.decode_call(state, *args)
            elif name == "cancel":
                state = engine.cancel(state, *args)
            elif name == "release":
                engine.release(*args)
            elif name == "reset_buffers":
                engine.reset_buffers()
        except UserError as e:  # the leader hit the same error and answered its client
            log.info("follower: %s: %s", name, e)
        except Exception:  # the leader failed the same step and recovers; so does this process
            log.exception("follower: %s failed", name)
