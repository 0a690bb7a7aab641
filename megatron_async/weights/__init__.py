"""Weight sync, learner -> replicas, through vLLM's weight-transfer API. One pipeline with thin ends:
`update.WeightUpdate` runs one update end to end and builds each stage's stream once (TP-gathered
HF tensors from `learner.mapping`, cast, `delta`'s bit-exact change count and deltas); a sender
(the interface: `update.WeightSender`) only carries it: `host_memory.HostMemorySender` (safetensors
buckets in shared memory on this host or inline over HTTP) or `broadcast.BroadcastSender` (vLLM's
NCCL weight-transfer protocol over NCCL or gloo). `build` makes the run's update from its config.
The replica's end: our vLLM engines `mas_cpu`, `mas_nccl`, `mas_gloo` (`engines`), registered in
vLLM by `vllm_plugin`, the one module that touches vLLM's internals (checked against its version).
`plan` computes what a sync of a GPU layout costs (`megatron-async plan-sync`)."""
