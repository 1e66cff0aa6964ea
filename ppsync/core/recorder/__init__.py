"""The flight recorder and its dumps: the ring of events (``flight``), the
registry of live paths and the dump directory, a dump's content and file,
an error's dump, the signal and exit triggers, and the writer thread."""
