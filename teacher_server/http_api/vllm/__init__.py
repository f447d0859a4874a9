"""vLLM's ``POST /v1/completions`` (prompt log-probs, ``echo``, text prompts) and
token-in ``POST /inference/v1/generate``, the subset a distillation teacher answers
(docs/frameworks.md, docs/trl.md): ``protocol`` (the requests), ``serving`` (through the
request pipeline, rendered in vLLM's layout), ``router`` (the FastAPI routes)."""
