"""Weight sync, learner -> replicas: per pipeline stage, TP-gathered HF tensors (`learner.mapping`)
in size-capped buckets (`buckets`) over a transport (`shm` on this host, the control socket, or
`nccl`), driven by `sync.WeightSender`."""
