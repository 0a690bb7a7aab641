"""One run of the job: the launcher (`launch`: torchrun, build, train, close), the loop (`trainer`),
the learner's state and step on every rank (`learner_state`), rank 0's rollout side
(`rollout_state`), rank 0's per-step metrics and end-of-run report (`report`), the run checkpoint
(`checkpoint`), the SFT warm-up (`sft`), held-out evaluation (`evaluate`), the preflight that
checks the world before anything starts (`preflight`) and fault injection for the reliability
tests (`faults`)."""
