"""The frame: its layout, and the two codecs that pack and check it.

- ``layout``: the words, columns, weights, staging regions, version and flags
  (re-exported here);
- ``host_frames`` / ``device_frames``: frames packed and checked in numpy on
  the host / in torch ops on a device;
- ``codec``: the protocol a token path calls (``StepCodec``) and
  ``codec_for``, which chooses one of its two implementations, once:
- ``host_codec`` / ``device_codec``.
"""

from ppsync.core.frame.layout import (
    FLAG_BAD_VALUES,
    FLAG_EXACT,
    FLAG_HAS_DRAFTS,
    FRAME_FORMAT_VERSION,
    HEADER_WORDS,
    BufferPool,
    FrameLayout,
    FrameView,
    Header,
    Staging,
    slot_need_words,
)

__all__ = [
    "FLAG_BAD_VALUES",
    "FLAG_EXACT",
    "FLAG_HAS_DRAFTS",
    "FRAME_FORMAT_VERSION",
    "HEADER_WORDS",
    "BufferPool",
    "FrameLayout",
    "FrameView",
    "Header",
    "Staging",
    "slot_need_words",
]
