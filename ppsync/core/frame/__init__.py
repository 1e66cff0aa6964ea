"""The frame format: its layout, and its frames on the host and on a device.

- ``rows``: a step's rows, declared once: ``ROW_COLUMNS`` and the records
  that carry them, ``SampledStep`` (to the token path) and ``ReleasedStep``
  (from it) (re-exported here);
- ``layout``: the words, columns, weights, staging regions, version and flags
  (re-exported here);
- ``numpy_frames`` / ``device_frames``: ``NumpyFrames`` / ``DeviceFrames``,
  frames packed and checked in numpy on the host / in torch ops on a device.

The codecs that use them per step are ppsync.core.codec.
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
from ppsync.core.frame.rows import ROW_COLUMNS, ReleasedStep, SampledStep

__all__ = [
    "FLAG_BAD_VALUES",
    "FLAG_EXACT",
    "FLAG_HAS_DRAFTS",
    "FRAME_FORMAT_VERSION",
    "HEADER_WORDS",
    "ROW_COLUMNS",
    "BufferPool",
    "FrameLayout",
    "FrameView",
    "Header",
    "ReleasedStep",
    "SampledStep",
    "Staging",
    "slot_need_words",
]
