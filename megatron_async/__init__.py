"""megatron_async: asynchronous RLHF with a Megatron-core learner and vLLM replicas.

NOTE import policy: imports sit at the top of a module, except where a lazy import buys something,
and then the comment beside it says what. The two standing reasons:
- `cli.py` imports each command's module only when that command runs, so that `--help` answers at
  once (torch, vLLM and megatron-core take seconds to import);
- megatron-core and vLLM are imported only by the modules that need them (or inside functions of
  modules every command loads): only the learner ranks need megatron-core and only the replica
  servers vLLM, so `config`, `placement`, `eval` and `serve-replica` start without either. `train`
  does import megatron-core (`run/launch.py` -> `run/trainer.py` -> `learner/schedule.py`: its
  process is learner rank 0 of a one-rank run), and so does `plan-sync` (it builds the model on
  the meta device).
Keep new imports of megatron-core and vLLM out of modules that those commands load.
"""
__version__ = "0.1.0"
