"""Worker for tests/test_conversion.py: learner checkpoints saved at one layout, resumed at another.

    torchrun --nproc-per-node 2 tests/dist/checkpoint_worker.py save   CKPT OUT HF_DIR --tp 2
    python                      tests/dist/checkpoint_worker.py resume CKPT OUT HF_DIR OTHER_HF_DIR

save:   load HF weights, one Adam step, save model+optimizer+scheduler, a second step -> OUT/save.pt
resume: load the checkpoint into a fresh model/optimizer, the same second step -> OUT/resume.pt;
        then try a checkpoint with a corrupted file and a model of another architecture and
        record the errors in OUT/errors.json.
"""
import argparse
import json
import shutil
from pathlib import Path

import torch

from learner_worker import batches, nll  # tests/dist is on sys.path as the script's directory

SETTINGS = dict(lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10, decay_style="cosine", adam_eps=1e-6)


def setup(hf_dir):
    from megatron_async.learner.model import build_model
    from megatron_async.learner.optimizer import OptimSettings, build_optimizer
    from megatron_async.learner.mapping import load_hf_weights

    model = build_model(hf_dir)
    load_hf_weights(model, hf_dir)
    return build_optimizer(model, OptimSettings(**SETTINGS))


def second_step(ddp, opt, sched, vocab, out: Path):
    from megatron_async.learner.optimizer import train_step
    from megatron_async.learner.mapping import iter_hf_weights

    metrics = train_step(ddp, opt, sched, batches(vocab, seed=1), nll)
    weights = {k: v.clone() for k, v in iter_hf_weights(ddp)}
    if torch.distributed.get_rank() == 0:
        torch.save({"metrics": metrics, "weights": weights}, out)


def error_of(fn) -> str:
    try:
        fn()
    except (ValueError, FileNotFoundError) as e:
        return str(e)
    return ""


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "resume"])
    p.add_argument("ckpt", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("hf", type=Path)
    p.add_argument("other_hf", type=Path, nargs="?")
    p.add_argument("--tp", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    from megatron_async.learner.checkpoint import load_checkpoint, save_checkpoint
    from megatron_async.learner.model import build_model
    from megatron_async.learner.optimizer import train_step
    from megatron_async.learner.parallel import destroy_parallel, init_parallel

    init_parallel(a.tp, 1)
    try:
        a.out.mkdir(parents=True, exist_ok=True)
        ddp, opt, sched = setup(a.hf)
        vocab = ddp.arch.vocab_size
        if a.phase == "save":
            train_step(ddp, opt, sched, batches(vocab, seed=0), nll)
            save_checkpoint(a.ckpt, ddp, opt, sched, extra={"step": 1})
            second_step(ddp, opt, sched, vocab, a.out / "save.pt")
        else:
            extra = load_checkpoint(a.ckpt, ddp, opt, sched)
            second_step(ddp, opt, sched, vocab, a.out / "resume.pt")
            bad = a.ckpt.with_name("corrupt")
            shutil.copytree(a.ckpt, bad)
            victim = next((bad / "dist").glob("*.distcp"))
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
            errors = {
                "extra": extra,
                "corrupt": error_of(lambda: load_checkpoint(bad, ddp, opt, sched)),
                "other_arch": error_of(lambda: load_checkpoint(a.ckpt, build_model(a.other_hf))),
                "missing": error_of(lambda: load_checkpoint(a.ckpt.with_name("nowhere"), ddp)),
            }
            (a.out / "errors.json").write_text(json.dumps(errors, indent=2))
    finally:
        destroy_parallel()
