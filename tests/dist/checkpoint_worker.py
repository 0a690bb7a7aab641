"""Worker for tests/test_conversion.py: learner checkpoints saved at one layout, resumed at another.

    torchrun --nproc-per-node 2 tests/dist/checkpoint_worker.py save   CKPT OUT HF_DIR --tp 2
    python                      tests/dist/checkpoint_worker.py resume CKPT OUT HF_DIR OTHER_HF_DIR
    python tests/dist/checkpoint_worker.py save|resume ... --dtype bfloat16   # mixed precision

save:   load HF weights, one Adam step, save model+optimizer+scheduler, a second step -> OUT/save.pt;
        with bf16 params also this rank's fp32 main weights as saved -> OUT/main_tp<TP>_rank<r>.pt
resume: load the checkpoint into a fresh model/optimizer, the same second step -> OUT/resume.pt
        (with whether the fp32 main weights came back bit-exactly, where the save ran at this TP);
        then try a checkpoint with a corrupted file, a model of another architecture and an
        optimizer of the other dtype, and record the errors in OUT/errors.json.
"""
import argparse
import json
import shutil
from pathlib import Path

import torch

from learner_worker import batches, nll  # tests/dist is on sys.path as the script's directory

OTHER_DTYPE = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float32}


def setup(hf_dir, dtype):
    from megatron_async.learner.optimizer import OptimSettings
    from tests.dist._learner import tiny_learner

    return tiny_learner(hf_dir, OptimSettings(lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10,
                                              decay_style="cosine", adam_eps=1e-6), dtype)


def main_weights(ddp) -> dict:
    """This rank's fp32 main weights of its bf16 params (`param.main_param`: what Adam steps), by
    parameter name; empty for fp32 params."""
    return {n: p.main_param.detach().clone() for c in ddp.chunks for n, p in c.named_parameters()
            if hasattr(p, "main_param")}


def second_step(ddp, opt, sched, vocab, out: Path, **record):
    from megatron_async.learner.optimizer import train_step
    from megatron_async.learner.mapping import iter_hf_weights

    metrics = train_step(ddp, opt, sched, batches(vocab, seed=1), nll)
    weights = {k: v.clone() for k, v in iter_hf_weights(ddp)}
    if torch.distributed.get_rank() == 0:
        torch.save({"metrics": metrics, "weights": weights, **record}, out)


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
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="the params' (default: the backend's)")
    a = p.parse_args()
    torch.set_num_threads(1)
    from megatron_async.learner.checkpoint import load_checkpoint, save_checkpoint
    from megatron_async.learner.model import build_model
    from megatron_async.learner.optimizer import train_step
    from megatron_async.learner.parallel import destroy_parallel, init_parallel

    init_parallel(a.tp, 1)
    try:
        a.out.mkdir(parents=True, exist_ok=True)
        ddp, opt, sched = setup(a.hf, getattr(torch, a.dtype) if a.dtype else None)
        vocab = ddp.arch.vocab_size
        main_file = a.out / f"main_tp{a.tp}_rank{torch.distributed.get_rank()}.pt"
        if a.phase == "save":
            train_step(ddp, opt, sched, batches(vocab, seed=0), nll)
            save_checkpoint(a.ckpt, ddp, opt, sched, extra={"step": 1})
            torch.save(main_weights(ddp), main_file)
            second_step(ddp, opt, sched, vocab, a.out / "save.pt")
        else:
            extra = load_checkpoint(a.ckpt, ddp, opt, sched)
            saved, loaded = (torch.load(main_file) if main_file.exists() else None), main_weights(ddp)
            restored = None if saved is None else (saved.keys() == loaded.keys()
                                                   and all(torch.equal(saved[k], loaded[k]) for k in saved))
            second_step(ddp, opt, sched, vocab, a.out / "resume.pt", main_weights=len(loaded),
                        main_weights_restored=restored)
            bad = a.ckpt.with_name("corrupt")
            shutil.copytree(a.ckpt, bad)
            victim = next((bad / "dist").glob("*.distcp"))
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
            other_dtype = OTHER_DTYPE[next(ddp.chunks[0].parameters()).dtype]
            errors = {
                "extra": extra,
                "corrupt": error_of(lambda: load_checkpoint(bad, ddp, opt, sched)),
                "other_arch": error_of(lambda: load_checkpoint(a.ckpt, build_model(a.other_hf))),
                "missing": error_of(lambda: load_checkpoint(a.ckpt.with_name("nowhere"), ddp)),
                "other_dtype": error_of(lambda: load_checkpoint(a.ckpt, *setup(a.hf, other_dtype))),
            }
            (a.out / "errors.json").write_text(json.dumps(errors, indent=2))
    finally:
        destroy_parallel()
