"""Probes: one-off measurements run by hand, each answering one question
about a cost or a bound (``python -m ppsync.probes.NAME``); the figures and
the commands that made them go in docs/measured.md.

Not benchmarks: ``ppsync bench`` runs none of them and no table or target
reads them. Above the benchmarks (they borrow bench's rank helpers); nothing
imports a probe.

- wakeup.py: what the event loop pays per wait to learn a transfer ended;
- dump_cost.py: what one flight-recorder dump costs at a given capacity;
- sglang_guard.py: the SGLang guard's hooks per PP message and transfer;
- heartbeat.py: the heartbeats' store calls, watcher CPU and beat intervals
  under load.
"""
