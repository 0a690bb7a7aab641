"""`megatron-async bench`: the subcommands (`commands`: async speedup, off-policy sweep, rollout
throughput), their arithmetic and plots (`report`) and the CPU contention measurement
(`contention`). Benchmarks are tools that report ratios measured in one run, never timed tests."""
