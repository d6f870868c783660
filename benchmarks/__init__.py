"""Benchmarks: the ``omnirelay bench <name>`` commands (``cli/bench_commands.py``), each a module
named for what it measures. :mod:`benchmarks.harness` holds what they share (request timing,
the processes and stacks a bench starts, core affinity) and :mod:`benchmarks.paired` the paired runner every
A/B benchmark is a preset of. They may import ``services`` and ``libs``, never ``tests``; nothing
imports them but the command line and the tests (the verification suites use the harness).
"""
