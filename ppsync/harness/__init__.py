"""What checks a deployment: the synthetic workload and its exact checker,
the step drivers, the rank code of ``ppsync run``, the local launcher and
a function run in a fresh process, bounded (what the benchmarks and the GPU
check run their parts in).

A user of the library like an engine: it imports services, compat and core.
"""
