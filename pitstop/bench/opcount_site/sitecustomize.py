"""Put first on a job's ``PYTHONPATH`` by ``pitstop bench scale``: with ``PITSTOP_OPCOUNT_DIR``
set, every control-store client of this process counts its operations
(:mod:`pitstop.bench.opcount`). Without it, nothing happens."""

import os

if os.environ.get("PITSTOP_OPCOUNT_DIR"):
    from pitstop.bench import opcount

    opcount.install(os.environ["PITSTOP_OPCOUNT_DIR"])
