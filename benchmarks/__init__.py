"""Side-by-side benchmarks that print ratios (this machine is noisy; a ratio measured in one run is not).

rayjobs bench [NAMES] [--quick] [--json PATH] [--chart PATH]     # or: make bench
"""
