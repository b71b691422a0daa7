"""The benchmarks, one folder (room) per comparison; bench/README.md says which script makes which results file.

Every script puts the repository root first on `sys.path` and imports the others as `bench.<room>.<module>`
(`from bench.common.measure import run_python`), so a script runs as `python bench/<room>/<name>.py` from any
working directory, and the measuring processes it starts (`python bench/<room>/<name>_children.py ...`) find their
modules the same way.
"""
