"""HTTP pieces every server of the package shares (floor 2): :mod:`.bodies` (a request body and
the admission of its work, bounded), :mod:`.server` (uvicorn with head and write deadlines and a
connection cap, the open-files limit), :mod:`.access` (loopback and bearer checks)."""
