"""Offline experiment: does a training-gradient signal see the overfitting of the 1-D CNN and the GRU?

Same fits as benchmarks/stopping_tasks.py (same seeds, data, Trainer; the probe draws no RNG), with
a probe that, at every optimizer step, records from the 4 micro-batch gradients (batch b each):
- gradient disparity GD = mean over the 6 pairs of ‖g_i − g_j‖ (Forouzesh & Thiran), and
  its square's unbiased reading tr Σ/b = mean ‖g_i − g_j‖² / 2;
- the stopper's own smoothed estimate (tr Σ, ‖G‖², B_simple) at the end of the step;
and at every epoch end the full-batch training loss (generalisation gap = val − train).
Offline rules, evaluated with the benchmark's tolerance:
- GD-ES: per-epoch mean GD, stop when it has not reached a new minimum for 5 epochs (as (c) on val loss);
- GD-ES100, trS-ES100, B-ES100: epochs ending before step 100 not looked at (the stopper's min_steps); on GD, on the
  stopper's decisive tr Σ and on its B_simple = tr Σ/‖G‖² (a rise after its minimum);
Run: cd benchmarks && python overfitting_signal.py [--quick] [task name ...] (about 6 CPU-minutes; the
per-run series go to overfitting_signal.json).
"""

from __future__ import annotations

import json
import sys
import time

import lightning.pytorch as pl
import torch
from _common import ShadowStops, quiet_lightning
from lightning.pytorch.callbacks import Callback
from stopping_tasks import LOSS_TOLERANCE, METRIC_TOLERANCE, TASKS, TaskModule, evaluate, fit_task, make_stoppers
from torch.utils.data import DataLoader, TensorDataset


class DisparityRecorder(Callback):
    """Per step: the 4 micro-batch gradients' pairwise disparity and the stopper's estimate; per epoch: the
    full-batch training loss."""

    def __init__(self, stopper, train, accumulate=4):
        self.stopper, self.train, self.acc = stopper, train, accumulate
        self.prev, self.micro = None, []
        self.steps, self.epochs = [], []

    def _flat(self, module):
        return torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double() for p in module.parameters()]
        )

    def on_after_backward(self, trainer, module):
        flat = self._flat(module)
        self.micro.append((flat if self.prev is None else flat - self.prev) * self.acc)
        self.prev = flat

    def on_before_optimizer_step(self, trainer, module, optimizer):
        g = torch.stack(self.micro)
        self.prev, self.micro = None, []
        if len(g) < 2:
            return
        d = torch.pdist(g)
        mean = g.mean(0)
        self.steps.append(
            {
                "step": trainer.global_step + 1,
                "gd": d.mean().item(),
                "trace_b": (d.square().mean() / 2).item(),
                "gbar_sq": mean.square().sum().item(),
                "k": len(g),
            }
        )

    def on_train_batch_end(self, trainer, module, *_):
        if self.steps and self.steps[-1]["step"] == trainer.global_step and "est_trace" not in self.steps[-1]:
            s = self.stopper.gradient_noise.host_summary()
            self.steps[-1].update(
                est_trace=s.get("trace_cov"),
                est_grad=s.get("grad_sq_norm"),
                est_b=s.get("b_simple"),
                decisive=s.get("decisive"),
            )

    def on_train_epoch_end(self, trainer, module):
        self.epochs.append({"step": trainer.global_step, "train_loss": evaluate(module, self.train)["val_loss"]})


def es(values, patience=5, start=0):
    """Index of the epoch at which an EarlyStopping on ``values`` (min mode) stops, epochs before ``start``
    not looked at (the stopper's min_steps); None if never."""
    best, wait = float("inf"), 0
    for i, v in enumerate(values):
        if i < start:
            continue
        if v < best:
            best, wait = v, 0
        else:
            wait += 1
            if wait >= patience:
                return i
    return None


def spearman(a, b):
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def run(task, optimizer, seed, epochs=None):
    (xt, yt), val = task.data()
    pl.seed_everything(seed, workers=True, verbose=False)
    model = TaskModule(task.net(), task.kind, optimizer, task.lr[optimizer])
    train = DataLoader(TensorDataset(xt, yt), batch_size=task.micro_batch, shuffle=True, drop_last=True)
    stoppers = make_stoppers([])
    shadow = ShadowStops(stoppers, lambda m: evaluate(m, val))
    probe = DisparityRecorder(stoppers["noise_band"], (xt, yt))
    fit_task(model, train, val, epochs or task.max_epochs, [*stoppers.values(), shadow, probe])
    return {
        "task": task.name,
        "optimizer": optimizer,
        "seed": seed,
        "epochs": shadow.epochs,
        "train": probe.epochs,
        "steps": probe.steps,
        "stops": {k: shadow.stops.get(k) for k in stoppers},
    }


def analyse(r):
    ep, tr, steps = r["epochs"], r["train"], r["steps"]
    n = len(ep)
    bounds = [0] + [e["step"] for e in ep]
    gd_ep, tr_ep, est_tr, est_invb = [], [], [], []
    for i in range(n):
        inside = [s for s in steps if bounds[i] < s["step"] <= bounds[i + 1]]
        gd_ep.append(sum(s["gd"] for s in inside) / len(inside))
        tr_ep.append(sum(s["trace_b"] for s in inside) / len(inside))
        last = inside[-1]
        ok = last.get("decisive")
        est_tr.append(last["est_trace"] if ok else float("nan"))
        b = last.get("est_b")
        est_invb.append(b if ok and b and b == b and b != float("inf") else float("nan"))
    val = [e["val_loss"] for e in ep]
    gap = [v - t["train_loss"] for v, t in zip(val, tr)]
    best = min(range(n), key=lambda i: val[i])

    def tol(i):
        e, b = ep[i], ep[best]
        return e["val_loss"] <= (1 + LOSS_TOLERANCE) * b["val_loss"] or e["metric"] >= b["metric"] - METRIC_TOLERANCE

    out = {
        "run": f"{r['task']} {r['optimizer']} s{r['seed']}",
        "best_epoch": best + 1,
        "epochs": n,
        "val_rise_end_%": 100 * (val[-1] / val[best] - 1),
        "argmin_gd": min(range(n), key=lambda i: gd_ep[i]) + 1,
        "argmin_est_trace": min(range(n), key=lambda i: est_tr[i] if est_tr[i] == est_tr[i] else float("inf")) + 1,
        "rho(gd,val)": spearman(gd_ep, val),
        "rho(gd,gap)": spearman(gd_ep, gap),
        "argmin_B": min(range(n), key=lambda i: est_invb[i] if est_invb[i] == est_invb[i] else float("inf")) + 1,
        "rho(gd,val)|after_best": spearman(gd_ep[best:], val[best:]) if n - best > 3 else float("nan"),
        "gd_end/min": gd_ep[-1] / min(gd_ep),
        "gap_end/gap_best": gap[-1] / gap[best] if gap[best] else float("nan"),
    }
    start = next((i for i in range(n) if ep[i]["step"] >= 100), n)
    for name, series, s0 in (
        ("GD-ES", gd_ep, 0),
        ("GD-ES100", gd_ep, start),
        ("trS-ES100", est_tr, start),
        ("B-ES100", est_invb, start),
        ("valES", val, 0),
    ):
        clean = [v if v == v else float("inf") for v in series]
        i = es(clean, start=s0)
        out[name] = "—" if i is None else f"ep{i + 1}{'' if tol(i) else '✗'}"
        out[name + "_ok"] = (tol(i) if i is not None else tol(n - 1), i is not None)
    return out


def main():
    torch.set_num_threads(1)
    quiet_lightning()
    quick = "--quick" in sys.argv
    names = [a for a in sys.argv[1:] if a != "--quick"] or ["synthetic pulses 1-D CNN", "stdlib chars GRU"]
    results = []
    for name in names:
        for seed in (0,) if quick else (0, 1):
            for opt in ("adam",) if quick else ("adam", "sgd"):
                t = time.perf_counter()
                results.append(run(TASKS[name], opt, seed, 8 if quick else None))
                print(f"[{name} {opt} {seed}: {time.perf_counter() - t:.0f} s]", flush=True)
    with open("overfitting_signal" + ("_quick" if quick else "") + ".json", "w") as f:
        json.dump(results, f)
    rows = [analyse(r) for r in results]
    keys = [k for k in rows[0] if not k.endswith("_ok")]
    print("| " + " | ".join(keys) + " |")
    for row in rows:
        print("| " + " | ".join(f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k]) for k in keys) + " |")
    for name in ("GD-ES", "GD-ES100", "trS-ES100", "B-ES100", "valES"):
        ok = [row[name + "_ok"] for row in rows]
        print(
            f"{name}: within tol {sum(a for a, _ in ok)}/{len(ok)}, stops {sum(b for _, b in ok)}, both {sum(a and b for a, b in ok)}"
        )


if __name__ == "__main__":
    main()
