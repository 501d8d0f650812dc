"""The issue's headline case with PyTorch itself (test_faithful.py has it in numpy for CI without
torch): ``model`` and ``opt = torch.optim.SGD(model.parameters())`` made in one cell, then three
cells of 20 training steps each printing the loss. A replicated kernel prints exactly what a plain
ipykernel prints, on a CPU kernel and a GPU kernel (fake GPUs: torch still runs on the CPU, in
the cell's forked child), and after the executor replica is SIGKILLed. Skipped without torch."""

from __future__ import annotations

import pytest

from gpuhub.dev.cluster import DevCluster
from tests.integration.test_replicated import ReplicatedKernel, executor_id, kill_replica, ok, plain_outputs

pytest.importorskip("torch")

SETUP = """import torch
torch.manual_seed(0)
X = torch.randn(256, 8)
y = X @ torch.randn(8, 1) + 0.1 * torch.randn(256, 1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)  # momentum: optimizer state too
loss_fn = torch.nn.MSELoss()
def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        opt.step()
    return loss.item()"""
STEP = "print(repr(train(20)))"  # every digit: exactly the same, not just close
TRAINING = [SETUP, STEP, STEP, STEP]
# After the executor is lost: the optimizer still updates the model's own parameters, and trains on
AFTER = "print(opt.param_groups[0]['params'][0] is next(model.parameters()), repr(train(20)))"


@pytest.fixture(scope="module")
def plain():
    """What a plain ipykernel prints for the training cells and then AFTER: the anchor."""
    return plain_outputs([*TRAINING, AFTER], timeout=120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = DevCluster(tmp_path_factory.mktemp("torch"), nodes=3, gpus_per_node=1).start()
    yield c
    c.stop()


@pytest.fixture(params=[0, 1], ids=["cpu", "gpu"])
def kernel(cluster, request):
    k = ReplicatedKernel(cluster, gpus=request.param)
    yield k
    k.close()


def test_torch_training_across_cells_prints_plain_ipykernels_losses(kernel, plain):
    losses = [float(out) for out in plain[1:4]]
    assert losses[0] > losses[1] > losses[2]  # the anchor trains
    print("plain ipykernel's losses:", losses)
    outs = [ok(kernel, code, timeout=120)["stdout"] for code in TRAINING]
    assert outs == plain[:4]
    kill_replica(kernel, executor_id(kernel))  # asking runs a cell that leaves the model be
    after = ok(kernel, AFTER, timeout=120)["stdout"]
    assert after == plain[4]
    assert after.split()[0] == "True"


SEEDED = "torch.manual_seed(1)"
DRAWN = "print(torch.rand(3).tolist(), torch.nn.functional.dropout(torch.ones(4), 0.5).tolist())"


def test_torchs_seeded_generator_continues_its_sequence_after_a_failover(kernel):
    """The global generator torch.manual_seed seeds is process state: on another replica (a
    failover; for a GPU kernel, any fresh cell process) the draws came from that replica's own
    (gpuhub/kernel/random_state.py)."""
    want = plain_outputs([SETUP, SEEDED, DRAWN, DRAWN])
    for code in (SETUP, SEEDED):
        ok(kernel, code, timeout=120)
    assert ok(kernel, DRAWN)["stdout"] == want[2]
    kill_replica(kernel, executor_id(kernel))
    assert ok(kernel, DRAWN, timeout=120)["stdout"] == want[3]


SWITCHED = ("torch.set_default_dtype(torch.float64)\ntorch.set_printoptions(precision=2)\n"
            "torch.use_deterministic_algorithms(True)\ntorch.backends.cudnn.benchmark = True\n"
            "torch.set_float32_matmul_precision('high')\ntorch.set_grad_enabled(False)")
SWITCHES = ("print(torch.tensor([1 / 3]), torch.are_deterministic_algorithms_enabled(),\n"
            "      torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision(), torch.is_grad_enabled())")


def test_torchs_global_switches_follow_the_cells_after_a_failover(kernel):
    """Default dtype, print options, deterministic algorithms, cuDNN and matmul flags, gradient mode are process
    state, as a training notebook's first cell sets them (gpuhub/kernel/shell_settings.py)."""
    want = plain_outputs([SETUP, SWITCHED, SWITCHES])
    for code in (SETUP, SWITCHED):
        ok(kernel, code, timeout=120)
    kill_replica(kernel, executor_id(kernel))
    assert ok(kernel, SWITCHES, timeout=120)["stdout"] == want[2]
