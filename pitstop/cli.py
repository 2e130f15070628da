"""The ``pitstop`` command: the launcher's commands and the benchmarks', side by side.

    pitstop launch | drain | status | emulate      pitstop.launch.cli
    pitstop bench ... | demo                        pitstop.bench.cli

The launcher does not know the benchmarks (they sit above it and start jobs through it);
this module, at the top with them, puts both under one command.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from pitstop.bench import cli as bench_cli
from pitstop.errors import PitstopError
from pitstop.launch import cli as launch_cli


def main(argv: Optional[List[str]] = None) -> int:
    args = launch_cli._parser(more=bench_cli.add_commands).parse_args(argv)
    try:
        return bench_cli.run(args) if args.cmd in bench_cli.COMMANDS else launch_cli.run(args)
    except PitstopError as exc:
        print(f"pitstop: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
