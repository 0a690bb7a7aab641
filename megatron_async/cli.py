"""The `megatron-async` command (also `python -m megatron_async`).

    megatron-async train configs/cpu_tiny.yaml trainer.steps=10 rollout.max_lag=0
    megatron-async train configs/cpu_tiny.yaml --resume
    megatron-async eval  configs/cpu_tiny.yaml --checkpoint runs/cpu_tiny/hf/latest
    megatron-async convert hf-to-megatron HF_DIR OUT_DIR --tp 2 --pp 2
    megatron-async config configs/cpu_tiny.yaml trainer.lr=1e-6      # validate + print resolved
    megatron-async bench async configs/cpu_tiny.yaml

Config overrides are `section.key=value` words after the config file; values are parsed as YAML
(`trainer.lr=1e-6`, `rollout.stop=["\\n"]`).
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "train": "run asynchronous RL training (Online DPO by default): learner + vLLM replicas",
    "eval": "GSM8k-style pass@1 with greedy decoding through vLLM replicas",
    "convert": "HF <-> Megatron checkpoint conversion (hf-to-megatron, megatron-to-hf)",
    "bench": "benchmarks: async vs sync speedup, off-policy sweep, rollout/sync throughput",
    "config": "validate a config with overrides and print the resolved YAML",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-async",
        description="Asynchronous RLHF: a Megatron-core learner trains while vLLM replicas generate.",
        epilog="Each command has its own --help: megatron-async train --help",
    )
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("config", help="YAML run config (see configs/)")
        p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. trainer.lr=1e-6")
        return p

    train = with_config(sub.add_parser("train", help=SUBCOMMANDS["train"], description=SUBCOMMANDS["train"]))
    train.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    train.add_argument("--nproc", type=int, default=None,
                       help="learner ranks on this node (default tp x pp); relaunches itself under torchrun")

    ev = with_config(sub.add_parser("eval", help=SUBCOMMANDS["eval"], description=SUBCOMMANDS["eval"]))
    ev.add_argument("--checkpoint", default=None, help="HF checkpoint dir to evaluate (default: model.hf_path)")
    ev.add_argument("--data", default=None, help="jsonl/parquet file or datasets name (default: data.eval)")
    ev.add_argument("--output", default=None, help="write per-problem results as JSON here")

    sub.add_parser("convert", help=SUBCOMMANDS["convert"], description=SUBCOMMANDS["convert"], add_help=False)
    sub.add_parser("bench", help=SUBCOMMANDS["bench"], description=SUBCOMMANDS["bench"], add_help=False)
    with_config(sub.add_parser("config", help=SUBCOMMANDS["config"], description=SUBCOMMANDS["config"]))
    return parser


def _load(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            sys.exit(f"megatron-async: '{what}' is not available in this version ({module} is missing)")
        raise


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # convert and bench own their argument parsing; everything after the word is theirs.
    for i, word in enumerate(argv):
        if word in ("convert", "bench"):
            from megatron_async.log_utils import setup_logging

            setup_logging()
            module = {"convert": "megatron_async.convert", "bench": "megatron_async.bench"}[word]
            return _load(module, word).main(argv[i + 1:])
        if not word.startswith("-"):
            break
    args = build_parser().parse_args(argv)

    from megatron_async.config import ConfigError, load_config
    from megatron_async.log_utils import setup_logging

    setup_logging(args.log_level)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "train" and args.resume:
            cfg.run.resume = True
    except ConfigError as e:
        print(f"megatron-async: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "config":
        import yaml

        from megatron_async.config import flatten

        nested: dict = {}
        for key, value in flatten(cfg).items():
            section, leaf = key.split(".", 1)
            nested.setdefault(section, {})[leaf] = value
        print(yaml.safe_dump(nested, sort_keys=False), end="")
        return 0
    if args.command == "train":
        return _load("megatron_async.train", "train").main(cfg, args.config, args.overrides, nproc=args.nproc)
    if args.command == "eval":
        return _load("megatron_async.evaluate", "eval").main(cfg, checkpoint=args.checkpoint, data=args.data,
                                                             output=args.output)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
