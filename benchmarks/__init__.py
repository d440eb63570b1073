"""Side-by-side benchmarks of ds_mp (not tests): ``python -m benchmarks.run [--quick] [--only NAME,...]``."""
