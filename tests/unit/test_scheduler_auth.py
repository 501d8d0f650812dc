"""Which hub tokens may run kernels: the scope rule of gpuhub/scheduler/auth.py (the hub's side is
tested on the podman cluster, tests/cluster/test_e2e.py)."""

from __future__ import annotations

from gpuhub.scheduler.auth import KERNEL_SCOPE, HubUserResolver, holds_scope


def test_the_kernel_scope_must_be_the_users_own_or_unfiltered():
    assert holds_scope([f"{KERNEL_SCOPE}!user=alice", "read:users:name!user=alice"], KERNEL_SCOPE, "alice")
    assert holds_scope([KERNEL_SCOPE], KERNEL_SCOPE, "alice")  # e.g. an admin's token
    assert not holds_scope([f"{KERNEL_SCOPE}!user=bob"], KERNEL_SCOPE, "alice")
    assert not holds_scope(["read:users:name!user=alice", "access:servers!server=bob/"], KERNEL_SCOPE, "alice")
    assert not holds_scope(f"{KERNEL_SCOPE}!user=alice", KERNEL_SCOPE, "alice")  # not a list: not the hub's
    assert not holds_scope(None, KERNEL_SCOPE, "alice")


async def test_static_development_tokens_run_kernels_without_a_hub():
    users = HubUserResolver("", {"dev-token": "alice"})
    alice = await users.user_for("dev-token")
    assert alice is not None and alice.name == "alice" and alice.may_run_kernels
    assert await users.user_for("other") is None and await users.user_for(None) is None
