"""The engine: compiled programs over the model's cache, and the host-side planning around them.

- core.py: `Engine`, the thin stateful shell (parameters, KV pool, compiled programs, the
  calls the service and `generate` make);
- admission.py: the prefill calls an admission makes, the rows' decoding settings;
- results.py: `GenerationResult`, a finished row's result and vote;
- prefix.py: the prefix-cache glue (lookup, load into a row, the offloader);
- transfer.py: host decode state onto the device in one transfer per dtype.
"""

from mbd_jax.engine.admission import ROW_PREFILL_MIN, prefill_buckets
from mbd_jax.engine.core import Engine
from mbd_jax.engine.prefix import PrefixHit
from mbd_jax.engine.results import GenerationResult

__all__ = ["Engine", "GenerationResult", "PrefixHit", "ROW_PREFILL_MIN", "prefill_buckets"]
