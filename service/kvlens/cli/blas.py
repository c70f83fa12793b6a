"""Imported by :mod:`kvlens.cli` before anything imports numpy: numpy's OpenBLAS gets one thread
unless ``OPENBLAS_NUM_THREADS`` says otherwise.

OpenBLAS starts a thread a core when numpy is imported, and each spins about 0.1 s waiting for
work after its start and after every call: a tenth of a CPU second at every start of every
command, taken from DuckDB's threads on a small machine. kvlens's linear algebra is small (the
calibration's QR of at most 200,000 rows by a few columns), for which one thread is as fast, and
its results do not depend on the number of cores then. Only the command line sets it: the vLLM
plugin runs in vLLM's process, whose threads are not kvlens's to choose."""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
