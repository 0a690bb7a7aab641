"""Weight sync, learner -> replicas, through vLLM's weight-transfer API (`update.WeightUpdate`
runs one update end to end): per pipeline stage, TP-gathered HF tensors (`learner.mapping`) in
size-capped buckets (`buckets`), streamed by a sender (the interface: `sender`):
`host_memory.HostMemorySender` into the `mas_cpu` engine (`cpu_engine`) by shared memory (`shm`)
on this host or inline over HTTP, or `broadcast.BroadcastSender` into vLLM's NCCL engine
(`broadcast_engine`: `mas_nccl`) over NCCL or the same engine over gloo (`gloo`: `mas_gloo`).
Delta sync (only the changed elements) and the changed fraction: `delta`. What the engines share:
`engine_base`. Our engines are registered in vLLM by `vllm_plugin`, the one module that touches
vLLM's internals (checked against its version)."""
