"""The benchmarks behind ``ppsync bench``: the token path against raw
broadcasts and today's scheme, lockstep and pipelined, on local gloo ranks."""
