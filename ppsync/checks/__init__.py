"""The checks a user runs on real hardware or a real engine before relying
on ppsync there, each in a package of its own: ``ppsync vllm-check``
(vllm/), ``ppsync sglang-check`` (sglang/), ``make gpu-check`` (gpu/).

Not part of ``make test``: each needs what the test machine lacks (an
engine's own venv, a GPU); the tests run their logic without it.

A user of the library like an engine, above the harness and the
benchmarks: it may import both; nothing below imports it.
"""
