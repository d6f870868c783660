"""Benchmarks: commands that start stacks or engines, drive load and print a table. Each module
is named for what it measures; :mod:`benchmarks.harness` holds what they share (request timing and
its statistics, managed processes and stacks, core affinity), :mod:`benchmarks.fault_injection`
the faults and their injection, :mod:`benchmarks.chaos_accounting` the chaos soak's accounting.

| module | command | measures |
| --- | --- | --- |
| ``gateway_vs_vllm`` | ``omnirelay bench gateway`` | the gateway against vLLM's own OpenAI server, same engine |
| ``paired_ab`` | ``omnirelay bench ab A B`` | is checkout B faster than checkout A (paired blocks) |
| ``bus_hop`` | ``omnirelay bench bus`` | the floor of one bus hop between two processes |
| ``log_stats_cost`` | ``omnirelay bench log-stats`` | what ``--log-stats`` costs per request and per scrape |
| ``fault_suite`` | ``omnirelay verify faults`` | one fault at a time under streams: lost, repeated or hung |
| ``chaos_soak`` | ``omnirelay verify chaos`` | random overlapping faults under a continuous mixed load |
| ``speech_latency`` | ``omnirelay bench speech`` | TTFP and RTF of a speech pipeline at several concurrencies |
| ``codec_batching`` | ``omnirelay bench codec-batching`` | code2wav's decode with and without cross-request batching |
| ``engine_tracing_cost`` | ``python -m benchmarks.engine_tracing_cost`` | the scheduler cost of engine tracing |

They may import ``services`` and ``libs``; nothing imports them but the command line.
"""
