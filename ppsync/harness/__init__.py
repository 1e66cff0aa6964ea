"""What checks a deployment: the synthetic workload and its exact checker,
the step drivers, the rank code of ``ppsync run`` and the local launcher.

A user of the library like an engine: it imports services, compat and core.
"""
