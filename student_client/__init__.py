"""topk-distill student side: wire codec, teacher client, recording/replay and losses.

Needs only torch, numpy, grpcio and protobuf (no vLLM, no grpcio-tools).
"""

__version__ = "0.1.0"
