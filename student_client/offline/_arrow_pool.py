"""Arrow's jemalloc memory pool for a ``teacher-record`` process (Linux; the user's own
``ARROW_DEFAULT_MEMORY_POOL`` wins).

Arrow reads ``ARROW_DEFAULT_MEMORY_POOL`` once, when pyarrow is first imported, so
:mod:`student_client.offline.record_cli` imports this module before anything that imports
pyarrow; in a process that imported pyarrow already it changes nothing. Why: with
pyarrow's default pool (mimalloc) the recorder's RSS kept growing with the rows it
recorded, by more on machines with more cores, although Arrow itself never held more
than a few MiB at a time; with jemalloc it stays flat (measured in docs/datasets.md,
"Memory").
"""

import os
import sys

if sys.platform == "linux" and not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
    os.environ["ARROW_DEFAULT_MEMORY_POOL"] = "jemalloc"  # Linux wheels are built with it
