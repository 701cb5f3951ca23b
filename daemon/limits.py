"""Size limits of an event that the parser, the settings and the tools share, defined once.

* :data:`MAX_K`: the largest number of classes the daemon can be configured for (the ``max_k``
  setting and a model's ``k`` are validated against it; the parser's ``max_k`` defaults to it).
* :data:`MAX_MODEL_LEN`: the longest model id, in characters.
* :data:`MAX_ID_LEN`: the longest event id, in characters.
"""

from __future__ import annotations

__all__ = ["MAX_ID_LEN", "MAX_K", "MAX_MODEL_LEN"]

MAX_K = 100_000
MAX_MODEL_LEN = 255
MAX_ID_LEN = 256
