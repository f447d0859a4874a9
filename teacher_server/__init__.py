"""topk-distill teacher side: a gRPC service that scores token sequences with vLLM (or
transformers, or a recording) and answers compact top-k log-prob payloads."""

__version__ = "0.1.0"
