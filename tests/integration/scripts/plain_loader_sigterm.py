"""A plain DataLoader (ResumableSampler as its batch_sampler, 2 workers) with
signals=[SIGTERM]: prints each step, stops cleanly when told. argv: run folder, "wait" (loop
until SIGTERM) or "exit" (leave with an iterator alive, its workers running)."""
import signal
import sys
import time

import torch

import unbroken

torch.set_num_threads(1)
N = 400
ds = unbroken.seeded(torch.utils.data.TensorDataset(torch.randn(N, 3)), seed=0)
sampler = unbroken.ResumableSampler(N, batch_size=2, seed=1)
dl = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=2,
                                 generator=torch.Generator())
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = unbroken.Checkpointer(sys.argv[1], model=model, optimizer=opt, data=sampler,
                             signals=[signal.SIGTERM])
step = ckpt.restore()
if sys.argv[2] == "exit":
    alive = iter(dl)
    next(alive)
    print("leaving", flush=True)
    sys.exit(0)
for (x,) in dl:
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    step += 1
    sampler.advance()
    ckpt.step_done(step)
    print("step", step, flush=True)
    time.sleep(0.02)
    if ckpt.should_stop:
        print("stopped at", step, flush=True)
        break
ckpt.close()
