"""Why the engine thread (scheduler.py) does not take or finish work: raised to the HTTP side
when it submits, or inside the thread when a stop interrupts the warm-up."""


class QueueFull(Exception):
    """More requests would wait than `server.queue_size` beyond the free rows."""


class Draining(Exception):
    """The service is shutting down (SIGTERM): no new work."""


class EngineDown(Exception):
    """The engine has failed for good; the process is exiting."""


class WarmupStopped(Exception):
    """The service was asked to stop while it was still warming up."""
