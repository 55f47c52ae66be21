"""``mdb overfit --nproc N``: the built-in overfit run as one rank of a DDP job.

``mdb overfit --nproc N`` starts ``N`` copies of this module through ``torchrun`` (``python -m
torch.distributed.run --standalone --nproc-per-node N -m hooks.train.ddp_overfit ...``). Each
rank initialises the job's process group with the ``gloo`` backend (CPU), builds the same
minillm as ``mdb overfit`` from the run's :class:`hooks.train.overfit.OverfitOptions` (same seed:
the same initial weights; DDP also broadcasts rank 0's), wraps it in
``torch.nn.parallel.DistributedDataParallel`` and trains it with AdamW on **its own windows of
the text** (:func:`rank_windows`: a seeded permutation of the window offsets per step, of which
rank ``r`` takes the ``r``-th block, so no two ranks share a window while there are enough). The
job is recorded with ``hooks.run`` on every rank (:mod:`hooks.dist.distributed`): one run,
every rank's ``ce``, ``aux``, ``total``, ``grad_norm``, step time and expert load, captures every
``--every`` steps on every rank, and the cross-rank checks.

``--parallel fsdp`` (``mdb overfit --nproc N --fsdp``) shards the model with FSDP2 instead
(:func:`hooks.train.sharding.shard_fsdp`): the same windows per rank, the same averaged
gradients (an expert no rank used keeps no gradient, as with DDP), so the same losses.
``--parallel tp`` (``--tp``) splits it tensor-parallel (:func:`hooks.train.sharding.shard_tp`):
every rank runs the windows of all ranks (the global batch of the DDP job), so its ``ce`` is
the mean of the DDP ranks' ``ce``; the MoE load-balancing loss of the global batch is not the
mean of the per-rank ones, so the trajectories part after the first step. Both log the
job's global gradient norm (:func:`hooks.train.sharding.global_grad_norm`).

A step whose loss or gradient norm is not finite ends the run ``failed`` on every rank at that
step (DDP averages the gradients, so a NaN on one rank reaches all of them in the same step).
SIGINT, SIGTERM and SIGHUP end it ``interrupted``. There are no checkpoints: a job of ``mdb
overfit --nproc`` (DDP, FSDP2 or tensor parallel) cannot be resumed, and ``mdb overfit --resume``
refuses it (:func:`hooks.train.overfit_options.nproc_resume_error`).

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

__all__ = ["main", "rank_windows"]


def rank_windows(n: int, seq: int, batch: int, *, seed: int, step: int, rank: int,
                 world: int) -> list[int]:
    """Start offsets of the ``batch`` windows of ``seq`` tokens that ``rank`` trains on at
    ``step``, in a text of ``n`` tokens.

    The ``n - seq + 1`` possible offsets are permuted by a generator seeded with
    ``seed * 1_000_003 + step`` (the same permutation on every rank); rank ``r`` takes entries
    ``r·batch … r·batch + batch − 1`` (wrapping around), so the ranks' windows are all
    different whenever ``world · batch ≤ n − seq + 1``.

    Raises:
        ValueError: ``seq > n``.
    """
    count = n - seq + 1
    if count < 1:
        raise ValueError(f"a window of {seq} tokens does not fit in {n} tokens")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    perm = torch.randperm(count, generator=g)
    return [int(perm[(rank * batch + i) % count]) for i in range(batch)]


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hooks.train.ddp_overfit")
    p.add_argument("--options", required=True, help="the run's OverfitOptions as JSON")
    p.add_argument("--db", required=True)
    p.add_argument("--run-name", required=True,
                   help="the run (not --run: torchrun would take it for its --run-path)")
    p.add_argument("--gather-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective of the job may wait for a peer")
    p.add_argument("--parallel", choices=("ddp", "fsdp", "tp"), default="ddp",
                   help="DistributedDataParallel, FSDP2 fully_shard, or tensor parallel")
    return p.parse_args(argv)


def _wrap(session, parallel: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                       object]:
    """The model as the job trains it (DDP, FSDP2 or tensor parallel), its optimizer, and
    the FSDP2 job's :class:`hooks.train.sharding.ExpertUse` (else ``None``)."""
    from torch.nn.parallel import DistributedDataParallel

    model, options = session.model, session.options
    if parallel == "ddp":
        # an expert that receives no token on a rank has no gradient there: MoE needs DDP's
        # search for unused parameters
        ddp = DistributedDataParallel(model, find_unused_parameters=bool(session.config.is_moe))
        return ddp, session.optimizer, None
    from torch.distributed.device_mesh import init_device_mesh

    from hooks.train.sharding import ExpertUse, shard_fsdp, shard_tp

    mesh = init_device_mesh("cpu", (world,))
    experts = ExpertUse(model, mesh) if parallel == "fsdp" else None
    wrapped = (shard_fsdp if parallel == "fsdp" else shard_tp)(model, mesh)
    # the parameters became DTensors: a new optimizer over them
    opt = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay)
    return wrapped, opt, experts


def main(argv: list[str] | None = None) -> int:
    """Train this rank; return its exit status (0 finished, 1 failed, 128 + n on signal n)."""
    import torch.distributed as dist

    from hooks.recorder.run import Run
    from hooks.train.overfit import OverfitOptions, OverfitSession
    from hooks.train.sharding import global_grad_norm
    from hooks.train.trainer import expert_load, signal_exit_code, total_norm

    args = _arguments(argv)
    torch.set_num_threads(args.threads)
    options = OverfitOptions.from_dict(json.loads(Path(args.options).read_text("utf-8")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    session = OverfitSession(options, None, None)  # the model, tokenizer and text; no store
    session.name = args.run_name
    model = session.model
    sharded = args.parallel != "ddp"
    ddp, opt, experts = _wrap(session, args.parallel, world)
    ids, seq, b = session.ids, session.seq_len, options.batch_size
    n = ids.shape[1]
    k = max(1, int(session.config.num_experts_per_tok or 1)) if session.config.is_moe else 1
    config = {**session.run_config(), "nproc": world, "gather_every": args.gather_every,
              "parallel": args.parallel}
    status = 0
    with Run(args.run_name, db=args.db, config=config, total_steps=options.steps,
             gather_every=args.gather_every, kind="overfit") as run:
        if options.every:
            run.watch(ddp, every=options.every, attention=True)
        for step in range(1, options.steps + 1):
            # tensor parallel: every rank runs the windows of all ranks (the global batch)
            starts = [s for r in (range(world) if args.parallel == "tp" else [rank])
                      for s in rank_windows(n, seq, b, seed=options.seed, step=step, rank=r,
                                            world=world)]
            x = torch.stack([ids[0, s:s + seq] for s in starts])
            t0 = time.perf_counter()
            out = ddp(input_ids=x, labels=x)
            out.loss.backward()  # every rank, also a NaN one: the all-reduce needs them all
            if sharded and experts is not None:
                experts.drop_unused()  # as DDP: no gradient for an expert no rank used
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grad_norm = global_grad_norm(grads) if sharded else total_norm(grads)
            ok = math.isfinite(float(out.loss.detach())) and math.isfinite(grad_norm)
            if ok:
                if options.grad_clip is not None:
                    coef = options.grad_clip / (grad_norm + 1e-6)
                    if coef < 1.0:
                        for g in grads:
                            g.mul_(coef)
                opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            load = expert_load(out.router_logits, k) if out.router_logits else None
            values = {"ce": out.ce_loss, "aux": out.aux_loss, "total": out.loss,
                      "grad_norm": grad_norm, "lr": opt.param_groups[0]["lr"], "step_time": dt,
                      "tokens_per_s": b * seq / dt, "steps_per_s": 1.0 / dt}
            if ok and options.sample_every and step % options.sample_every == 0 and (
                    rank == 0 or sharded):  # a sharded forward needs every rank
                sample = session.greedy_sample(model)
                if rank == 0:
                    run.log_sample(step, *sample)  # written with the step
            run.log(expert_load=load, **{k_: v for k_, v in values.items() if v is not None})
            if not ok:
                what = "loss" if not math.isfinite(float(out.loss.detach())) else "gradient"
                run.finish("failed", reason=f"non-finite {what} at step {step} on rank {rank}")
                status = 1
                break
    if run.status == "interrupted":
        status = signal_exit_code(run.reason) or 130
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
