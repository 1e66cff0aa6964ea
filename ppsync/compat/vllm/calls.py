"""How a handler serves vLLM's per-step calls (:data:`HANDLER_CALLS`):
every interface's class (ppsync.compat.vllm.handler) wraps each with
:func:`guarded`, once, where the class is defined.

- A disabled handler (``set_disabled(True)``: vLLM's warm-up) answers
  without issuing anything: :func:`disabled_answer`.
- Otherwise the call runs as an engine call of the rank's watcher
  (ppsync.core.wire.rank_watch): the watcher acts on a failure (it ends an
  idle worker, it sends a held step) only between engine calls, never
  during one.
- An error the watcher met in a call it made for the engine (a held step
  it sent) is raised at the engine's next call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["HANDLER_CALLS", "disabled_answer", "guarded"]

HANDLER_CALLS = ("get_prev_sampled_outputs", "receive", "broadcast", "broadcast_drafts")
"""The calls vLLM's model runner makes per step: every interface's class
guards them (the engine-call lock its watcher acts under, the disabled
switch), and the plugin's error handling wraps them."""


def guarded(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` as a handler serves it: a disabled handler answers without
    it (:meth:`PPHandler.set_disabled`); otherwise it runs as an engine call
    of the rank's watcher (which acts on a failure only between them)."""

    @functools.wraps(call)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:  # a PPHandler (which imports this)
        if self._disabled:
            return disabled_answer(self, name, args, kwargs)
        with self._path.watcher.engine_call():
            deferred, self._deferred = self._deferred, None
            if deferred is not None:
                raise deferred
            return call(self, *args, **kwargs)

    run._ppsync_guarded = True  # type: ignore[attr-defined]
    return run


def disabled_answer(handler: Any, name: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> object:
    """What call ``name`` returns on a disabled ``handler`` (a PPHandler): None, but for
    ``receive``: whether every row needs a sample (decided on the host,
    as when enabled)."""
    if name != "receive":
        return None
    view = handler._batch(args[0] if args else kwargs["input_batch"])
    needed = handler.token_path.codec.kernels.facts(view).needed
    return view.num_reqs > 0 and needed == view.num_reqs
