"""The loss kernels: the chunked autograd function on logits (`chunked.py`), the fused
lm_head one (`fused.py`, with its gradient accumulation in `gradient_sink.py` and
`split_columns.py`), the per-row math both run (`functional.py`) and their settings
(`settings.py`). Internal: the entry points in the package above call them."""
