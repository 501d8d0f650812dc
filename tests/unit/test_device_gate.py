"""The agent's device gate: which device nodes each unit is given, and that grants and releases
racing for one unit end in the list the leases say. systemd itself (that a unit then cannot open
what its list leaves out) is tested on the cluster: tests/cluster/test_e2e.py."""

import asyncio

import pytest

from gpuhub.agent.config import AgentConfig
from gpuhub.agent.device_gate import DeviceGate, DeviceGateError
from gpuhub.agent.records import UnitRecord
from gpuhub.agent.service import Agent
from gpuhub.agent.units import UnitError
from gpuhub.gpus.fake import FakeInventory

GPUS = [{"name": "g", "memory_mib": 1024, "device": f"/dev/fake-gpu{i}"} for i in range(4)]


class RecordingSystemd:
    """Stands for systemctl set-property: records each list; can be held or made to fail."""

    backend = "systemd"

    def __init__(self) -> None:
        self.lists: dict[str, tuple[str, ...]] = {}
        self.calls = 0
        self.hold = asyncio.Event()
        self.hold.set()
        self.fail = False

    async def set_devices(self, name: str, devices: tuple[str, ...]) -> None:
        self.calls += 1
        await self.hold.wait()
        if self.fail:
            raise UnitError("systemctl set-property failed: Unit gpuhub-kernel-x.service not loaded.")
        self.lists[name] = devices


def gate(runner, extra=()):
    return DeviceGate(runner, FakeInventory.from_config(GPUS, "n1"), extra)


def test_a_kernel_gets_its_granted_gpus_nodes_and_a_server_none():
    g = gate(RecordingSystemd(), extra=["/dev/fuse"])
    assert g.devices("kernel") == ("/dev/fuse",)
    assert g.devices("kernel", {2, 0}) == ("/dev/fuse", "/dev/fake-gpu0", "/dev/fake-gpu2")
    assert g.devices("server", {1}) == ("/dev/fuse",)
    assert g.at_start("kernel") == ("/dev/fuse rw",)


def test_nothing_is_enforced_with_the_process_backend_or_the_open_policy():
    runner = RecordingSystemd()
    assert gate(runner).at_start("kernel") == ()
    assert DeviceGate(runner, FakeInventory.from_config(GPUS, "n1"), enabled=False).at_start("kernel") is None
    runner.backend = "process"
    assert gate(runner).at_start("server") is None


@pytest.fixture
def kernel_k():
    """A gate and its recording systemd, with kernel unit ``k`` started."""
    runner = RecordingSystemd()
    g = gate(runner)
    g.started("k", "kernel")
    return runner, g


async def test_a_release_racing_a_grant_ends_with_the_releases_list(kernel_k):
    runner, g = kernel_k
    runner.hold.clear()
    g.follow({"k": frozenset({1})})  # grant: its change is under way, held
    await asyncio.sleep(0)
    g.follow({})  # the release comes meanwhile
    runner.hold.set()
    await g.ready("k")
    assert runner.lists["k"] == ()
    assert runner.calls == 2
    g.follow({"k": frozenset({3})})
    await g.ready("k")
    assert runner.lists["k"] == ("/dev/fake-gpu3 rw",)


async def test_a_failed_change_is_an_error_for_the_grant_and_is_tried_again(kernel_k):
    runner, g = kernel_k
    runner.fail = True
    g.follow({"k": frozenset({0})})
    with pytest.raises(DeviceGateError, match="could not give k its GPUs"):
        await g.ready("k")
    runner.fail = False
    g.follow({"k": frozenset({0})})
    await g.ready("k")
    assert runner.lists["k"] == ("/dev/fake-gpu0 rw",)


async def test_an_adopted_unit_gets_its_list_again_and_a_stopped_one_none():
    runner = RecordingSystemd()
    g = gate(runner)
    g.adopted("old", "server")  # started by an agent without a device policy
    g.adopted("gone", "kernel")
    g.forget("gone")
    g.follow({})
    await g.ready("old")
    assert runner.lists == {"old": ()}


async def test_a_grant_whose_devices_cannot_be_opened_is_given_back(tmp_path):
    agent = Agent(AgentConfig(node_name="n1", state_dir=str(tmp_path / "state"), runtime_dir=str(tmp_path / "run"),
                              unit_backend="process", gpus={"backend": "fake", "fake": GPUS}))
    runner = RecordingSystemd()
    runner.fail = True
    agent.device_gate = gate(runner)
    unit = UnitRecord(name="gpuhub-kernel-k-r1", kind="kernel", user="u", gpus=1)
    agent.units[unit.name] = unit
    agent.device_gate.started(unit.name, "kernel")
    with pytest.raises(DeviceGateError):
        await agent.grant_opened(unit, 1, None)
    assert agent.book.leases == {} and agent.counters["released"] == 1
    runner.fail = False
    lease = await agent.grant_opened(unit, 1, None)
    assert runner.lists[unit.name] == (f"/dev/fake-gpu{lease.gpus[0]} rw",)
