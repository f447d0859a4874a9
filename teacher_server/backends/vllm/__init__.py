"""The vLLM backend (``--backend vllm``): the engine, and one module per part of vLLM it touches.

- :mod:`~teacher_server.backends.vllm.backend`: :class:`VLLMBackend`, the engine and the
  flat log-prob path;
- :mod:`~teacher_server.backends.vllm.engine_flags`: the backend's flags, and vLLM's own;
- :mod:`~teacher_server.backends.vllm.array_logprobs`: the array log-prob path;
- :mod:`~teacher_server.backends.vllm.worker`: what runs inside vLLM's workers (temperature,
  the CPU top-k);
- :mod:`~teacher_server.backends.vllm.candidates` and
  :mod:`~teacher_server.backends.vllm.sampled_draws`: candidate and sampled log-probs in the worker;
- :mod:`~teacher_server.backends.vllm.prefix`: prefix reuse (the capped scheduler);
- :mod:`~teacher_server.backends.vllm.hooks`: the list of every patch into vLLM's (and
  torch's) internals, the versions each was checked against, and its fallback.

Nothing here is imported until the vLLM backend is chosen, so a server started with
another backend never imports vLLM.
"""
