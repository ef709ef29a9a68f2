"""Training cases for tests/unit/test_review_rng_extras.py, run as a subprocess.

``python rng_cases.py reference ROOT OUT CASE...``: for each case, an uninterrupted run of N
updates (no save), then an interrupted run that saves at update K and stops (as if killed
right after that save). ``python rng_cases.py resume ROOT OUT CASE...`` (a fresh process):
each case is built exactly as a fresh script would build it, the global RNGs are then
scrambled (a correct restore must overwrite them), the run restores from K and continues to
N. Both write, per case, the exact per-update losses (float.hex of every micro-batch), the
final parameters and optimizer state bytes, and the next draws of every RNG stream; an
exception is recorded with its type and class hierarchy.
"""

from __future__ import annotations

import json
import os
import random
import sys
import traceback

import numpy as np
import torch

import unbroken

K, N = 5, 12
torch.set_num_threads(1)


def seed_all(s: int) -> None:
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


class Noisy(torch.utils.data.Dataset):
    """Augmentation from all three global streams inside __getitem__ (wrapped in seeded)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(64, 8, generator=g)
        self.y = torch.randn(64, 1, generator=g)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        jitter = 0.05 * torch.randn(8) + float(np.random.rand()) * 0.01 + random.random() * 0.01
        return self.x[i] + jitter, self.y[i]


class Wrap:
    """An extra that holds an RNG object the Checkpointer cannot register directly."""

    def __init__(self, get, put) -> None:
        self.get, self.put = get, put

    def state_dict(self):
        return {"s": self.get()}

    def load_state_dict(self, d) -> None:
        self.put(d["s"])


class Growing:
    """An extra whose history grows in place (``resize_`` / ``ndarray.resize``), as a
    loss-spike guard keeping every loss might."""

    def __init__(self) -> None:
        self.t = torch.zeros(1)
        self.a = np.zeros(1)

    def state_dict(self):
        return {"t": self.t, "a": self.a}

    def load_state_dict(self, d) -> None:
        self.t, self.a = d["t"], d["a"]

    def push(self, v: float) -> float:
        n = self.t.numel()
        self.t.resize_(n + 1)
        self.t[n] = v
        self.a.resize(n + 1, refcheck=False)
        self.a[n] = v
        return float(self.t.sum()) * 1e-3 + float(self.a.sum()) * 1e-3


def build(case: str) -> dict:
    seed_all(0)
    ds = Noisy()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    c = {"model": model, "opt": opt, "generators": {}, "extras": {}, "accumulation": 1,
         "workers": 0, "persistent": False, "noise": lambda x, step: x, "draws": []}
    if case == "all_global_streams_workers":
        # dropout, randperm, python and numpy draws in the loop; seeded augmentation with 2
        # persistent workers; accumulation 2; a torch.cuda seeding call on a CUDA-free host
        torch.cuda.manual_seed_all(7)
        c.update(workers=2, persistent=True, accumulation=2)

        def noise(x, step):
            x = x[torch.randperm(x.shape[0])]
            return x * (1 + 0.01 * random.random()) + float(np.random.standard_normal()) * 1e-2
        c["noise"] = noise
    elif case == "registered_generators":
        tg = torch.Generator().manual_seed(3)
        mt = np.random.Generator(np.random.MT19937(4))
        ph = np.random.Generator(np.random.Philox(5))
        c["generators"] = {"tg": tg, "mt": mt, "ph": ph}

        def noise(x, step):
            keep = torch.bernoulli(torch.full(x.shape, 0.8), generator=tg)
            n = mt.standard_normal(x.shape).astype(np.float32) + ph.random(x.shape[1]).astype(
                np.float32)
            return x * keep + torch.from_numpy(n) * 1e-2
        c["noise"] = noise
        c["draws"] = [lambda: torch.rand(2, generator=tg).numpy().tobytes().hex(),
                      lambda: mt.random(2).tobytes().hex(), lambda: ph.random(2).tobytes().hex()]
    elif case == "rng_objects_in_extras":
        r = random.Random(9)
        rs = np.random.RandomState(10)
        c["extras"] = {"pyrand": Wrap(r.getstate, r.setstate),
                       "randomstate": Wrap(rs.get_state, rs.set_state)}

        def noise(x, step):
            return x + r.gauss(0, 1) * 1e-2 + float(rs.standard_normal()) * 1e-2
        c["noise"] = noise
        c["draws"] = [lambda: r.random().hex(), lambda: float(rs.standard_normal()).hex()]
    elif case == "numpy_generator_spawn":
        g = np.random.default_rng(5)
        c["generators"] = {"g": g}

        def noise(x, step):
            child = g.spawn(1)[0]  # an independent stream per update (NumPy's idiom)
            return x + torch.from_numpy(child.standard_normal(x.shape).astype(np.float32)) * .1
        c["noise"] = noise
        c["draws"] = [lambda: g.spawn(1)[0].random(2).tobytes().hex()]
    elif case == "extra_grows_in_place":
        h = Growing()
        c["extras"] = {"history": h}
        c["noise"] = lambda x, step: x + h.push(float(step))
    elif case == "model_load_hook_draws_rng":
        def smoke_test(module, incompatible) -> None:
            with torch.no_grad():  # checks the loaded weights on a random input
                assert torch.isfinite(module(torch.randn(2, 8))).all()
        model.register_load_state_dict_post_hook(smoke_test)
    else:
        raise SystemExit(f"unknown case {case}")
    sampler = unbroken.ResumableSampler(len(ds), batch_size=8, seed=0)
    c["loader"] = unbroken.ResumableLoader(
        unbroken.seeded(ds, seed=0), sampler, num_workers=c["workers"],
        persistent_workers=c["persistent"], accumulation=c["accumulation"])
    return c


def run(case: str, folder: str, *, stop_at: int | None, scramble: bool) -> dict:
    c = build(case)
    if scramble:  # whatever restore() does not set keeps these (wrong) states
        seed_all(12345)
    model, opt, loader = c["model"], c["opt"], c["loader"]
    ckpt = unbroken.Checkpointer(folder, model=model, optimizer=opt, data=loader,
                                 generators=c["generators"], extras=c["extras"])
    losses: dict[int, list[str]] = {}
    try:
        step = ckpt.restore()
        micro: list[str] = []
        done = False
        while not done:
            for x, y in loader:
                x = c["noise"](x, step + 1)
                loss = torch.nn.functional.mse_loss(model(x), y)
                (loss / loader.window_size).backward()
                micro.append(loss.item().hex())
                if not loader.at_boundary:
                    continue
                opt.step()
                opt.zero_grad()
                step += 1
                losses[step], micro = micro, []
                ckpt.step_done(step)
                if step == stop_at:
                    ckpt.save()
                if step in (stop_at, N):
                    done = True
                    break
        ckpt.close()
    finally:
        loader.stop_workers()
    state = opt.state_dict()["state"]
    return {
        "losses": losses,
        "params": [p.detach().numpy().tobytes().hex() for p in model.parameters()],
        "moments": [v.numpy().tobytes().hex() for i in sorted(state) for k, v in
                    sorted(state[i].items())],
        "draws": [random.random().hex(), np.random.random().hex(),
                  torch.rand(2).numpy().tobytes().hex()] + [d() for d in c["draws"]],
    }


def main() -> None:
    mode, root, out, cases = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    results = {}
    for case in cases:
        folder = os.path.join(root, case)
        try:
            if mode == "reference":
                results[case] = {
                    "full": run(case, folder + "-full", stop_at=None, scramble=False),
                    "saved": run(case, folder, stop_at=K, scramble=False)}
            else:
                results[case] = {"resumed": run(case, folder, stop_at=None, scramble=True)}
        except Exception as e:  # noqa: BLE001 -- recorded for the test to judge
            results[case] = {"error": {
                "type": type(e).__name__, "mro": [t.__name__ for t in type(e).__mro__],
                "message": str(e)[:500], "trace": traceback.format_exc()[-2000:]}}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
