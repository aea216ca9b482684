"""forgeflow benchmarks: `python -m bench.run_all` (make bench) or `python -m bench.<name>`.

See bench/harness.py for the helpers and the result format, bench/RESULTS.md for the numbers.
"""
