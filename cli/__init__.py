"""The operator's tools: the ``omnirelay`` command line (:mod:`cli.main`), the local launcher
behind ``omnirelay up`` (:mod:`cli.launcher`) and ``omnirelay inspect`` (:mod:`cli.bus_inspect`).

Runs in the operator's shell, never inside a service: it starts services (as ``python -m cli
<service>``) and the benchmarks, and reads the bus. Nothing in ``services`` or ``libs`` imports it.
"""
