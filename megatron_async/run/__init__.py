"""One run of the job: the launcher (`launch`: torchrun, build, train, close), the torchrun
arguments (`torchrun`), the loop (`trainer`), the learner's state and step on every rank
(`learner_state`), rank 0's part of the loop and its null twin (`rank0`), rank 0's rollout side
(`rollout_state`), rank 0's per-step metrics and end-of-run report (`report`), the run checkpoint
(`checkpoint`), stopping on a signal at a step boundary (`stop`), one run per folder (`run_lock`),
the NaN guard (`bad_steps`), `rollout.max_lag: auto` (`adaptive_lag`), `trainer.auto_balance`
(`auto_balance`), the SFT warm-up (`sft`), held-out evaluation (`evaluate`) and the `eval`
command (`eval_command`), the preflight that checks the world before anything starts
(`preflight`) and fault injection for the reliability tests (`faults`)."""

# time.time() when `megatron-async train` started, for the summary's wall time (run/report.py):
# the process's own start is earlier where a script execs the command after installing
# (launch/quickstart.sh); the ranks the command relaunches under torchrun inherit it
TRAIN_STARTED_ENV = "MEGATRON_ASYNC_TRAIN_STARTED"
