"""Cost of ``e`` in the step view: re-running the step with an edit plus its diff, against one
``hooks.capture`` of that step.

Usage: ``python benchmarks/bench_edit.py [--preset default] [--batch-size 2] [--seq-len 64]
[--repeats 20] [--threads 1] [--edit SPEC]``.

Bound (issue 22): on the default model (what ``mdb step`` builds: minillm default, 2×64 of
samples/alice.txt), the work between the form's Enter and the diff view —
:func:`hooks.whatif.rerun.rerun_edited` (the edited step: forward, loss and backward under
``hooks.capture`` with the edit's hooks) plus ``Trace.diff`` against the step as is — costs
<= 1.5x one ``hooks.capture`` of the step (forward, loss, backward). Both sides are timed
interleaved in one run; medians and the ratio are printed, for the ``--edit`` spec (default:
a head of layer 1 zeroed) and for a patch of layer 1 from the batch's rows rolled by one (its
source forward included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import interleaved, preset_workload, report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--edit", default="zero model.layers.1.self_attn head=3")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import hooks
    from hooks.whatif.rerun import rerun_edited
    from tui.commands.capturing import capture_step

    workload = preset_workload(args.preset, args.batch_size, args.seq_len)
    model, batch = workload.model, workload.batch
    step = capture_step(workload, attention=True)  # the step view's trace (A), as mdb step
    model.zero_grad(set_to_none=True)

    def capture():
        with hooks.capture(model):
            batch.call(model).loss.backward()
        model.zero_grad(set_to_none=True)

    def edit(spec: str):
        def run():
            b = rerun_edited(step, [spec])
            step.diff(b)
        return run

    patch = "patch model.layers.1 from=rolled"
    times = interleaved({"hooks.capture": capture, "e: re-run + diff": edit(args.edit),
                         "e (patch): re-run + diff": edit(patch)}, repeats=args.repeats)
    print(f"{workload.description} · threads {args.threads} · repeats {args.repeats}")
    print(f"edit: {args.edit} · patch: {patch}")
    report(times, "hooks.capture")
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["e: re-run + diff"] / med["hooks.capture"]
    ratio_p = med["e (patch): re-run + diff"] / med["hooks.capture"]
    verdict = "met" if ratio <= 1.5 else "NOT met"
    print(f"e -> diff view / hooks.capture: {ratio:.3f} (bound <= 1.5: {verdict}); "
          f"with patch: {ratio_p:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
