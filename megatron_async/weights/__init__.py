"""Weight sync, learner -> replicas, through vLLM's weight-transfer API: per pipeline stage,
TP-gathered HF tensors (`learner.mapping`) in size-capped buckets (`buckets`), streamed by
`sync.WeightSender` into the `mas_cpu` engine (`cpu_engine`, registered by `vllm_plugin`) by shared
memory (`shm`) on this host or inline over HTTP; or, for GPU replicas, by `nccl_sender.NcclSender`
over vLLM's own NCCL backend."""
