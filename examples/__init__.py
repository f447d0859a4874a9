"""End-to-end examples: the default tiny teacher, its training text, the distillation demo.

Run from the repository root (``python -m examples.<module>``); this package is not part
of the installed distribution.
"""

__all__: list[str] = []
