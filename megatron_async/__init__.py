"""megatron_async: asynchronous RLHF with a Megatron-core learner and vLLM replicas.

NOTE import policy: megatron-core and vLLM are imported inside the functions that use them (or in
modules that only those functions import), never at the top of a module that every command loads.
Both are heavy (seconds to import) and probe CUDA when imported; only the learner ranks need
megatron-core and only the replica servers need vLLM, so `config`, `placement`, `eval`,
`serve-replica` and the `train` launcher start without either. Keep new imports of them lazy.
"""
__version__ = "0.1.0"
