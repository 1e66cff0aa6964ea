"""ppsync's guard inside SGLang's PP loop (``PPSYNC_SGLANG=1``).

``ppsync.compat.sglang.plugin`` is SGLang's plugin (entry point group
``sglang.srt.plugins``); ``hooks`` holds its AROUND hooks on
``SchedulerPPMixin``; ``guard`` one stage's views, bounded waits and named
failures; ``digest`` the view of a PP message and its comparison (pure
Python: tested without SGLang).
"""

from ppsync.compat.sglang.digest import StepView, check_views, first_difference, view_of

__all__ = ["StepView", "check_views", "first_difference", "view_of"]
