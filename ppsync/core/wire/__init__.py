"""The wire: platforms, the token groups and their transport, what a
group's works mean when they end or fail (completion, the CPU twin), bounded
waits, the failure board, teardown, and the torch range.

Imports nothing itself: ppsync.core imports ``torch_support`` first, so an
unsupported torch is refused before anything binds to it."""
