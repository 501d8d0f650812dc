"""The real-CUDA path, on a machine with an NVIDIA GPU (skipped without one, and so in CI).

Three agents serve the machine's GPUs through NVML (the same GPUs on each: one machine plays
three servers), a 3-replica GPU kernel runs PyTorch on the device, and a plain ipykernel on the
same GPU is the anchor. What is checked here cannot be checked with fake GPUs:

- the cell's child initialises CUDA and sees exactly its granted GPU, by UUID;
- a model and optimizer on ``cuda`` trained across cells print exactly the plain kernel's losses,
  also after the executor replica is killed (the tensors come back onto the GPU on another replica);
- only the cell's child holds a CUDA context (NVML lists it), never a replica process, which
  forks the next cell's child;
- quick successive cells run in one warm process (a lingering lease): its CUDA context and the
  namespace's tensors stay on the GPU between them;
- the GPU memory a cell's child held is free again once its grant has ended (here: its linger
  time, LINGER_S, ran out).
"""

from __future__ import annotations

import pytest

from gpuhub.dev.cluster import DevCluster
from gpuhub.gpus.nvml import NvmlInventory
from tests.helpers import wait_for
from tests.integration.test_replicated import ReplicatedKernel, executor_id, kill_replica, ok, plain_outputs
from tests.unit.test_gpus import nvml_gpu_count

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(nvml_gpu_count() == 0, reason="no NVIDIA GPU found by NVML")]

SETUP = """import torch
torch.manual_seed(0)
X = torch.randn(512, 32).cuda()
y = (X @ torch.randn(32, 1).cuda() + 0.1 * torch.randn(512, 1).cuda())
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # Adam: per-parameter state on the GPU too
loss_fn = torch.nn.MSELoss()
def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        opt.step()
    return loss.item()"""
STEP = "print(repr(train(25)))"
TRAINING = [SETUP, STEP, STEP, STEP]
AFTER = ("p = next(model.parameters())\n"
         "print(opt.param_groups[0]['params'][0] is p, p.device.type, opt.state[p]['exp_avg'].device.type, "
         "repr(train(25)))")


@pytest.fixture(scope="module")
def gpus():
    return NvmlInventory().gpus()


# Short, so that the memory check below need not wait for the default 30 s; long enough for a cell
# sent right after the last one's reply.
LINGER_S = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = DevCluster(tmp_path_factory.mktemp("realgpu"), nodes=3, gpus_per_node=0,
                   agent_settings={"gpus": {"backend": "nvml"}, "gpu_linger_s": LINGER_S}).start()
    yield c
    c.stop()


@pytest.fixture
def kernel(cluster):
    k = ReplicatedKernel(cluster, gpus=1)
    yield k
    k.close()


def used_mib(index: int) -> float:
    return NvmlInventory().gpus()[index].memory_used_bytes / 2**20


def compute_pids(index: int) -> set[int]:
    """Processes holding a CUDA context on GPU ``index`` (NVML)."""
    return {p.pid for p in NvmlInventory().gpus()[index].processes}


def test_agents_serve_the_real_gpus(cluster, gpus):
    for agent in cluster.agents:
        _, node = agent.call("GET", "/api/v1/node")
        assert [g["uuid"] for g in node["gpus"]] == [g.uuid for g in gpus]


def test_a_cell_sees_exactly_its_granted_gpu_and_cuda_works(kernel, gpus):
    out = ok(kernel, "import os, torch\n"
                     "print(os.environ['CUDA_VISIBLE_DEVICES'], torch.cuda.device_count(), torch.cuda.is_available())\n"
                     "print(torch.cuda.get_device_name(0))\n"
                     "print((torch.ones(1024, device='cuda') * 2).sum().item())", timeout=120)["stdout"].split("\n")
    visible, count, available = out[0].split()
    assert visible in [g.uuid for g in gpus]
    assert (count, available) == ("1", "True")
    assert out[1] == next(g.name for g in gpus if g.uuid == visible)
    assert out[2] == "2048.0"


def test_training_on_the_gpu_prints_plain_ipykernels_losses(kernel):
    plain = plain_outputs([*TRAINING, AFTER], timeout=120)
    losses = [float(o) for o in plain[1:4]]
    assert losses[0] > losses[1] > losses[2]  # the anchor trains
    outs = [ok(kernel, code, timeout=180)["stdout"] for code in TRAINING]
    assert outs == plain[:4]
    kill_replica(kernel, executor_id(kernel))
    after = ok(kernel, AFTER, timeout=180)["stdout"]
    assert after == plain[4]
    assert after.split()[:3] == ["True", "cuda", "cuda"]


def test_only_the_cells_child_holds_a_cuda_context_and_its_memory_is_freed(kernel):
    index = 0
    before = used_mib(index)
    # 4 GiB held by the cell's child, which NVML lists; `kept` (64 MiB on the GPU) stays in the namespace
    out = ok(kernel, "import os, torch, pynvml\nblock = torch.empty(1 << 30, device='cuda')\n"
                     "kept = torch.ones(1 << 24, device='cuda')\n"
                     "pynvml.nvmlInit()\nh = pynvml.nvmlDeviceGetHandleByUUID(os.environ['CUDA_VISIBLE_DEVICES'])\n"
                     "print(torch.cuda.memory_allocated() >> 20, os.getpid(),\n"
                     "      [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)])\ndel block, h",
             timeout=120)["stdout"].split(maxsplit=2)
    allocated, child, listed = int(out[0]), int(out[1]), out[2]
    assert allocated >= 4096 + 64
    assert str(child) in listed  # NVML sees contexts here: an empty list below means something
    wait_for(lambda: used_mib(index) < before + 256, 60,
             f"the GPU's used memory to fall back near {before:.0f} MiB (now {used_mib(index):.0f} MiB)")
    holders = compute_pids(index)
    assert child not in holders
    for r in kernel.record["replicas"]:  # a replica that created a context could not fork usable children
        assert kernel.pid(r["id"]) not in holders, f"replica {r['id']} holds a CUDA context"
    # the kept tensor is still there, and back on the GPU in the next cell
    assert ok(kernel, "print(kept.device.type, int(kept.sum().item()))", timeout=120)["stdout"].split() == [
        "cuda", str(1 << 24)]


def test_successive_cells_run_warm_in_one_process_with_their_tensors_on_the_gpu(kernel):
    first = ok(kernel, "import os, torch\nw = torch.randn(2048, 2048, device='cuda')\npid = os.getpid()\n"
                       "print(pid)", timeout=120)["stdout"].strip()
    out = ok(kernel, "v = float((w @ w).norm())\nprint(os.getpid() == pid, w.device, w.data_ptr() != 0)",
             timeout=120)["stdout"].split()
    assert out == ["True", "cuda:0", "True"], (first, out)
    holders = compute_pids(0)
    assert int(first) in holders  # its context stays between the cells
    assert not any(kernel.pid(r["id"]) in holders for r in kernel.record["replicas"])


def test_the_replica_imports_what_the_training_cell_imported_and_cuda_still_works(kernel, cluster):
    """The first optimizer step in a process imports torch._dynamo (hundreds of modules): the
    replica imports them after the cell (gpuhub/kernel/warm_imports.py), without initialising
    CUDA, so later cells' processes start with them and still get the GPU."""
    ok(kernel, SETUP, timeout=180)
    ok(kernel, STEP, timeout=180)
    count = ("import sys\nn = len(sys.modules)\nopt.zero_grad(); loss_fn(model(X), y).backward(); opt.step()\n"
             "print(len(sys.modules) - n, next(model.parameters()).device.type)")
    wait_for(lambda: ok(kernel, count, timeout=180)["stdout"].split() == ["0", "cuda"], 120,
             "a training step to import nothing new")
    holders = compute_pids(0)
    assert not any(kernel.pid(r["id"]) in holders for r in kernel.record["replicas"])
