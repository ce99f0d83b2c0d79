"""semix benchmarks: `make bench` runs every bench/bench_*.py and writes bench/RESULTS.md."""
