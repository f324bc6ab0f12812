"""Train a model through `xsched.wrap` at 70% of its eager peak memory, beside the same model in plain PyTorch.

    python examples/train_wrapped.py [TIME_LIMIT_S]

The wrapped module is a drop-in nn.Module: the loop (loss.backward(), optimizer.step()) is unchanged. With the
same seed, the losses of the two runs agree step for step, although xsched recomputes activations to stay
within the budget.
"""

import copy
import sys

import torch
from my_model import factory  # noqa: I001 - examples/ is the script's own folder

import xsched
from xsched.budgets import format_bytes


def main(steps: int = 5, time_limit: float = 20.0) -> None:
    model, (x,) = factory(batch=1024)
    reference = copy.deepcopy(model)
    target = torch.randint(0, 10, (x.shape[0],), generator=torch.Generator().manual_seed(1))
    wrapped = xsched.wrap(model, (x,), budgets={"cpu": "70%"}, time_limit=time_limit)
    plan = wrapped.plan
    peak = max(plan.predicted.peak_bytes.values())
    print(f"plan {plan.solver.method}: peak {format_bytes(peak)} within {format_bytes(plan.budgets['cpu'])}")
    opt_a = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(steps):
        torch.manual_seed(step)
        loss_a = loss_fn(wrapped(x), target)
        opt_a.zero_grad()
        loss_a.backward()
        opt_a.step()
        torch.manual_seed(step)
        loss_b = loss_fn(reference(x), target)
        opt_b.zero_grad()
        loss_b.backward()
        opt_b.step()
        print(f"step {step}: xsched loss {loss_a.item():.6f}   eager loss {loss_b.item():.6f}")


if __name__ == "__main__":
    main(time_limit=float(sys.argv[1]) if len(sys.argv) > 1 else 20.0)
