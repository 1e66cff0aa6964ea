"""The caller's names for a token path's calls, and the errors that speak
them."""

from __future__ import annotations

from dataclasses import dataclass

from ppsync.errors import RoleError


@dataclass(frozen=True, slots=True)
class CallNames:
    """How the caller's API names the token path's calls, so that errors speak
    the API in use: the services' ``take()``, the vLLM adapter's
    ``get_prev_sampled_outputs()``, or the token path's own ``consume()``."""

    consume: str = "consume"
    post: str = "post"
    publish: str = "publish"


TOKEN_PATH_NAMES = CallNames()
"""The token path's own names: consume(), post(), publish()."""


def role_error(op: str, *, rank: int, pp_size: int, last: bool) -> RoleError:
    """``op()`` belongs to the last rank (``last``) or to the others, and
    group ``rank`` of ``pp_size`` is not such a rank."""
    who = "the last rank" if last else "a non-last rank"
    return RoleError(f"{op}() belongs to {who}; group rank {rank} of pp_size {pp_size} is "
                     f"{'not the last' if last else 'the last'} rank")
