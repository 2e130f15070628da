"""The ``pitstop`` command line (placeholder until subcommands land)."""
def main(argv=None) -> int:
    return 0
