"""`megatron-async bench`: the subcommands (`commands`: async speedup, off-policy sweep; `rollout`:
replica throughput and sync seconds; `learner`: our learner step against plain PyTorch; `lm_head`:
the LM head alone; `sync_profile`: a replica's side of a sync; `checkpoint`: what a run checkpoint
costs the learner, sync against async), their arithmetic and plots (`report`) and the CPU contention
measurement (`contention`). Every benchmark the docs name is one of these. Benchmarks are tools that
report ratios measured in one run, never timed tests."""
