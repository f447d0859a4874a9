"""SGLang's native ``POST /generate``, the subset a distillation teacher answers
(docs/frameworks.md): ``protocol`` (the request and the row layout), ``serving`` (through
the request pipeline, rendered in SGLang's layout), ``router`` (the FastAPI route)."""
