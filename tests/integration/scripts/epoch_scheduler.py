"""A per-epoch scheduler stepped after the inner loop (6 updates an epoch, 3 epochs), saving
every ``--every`` updates; ``--save-after``: ``save()`` after that scheduler step, as the README
advises. Under `unbroken check` (tests/integration/test_check_epoch_edge.py)."""

import argparse

import torch
import torch.nn.functional as F

import unbroken

ap = argparse.ArgumentParser()
ap.add_argument("--every", type=int, default=5)
ap.add_argument("--save-after", action="store_true")
args = ap.parse_args()
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
loader = unbroken.ResumableLoader(torch.utils.data.TensorDataset(x, y),
                                  unbroken.ResumableSampler(48, batch_size=8, seed=0))
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
ckpt = unbroken.Checkpointer("runs/epoch-scheduler",  # ($UNBROKEN_ROOT under check)
                             model=model, optimizer=opt, scheduler=sched, data=loader,
                             every=args.every)
step = ckpt.restore()
while loader.epoch < 3:
    for xb, yb in loader:
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        ckpt.step_done(step, loss=loss)
    sched.step()  # the end-of-epoch scheduler step, after the inner loop
    if args.save_after:
        ckpt.save()
ckpt.close()
