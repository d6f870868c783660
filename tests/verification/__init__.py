"""The verification suites: ``omnirelay verify faults`` (:mod:`tests.verification.fault_suite`,
one fault at a time, its faults and their injection in :mod:`~tests.verification.fault_injection`)
and ``omnirelay verify chaos`` (:mod:`tests.verification.chaos_soak`, random overlapping faults under
a continuous load). They start stacks (:mod:`libs.stack.local_stack`) with the benchmarks' harness
(:mod:`benchmarks.harness`) and
judge what the clients got against ground truth; the unit tests hold their accounting. Nothing
outside ``tests`` imports them but :mod:`cli.verify_commands`.
"""
