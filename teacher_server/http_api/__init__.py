"""The HTTP front end: the FastAPI app (``/v1/info``, ``/metrics``, TRL's routes), its
limits, and the thread that serves the port and answers the probes."""
