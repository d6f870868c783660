"""Benchmarks: ``omnirelay bench <name>`` commands (``cli/bench_commands.py``) that start stacks or
engines, drive load and print a table. Each module is named for what it measures;
:mod:`benchmarks.harness` holds what they share (request timing and its statistics, managed
processes and stacks, core affinity) and :mod:`benchmarks.paired` the paired runner that every A/B
benchmark is a preset of (arms × workloads × rounds in alternating order → a table and JSON):
``gateway``, ``vllm``, ``ab``, ``log-stats``, ``sync``, ``nice``, ``token-cost``, ``codec-batching``
and ``tracing``. The verification suites (``omnirelay verify faults|chaos``) are not tools: they
live in ``tests/verification`` and use the harness from there.

They may import ``services`` and ``libs``, never ``tests``; nothing imports them but the command
line and the tests.
"""
