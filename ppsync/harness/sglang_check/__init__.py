"""ppsync sglang-check."""
