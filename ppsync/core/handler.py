"""The token path's former module: :class:`TokenPath` lives in
ppsync.core.token_path; this name stays for callers not yet moved."""

from ppsync.core.token_path import TokenPath

__all__ = ["TokenPath"]
