"""A three-step one-process training run, as code for :func:`common.run_python`: the
engine's events with a monitor enabled (it prints each step's loss and lr after it)."""

TRAIN = """
import json, torch, deepshard
torch.manual_seed(0)
engine, *_ = deepshard.initialize(model=torch.nn.Linear(4, 1), config=json.loads({config!r}))
steps = []
for i in range(3):
    x, y = torch.randn(2, 4), torch.randn(2, 1)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    steps.append([engine.global_samples, loss.item(), engine.get_lr()[0]])
print("STEPS " + json.dumps(steps))
"""


def train_code(config: dict) -> str:
    """The snippet, training with ``config``."""
    import json

    return TRAIN.format(config=json.dumps(config))


def printed_steps(stdout: str) -> list[tuple[int, float, float]]:
    """(global samples, loss, lr after the step) of each step the snippet printed."""
    import json

    line = next(line for line in stdout.splitlines() if line.startswith("STEPS "))
    return [tuple(step) for step in json.loads(line.removeprefix("STEPS "))]


BASE = {"train_batch_size": 2, "gradient_clipping": 0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01,
                                                     "warmup_max_lr": 0.1,
                                                     "warmup_num_steps": 3}}}
