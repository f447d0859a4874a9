"""Tools shared by the tests, examples, benchmarks and scripts; not installed.

``launch``: start a teacher server subprocess and wait until it is ready.
``tiny_model``: the tiny Qwen2 model and byte tokenizer the tests and the demo use.
"""
