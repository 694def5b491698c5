"""Multi-process launch: one JAX process per host, one device mesh across all of them.

JAX is multi-controller: every process runs the same program and must make the same jitted calls
in the same order with the same host inputs. Process 0 owns I/O (reads prompts, serves HTTP,
prints, writes files) and broadcasts over the device collectives what the others need:

- offline (generate, eval, bench): `share` sends the prompts and decode configs once; the rest
  of an `Engine.generate` is a pure function of them, so every process computes the same host
  arrays and makes the same calls;
- the service: process 0's scheduler decides when to admit, prefill, decode and cancel from
  timing and client traffic, so its engine sends every state-changing call to the followers
  first (engine/mirror.py).

    mbd-jax serve --mesh expert=-1 --coordinator host0:1234 --num-processes 2 --process-id 0
    (or MBD_COORDINATOR / MBD_NUM_PROCESSES / MBD_PROCESS_ID; docs/multihost.md)
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
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
