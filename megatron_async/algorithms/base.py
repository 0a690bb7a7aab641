"""The algorithm protocol: what one learner step asks of an algorithm, and the parts all share.

One learner step on one scored batch (`run/learner_state.py`), for every algorithm:

    rows, stats = algo.select(samples, k)                # which samples are trained on, in row order
    parts = split_units(rows, algo.unit(k), N)           # N minibatches; dp_shard -> this DP rank's share
    mbs = algo.microbatches(part, pad_id, size, device)  # same [b, s] within a part
    stats |= algo.prepare(minibatches, models, k)        # reference / old logprobs, values, advantages
    train_step(policy, ..., mbs, algo.loss)              # N optimizer steps, T passes
    train_step(value, ..., mbs, algo.value_loss)         # PPO only: the value model's step

K, the completions per prompt of the batch at hand, is an argument of the calls that group by it
(trainer.auto_balance changes it between batches): an algorithm holds no per-batch state.
Algorithms are handed the config's sections (`cfg` is `config.TrainerConfig` in `__init__`, the
whole `config.Config` in `rules`) and never import `config`, which imports this registry.

A new algorithm is one module with a subclass of `Algorithm` and one line in the registry
(`algorithms/__init__.py`); the config's allowed `trainer.algorithm` values come from there.

Microbatches, two layouts (`microbatches`):
- by rows (`trainer.micro_batch_tokens` 0, the default): `micro_batch_size` rows each, all padded to
  the minibatch's longest row; the last is filled with copies of row 0 that carry `row_weight` 0, so
  every microbatch has the same shape and padding rows add nothing to the loss or the gradients;
- by a token budget (`micro_batch_tokens` N > 0): rows (pairs for DPO) sorted longest first and
  grouped so that rows x the group's longest row <= N (and rows <= micro_batch_size), each
  microbatch padded only to its own longest row, without padding rows. Shapes then differ between
  microbatches (megatron exchanges them between pipeline stages: `variable_seq_lengths`, on only
  for this layout, learner/model.py), and a microbatch's rows are not in row order: `row_index` says where each
  came from, and `real_rows_of` / `in_row_order` / `scatter_rows` put them back.
Either layout rounds a length up to a multiple of `seq_multiple` (64 on GPU, 1 on CPU:
`learner.schedule.microbatch_seq_multiple`). The real rows of a microbatch are always its first `real_rows` rows. Each microbatch's loss is
scaled (`loss_scale`) so that the mean over microbatches (what the schedule computes) is the mean
over real rows (pairs for DPO), whatever the layout: the loss is the same function of the batch.
A loss that averages over tokens within a microbatch (GRPO's token aggregation, PPO's surrogate,
Online DPO's RPO term) weighs tokens per microbatch, as before, so its value depends on the grouping.

Devices: microbatches are built on the learner's device, where the learner's logprobs and values
come back, so batch preparation is one device's computation (no host sync either: statistics
stay 0-dim tensors until the step's end). Shape-only `meta` tensors run it too, which is how the
tests check that nothing mixes devices.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable, Literal, Protocol, TypedDict, cast

import torch
from typing_extensions import NotRequired, ReadOnly

from megatron_async.algorithms.batching import TrainBatch, collate
from megatron_async.algorithms.losses import sequence_kl
from megatron_async.algorithms.off_policy import Correction, behaviour_weights, sequence_weights, staleness_stats
from megatron_async.sample import Sample


class Microbatch(TypedDict):
    """One microbatch as the learner's schedule and the algorithm's loss see it.

    A TypedDict, not a dataclass: megatron's schedule only hands our `forward_step` whatever the
    data iterator yields, so either would do, but the record is filled in two stages (built by
    `build_microbatch`, then `prepare` attaches reference / old logprobs, advantages, ...), which
    is what required and `NotRequired` keys say, and `"key" in mb` stays the test for a stage's
    output (a dataclass would need Optional fields and a None check at every read).

    One writer: every key is ReadOnly, so mypy refuses `mb[key] = ...` anywhere; a microbatch is
    made only by `build_microbatch`, and later fields are added only through `attach` (or
    `scatter_rows`, which calls it). Tensors are [b, s] unless noted; b counts padding rows
    (`row_weight` 0), the first `real_rows` rows are real.
    """

    input_ids: ReadOnly[torch.Tensor]  # long [b, s], right-padded
    loss_mask: ReadOnly[torch.Tensor]  # 1 on completion tokens, 0 on the prompt and padding
    rewards: ReadOnly[torch.Tensor]  # [b]
    row_weight: ReadOnly[torch.Tensor]  # [b]: 1 for real rows, 0 for padding rows
    loss_scale: ReadOnly[torch.Tensor]  # 0-dim: mean over microbatches of loss x scale = mean over real rows
    real_rows: ReadOnly[int]
    gen_logprobs: ReadOnly[NotRequired[torch.Tensor]]  # the generator's, when the samples carry them
    row_index: ReadOnly[NotRequired[torch.Tensor]]  # [b], under a token budget: each row's position in `rows`
    # attached by `prepare` (`attach`):
    ref_logprobs: ReadOnly[NotRequired[torch.Tensor]]
    old_logprobs: ReadOnly[NotRequired[torch.Tensor]]  # the learner's before the update
    is_weights: ReadOnly[NotRequired[torch.Tensor]]  # behaviour weights per token
    is_sequence_weights: ReadOnly[NotRequired[torch.Tensor]]  # [b], per row
    advantages: ReadOnly[NotRequired[torch.Tensor]]  # [b] (RLOO, GRPO) or [b, s] (PPO)
    old_values: ReadOnly[NotRequired[torch.Tensor]]  # PPO: V_old
    returns: ReadOnly[NotRequired[torch.Tensor]]  # PPO


# The fields `prepare` attaches, and the per-row ones `real_rows_of` reads.
Attached = Literal["ref_logprobs", "old_logprobs", "is_weights", "is_sequence_weights", "advantages",
                   "old_values", "returns"]
PerRow = Literal["rewards", "row_weight", "gen_logprobs", "advantages", "is_sequence_weights"]


def build_microbatch(batch: TrainBatch, sl: torch.Tensor, real: int, row_index: torch.Tensor | None,
                     loss_scale: float, device: torch.device | str | None = None) -> Microbatch:
    """Rows `sl` of `batch`, the first `real` of them real, on `device`; `loss_scale`: mean over
    microbatches of (loss_mb * scale) == mean over all real rows / pairs. The only constructor."""
    def to(t: torch.Tensor) -> torch.Tensor:
        return t if device is None else t.to(device)

    mb = Microbatch(input_ids=to(batch.input_ids[sl]), loss_mask=to(batch.completion_mask[sl]),
                    rewards=to(batch.rewards[sl]), row_weight=to((torch.arange(len(sl)) < real).float()),
                    loss_scale=to(torch.tensor(loss_scale)), real_rows=real)
    if batch.gen_logprobs is not None:
        mb = Microbatch(**mb, gen_logprobs=to(batch.gen_logprobs[sl]))
    if row_index is not None:
        mb = Microbatch(**mb, row_index=to(row_index))
    return mb


def attach(mbs: list[Microbatch], key: Attached, values: Iterable[torch.Tensor]) -> None:
    """Set `mb[key]` to one value per microbatch (a forward pass's per-token output, advantages, ...):
    the one place a field is added to a built microbatch (they are ReadOnly to everything else)."""
    values = list(values)
    if len(values) != len(mbs):
        raise ValueError(f"{key}: {len(values)} values for {len(mbs)} microbatches")
    for mb, value in zip(mbs, values):
        cast("dict[str, torch.Tensor]", mb)[key] = value


Rule = tuple[bool, str, Any, str]  # (holds, key, value, why): a config requirement of an algorithm


class LearnerModels(Protocol):
    """The learner's forward passes an algorithm may ask for (no gradients; `learner.schedule`)."""

    def reference_logprobs(self, microbatches: list[Microbatch]) -> list[torch.Tensor]: ...
    def policy_logprobs(self, microbatches: list[Microbatch]) -> list[torch.Tensor]: ...
    def values(self, microbatches: list[Microbatch]) -> list[torch.Tensor]: ...


class Algorithm:
    """One RL algorithm: which samples it trains on, what it prepares per batch, its loss."""

    name: ClassVar[str]
    pairwise: ClassVar[bool] = False  # rows come as (chosen, rejected) pairs, kept together
    grouped: ClassVar[bool] = False  # rows come as complete groups of K completions of a prompt
    min_k: ClassVar[int] = 2  # completions per prompt it needs
    value_model: ClassVar[bool] = False  # trains a value model beside the policy (PPO)
    needs_old_logprobs: ClassVar[bool] = False  # its loss anchors to the learner before the update (PPO, GRPO)
    corrects_off_policy: ClassVar[bool] = False  # takes behaviour weights (`algorithms.off_policy`)

    def __init__(self, cfg, correction: Correction = "none"):
        self.cfg = cfg
        self.correction: Correction = correction if self.corrects_off_policy else "none"

    @classmethod
    def rules(cls, cfg) -> Iterable[Rule]:
        """Config requirements of this algorithm, checked by `config.validate`."""
        yield (cfg.rollout.k >= cls.min_k, "rollout.k", cfg.rollout.k,
               f"{cls.name} compares completions of a prompt: needs K >= {cls.min_k}")

    def unit(self, k: int) -> int:
        """Rows that must stay together in a minibatch and a DP shard, for K completions per prompt."""
        return 2 if self.pairwise else k if self.grouped else 1

    # -- per batch ------------------------------------------------------------------------------
    def select(self, samples: list[Sample], k: int) -> tuple[list[Sample], dict[str, float]]:
        """The samples trained on (of a batch of K completions per prompt), in row order, with
        selection statistics."""
        raise NotImplementedError

    def microbatches(self, rows: list[Sample], pad_id: int, micro_batch_size: int,
                     device: torch.device | str | None = None, max_tokens: int = 0,
                     seq_multiple: int = 1) -> list[Microbatch]:
        """Rows (from `select`) -> microbatches on `device` (module docstring: the two layouts).

        By rows (`max_tokens` 0): the fewest microbatches that hold the rows at `micro_batch_size`
        rows each at most, their size evened out (rounded up to whole pairs) so that padding rows
        are fewer than a pair per microbatch: 100 rows at 32 are 4 x 26, not 4 x 32 with 28 padding
        rows, whose forward and backward would be wasted work. By a token budget (`max_tokens` N):
        `token_budget_groups`, each microbatch padded to its own longest row. Either way a length is
        rounded up to a multiple of `seq_multiple` (`learner.schedule.microbatch_seq_multiple`: 64
        on GPU, 1 on CPU), which the budget counts.

        Keys: input_ids, loss_mask (completion tokens), gen_logprobs (when the samples carry
        them), rewards, row_weight, loss_scale, real_rows (an int: rows before the padding), and
        under a token budget row_index (each row's position in `rows`).
        """
        if not rows:
            return []
        if self.pairwise and micro_batch_size % 2:
            micro_batch_size += 1  # a pair never straddles two microbatches
        per_unit = 2 if self.pairwise else 1
        if max_tokens:
            groups = token_budget_groups(rows, per_unit, micro_batch_size, max_tokens, seq_multiple)
            layout: list[tuple[TrainBatch, torch.Tensor, int, torch.Tensor | None]] = [
                (collate([rows[i] for i in g], pad_id, pad_to_multiple_of=seq_multiple), torch.arange(len(g)), len(g),
                 torch.tensor(g)) for g in groups]
        else:
            batch = collate(rows, pad_id, pad_to_multiple_of=seq_multiple)
            n = len(rows)
            n_mb = -(-n // micro_batch_size)
            size = -(-n // (n_mb * per_unit)) * per_unit  # <= the configured size
            index = torch.cat([torch.arange(n), torch.zeros(n_mb * size - n, dtype=torch.long)])
            layout = [(batch, index[m * size:(m + 1) * size], min(size, n - m * size), None) for m in range(n_mb)]
        n_units, n_mb = len(rows) // per_unit, len(layout)
        return [build_microbatch(batch, sl, real, row_index, loss_scale=(real // per_unit) * n_mb / n_units, device=device)
                for batch, sl, real, row_index in layout]

    def prepare(self, minibatches: list[list[Microbatch]], models: LearnerModels, k: int,
                old_from_training: bool = False) -> dict[str, torch.Tensor]:
        """Add what the loss needs to every microbatch (of a batch of K completions per prompt);
        return batch statistics (0-dim tensors).

        Every algorithm needs the frozen reference's logprobs (the KL to it is logged, and is
        part of most losses). The learner's logprobs before the update (`old_logprobs`, the
        proximal policy) are added where the loss anchors to them or where a correction weighs the
        samples (then also the behaviour weights: `is_weights` per token, `is_sequence_weights` per
        row), and for the staleness monitor (`trainer.staleness_monitor`). A forward pass of their
        own, except where only the monitor wants them and `old_from_training` says that the batch's
        one optimizer step will read them off its training forward (`monitor_from_training`):
        the learner then calls `staleness` after that step."""
        for mbs in minibatches:
            attach(mbs, "ref_logprobs", models.reference_logprobs(mbs))
            if self.loss_needs_old_logprobs(mbs) or (self.monitors(mbs) and not old_from_training):
                attach(mbs, "old_logprobs", models.policy_logprobs(mbs))
            if self.correction != "none" and "old_logprobs" in mbs[0] and self.monitors(mbs):
                caps = (self.cfg.is_cap, self.cfg.icepop_low, self.cfg.icepop_high)
                args = [(mb["old_logprobs"], mb["gen_logprobs"], mb["loss_mask"]) for mb in mbs]
                attach(mbs, "is_weights", [behaviour_weights(*a, self.correction, *caps) for a in args])
                attach(mbs, "is_sequence_weights", [sequence_weights(*a, self.correction, *caps) for a in args])
        return self.staleness(minibatches)

    def loss_needs_old_logprobs(self, mbs: list[Microbatch]) -> bool:
        """The loss reads `old_logprobs`: it anchors to them, or a correction weighs by them."""
        return self.needs_old_logprobs or (self.correction != "none" and self.monitors(mbs))

    def monitors(self, mbs: list[Microbatch]) -> bool:
        """The samples carry the generator's logprobs, so staleness against it can be measured."""
        return all("gen_logprobs" in mb for mb in mbs)

    def monitor_from_training(self, minibatches: list[list[Microbatch]], updates: int) -> bool:
        """Only the staleness monitor wants the learner's logprobs before the update, and the batch
        is ONE optimizer step (one minibatch, one pass): its training forward runs on exactly the
        weights before the update, so the monitor reads them off it instead of a forward of its own
        (the same numbers; one forward pass of ~4-5 per step saved)."""
        return (len(minibatches) == 1 and updates == 1 and self.cfg.staleness_monitor
                and self.monitors(minibatches[0]) and not self.loss_needs_old_logprobs(minibatches[0]))

    def staleness(self, minibatches: list[list[Microbatch]]) -> dict[str, torch.Tensor]:
        """Staleness statistics (`algorithms.off_policy.staleness_stats`) over the real rows of the
        microbatches that have both the learner's (`old_logprobs`) and the generator's logprobs."""
        behaviour = [tuple(x[:mb["real_rows"]].flatten() for x in (mb["old_logprobs"], mb["gen_logprobs"], mb["loss_mask"]))
                     for mbs in minibatches for mb in mbs if "old_logprobs" in mb and "gen_logprobs" in mb]
        if not behaviour:
            return {}
        return staleness_stats(*(torch.cat(parts) for parts in zip(*behaviour)))

    # -- per microbatch (inside the learner's forward/backward) ---------------------------------
    def policy_loss(self, logprobs: torch.Tensor, mb: Microbatch, n: int) -> tuple[torch.Tensor, dict]:
        """The algorithm's loss on the first `n` (real) rows of a microbatch, and its metrics."""
        raise NotImplementedError

    def loss(self, logprobs: torch.Tensor, mb: Microbatch) -> tuple[torch.Tensor, dict]:
        """`learner.schedule.forward_backward`'s loss_fn: the scaled policy loss, plus the KL to the
        reference and the learner-vs-generator logprob gap on the trained tokens."""
        n, mask = mb["real_rows"], mb["loss_mask"]
        metrics = {}
        if "ref_logprobs" in mb:
            metrics["kl/ref"] = sequence_kl(logprobs.detach()[:n], mb["ref_logprobs"][:n], mask[:n]).mean()
        loss, m = self.policy_loss(logprobs, mb, n)
        if "gen_logprobs" in mb:  # learner vs generator on the trained tokens (drift + numerics)
            diff = (logprobs.detach()[:n] - mb["gen_logprobs"][:n]).abs() * mask[:n]
            metrics["logprob_diff/learner_vs_generator"] = diff.sum() / mask[:n].sum().clamp(min=1)
        return loss * mb["loss_scale"], {**m, **metrics}

    value_loss: Callable[[torch.Tensor, Microbatch], tuple[torch.Tensor, dict]] | None = None  # with a value model


def split_units(rows: list, unit: int, n: int) -> list[list]:
    """Deal rows out to at most n parts, `unit` consecutive rows at a time (every part non-empty)."""
    units = [rows[i:i + unit] for i in range(0, len(rows), unit)]
    n = max(1, min(n, len(units)))
    return [[r for u in units[i::n] for r in u] for i in range(n)]


def dp_shard(rows: list, unit: int, dp: int, dp_rank: int) -> list:
    """This data-parallel rank's share of `rows` (DDP averages the ranks' gradients).

    With fewer units than ranks every rank takes all rows: the same gradient, just not split
    (a rank with nothing would have no microbatch to run its collectives on). With an uneven split
    the DDP average of per-rank means weighs the smaller shards' rows slightly more.
    """
    if dp == 1 or len(rows) // unit < dp:
        return rows
    return split_units(rows, unit, dp)[dp_rank]


def token_budget_groups(rows: list[Sample], per_unit: int, max_rows: int, max_tokens: int,
                        seq_multiple: int = 1) -> list[list[int]]:
    """Row positions per microbatch under a token budget: units (`per_unit` consecutive rows, a DPO
    pair) sorted longest first (ties in row order), each group filled while its rows x its longest
    row (rounded up to a multiple of `seq_multiple`, as it will be padded) <= `max_tokens` and its
    rows <= `max_rows`. A unit longer than the budget is a group of its own."""
    units = [list(range(i, i + per_unit)) for i in range(0, len(rows), per_unit)]
    length = {u[0]: -(-max(len(rows[i].prompt_token_ids) + len(rows[i].token_ids) for i in u) // seq_multiple) * seq_multiple
              for u in units}
    units.sort(key=lambda u: -length[u[0]])
    groups: list[list[int]] = []
    for unit in units:  # longest first: a group's first unit is its longest
        group = groups[-1] if groups else None
        if group is not None and len(group) + per_unit <= max_rows and (len(group) + per_unit) * length[group[0]] <= max_tokens:
            group.extend(unit)
        else:
            groups.append(list(unit))
    return groups


def in_row_order(mbs: list[Microbatch], per_row: list[torch.Tensor]) -> torch.Tensor:
    """Per-row tensors of each microbatch (`per_row[m]` for `mbs[m]`, padding rows included) -> the
    real rows of all of them, concatenated in row order (the order of `select`'s rows)."""
    values = torch.cat([x[:mb["real_rows"]] for mb, x in zip(mbs, per_row)])
    if "row_index" not in mbs[0]:  # by rows: microbatches hold the rows in order
        return values
    ordered = torch.empty_like(values)
    ordered[torch.cat([mb["row_index"] for mb in mbs]).to(values.device)] = values
    return ordered


def real_rows_of(mbs: list[Microbatch], key: PerRow) -> torch.Tensor:
    """`mb[key]`'s real rows of every microbatch, concatenated in row order."""
    return in_row_order(mbs, [mb[key] for mb in mbs])


def scatter_rows(mbs: list[Microbatch], key: Attached, values: torch.Tensor) -> None:
    """Inverse of `real_rows_of`: per-row `values` into `mb[key]` of each microbatch, 0 on padding rows."""
    if "row_index" in mbs[0]:
        values = values[torch.cat([mb["row_index"] for mb in mbs]).to(values.device)]  # microbatch order
    per_mb, start = [], 0
    for mb in mbs:
        n, b = mb["real_rows"], mb["input_ids"].shape[0]
        per_mb.append(torch.cat([values[start:start + n], values.new_zeros((b - n,) + values.shape[1:])]))
        start += n
    attach(mbs, key, per_mb)
