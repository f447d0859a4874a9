"""The gRPC front end: the ``Teacher`` servicer, its handlers, bearer-token check,
per-stream backpressure, and the answer messages it sends."""
