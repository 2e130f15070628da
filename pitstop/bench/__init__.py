"""Benchmarks and the demo: the top layer, beside the command line (``pitstop.cli``).

    pitstop bench groups|recovery|faults|warmup|emulation|machines|hook|control [--json]
    pitstop demo
    pitstop-bench ...            the same benchmarks, their own entry point

Each benchmark measures what it compares side by side in one run and prints one JSON
object; ``scripts/update_benchmarks`` renders the JSON committed under ``benchmarks/``.
"""
