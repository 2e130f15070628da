"""Emulation: run a job of N ranks with a few real processes and model the rest.

Pure modules (no torch.distributed): ``topology`` (network model, alpha-beta costs),
``graph`` (traces, role classes, slicing to the target layout), ``symmetry`` (ranks
that share one timeline), ``replay`` (discrete-event replay), ``chrome_trace``
(Perfetto output), ``synthetic`` (1F1B traces for tests and benchmarks).
``calibrate`` measures gloo over loopback; ``virtual`` and ``record`` are the
process-group side. Nothing is imported here, so ``import pitstop.emulation`` stays cheap.
"""
