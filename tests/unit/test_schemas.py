"""Request body models of the agent and scheduler APIs: what a bad body's 400 says.

(The HTTP round trip of the same 400s is in test_agent_api.py and test_kernel_replicas.py.)"""

from __future__ import annotations

import pytest

from gpuhub.agent.api import LeaseRequest, PeersRequest, UnitRequest
from gpuhub.platform.schema import BodyError, parse
from gpuhub.scheduler.api import KernelRequest

SERVER = {"kind": "server", "name": "gpuhub-server-x", "user": "u", "argv": ["/bin/true"]}
PEER = {"id": 0, "raft": "h:1", "blob": "h:2"}
KERNEL = {"kernel_id": "k1", "key": "secret"}


def message(model, body) -> str:
    with pytest.raises(BodyError) as info:
        parse(model, body)
    return str(info.value)


@pytest.mark.parametrize("body, expected", [
    ({}, "missing field 'kind'"),
    ({"kind": 1}, "field 'kind' must be of type str"),
    ({"kind": "daemon", "name": "x", "user": "u"}, "field 'kind' must be 'kernel' or 'server'"),
    ({**SERVER, "env": ["A=1"]}, "field 'env' must be of type dict"),
    ({**SERVER, "env": {"A": 1}}, "field 'env' must map strings to strings"),
    ({**SERVER, "kernel": "k"}, "field 'kernel' must be of type dict"),
    ({**SERVER, "kernel": {"replica_id": -1}}, "field 'kernel.replica_id' must be an integer >= 0"),
    ({**SERVER, "kernel": {"replica_id": False}}, "field 'kernel.replica_id' must be an integer >= 0"),
    ({"kind": "kernel"}, "missing field 'name'"),
    ({**SERVER, "user": None}, "field 'user' must be of type str"),
    ({**SERVER, "gpus": "two"}, "field 'gpus' must be of type int"),
    ({**SERVER, "gpus": 1.0}, "field 'gpus' must be of type int"),
    ({**SERVER, "gpus": True}, "field 'gpus' must be a number"),
    ({**SERVER, "cwd": ["/"]}, "field 'cwd' must be of type str"),
    ({**SERVER, "argv": "/bin/true"}, "field 'argv' must be of type list"),
    ({**SERVER, "argv": None}, "field 'argv' must be of type list"),  # may be left out, not null
])
def test_bad_unit_bodies(body, expected):
    assert message(UnitRequest, body) == expected


def test_unit_body_defaults_and_unknown_fields():
    u = parse(UnitRequest, {**SERVER, "future_field": 1})
    assert (u.gpus, u.env, u.cwd, u.kernel.key, u.kernel.replica_id) == (0, {}, "", "", 0)
    k = parse(UnitRequest, {"kind": "kernel", "name": "n", "user": "u", "kernel": {"key": "k", "replica_id": 2}})
    assert k.argv is None and k.kernel.replica_id == 2


@pytest.mark.parametrize("body, expected", [
    ({}, "missing field 'gpus'"),
    ({"gpus": "1"}, "field 'gpus' must be of type int"),
    ({"gpus": True}, "field 'gpus' must be a number"),
    ({"gpus": -1}, "field 'gpus' must not be negative"),
    ({"gpus": 1, "holder_pid": "123"}, "field 'holder_pid' must be of type int"),
    ({"gpus": 1, "holder_pid": None}, "field 'holder_pid' must be of type int"),
])
def test_bad_lease_bodies(body, expected):
    assert message(LeaseRequest, body) == expected


def test_lease_body():
    assert parse(LeaseRequest, {"gpus": 2}).holder_pid is None
    assert parse(LeaseRequest, {"gpus": 0, "holder_pid": 7}).holder_pid == 7


@pytest.mark.parametrize("body, expected", [
    ({"replicas": None}, "field 'replicas' must be of type list"),
    ({"replicas": [PEER, 3]}, "replicas[1] must be an object"),
    ({"replicas": [{"raft": "h:1", "blob": "h:2"}]}, "replicas[0]: missing field 'id'"),
    ({"replicas": [{**PEER, "id": 1.5}]}, "replicas[0]: field 'id' must be of type int"),
    ({"replicas": [{**PEER, "node": 7}]}, "replicas[0]: field 'node' must be of type str"),
    ({"replicas": [{**PEER, "blob": "h:0"}]}, "replicas[0]: field 'blob' must be \"host:port\", not 'h:0'"),
    ({"replicas": [{**PEER, "raft": "a b:1"}]}, "replicas[0]: field 'raft' must be \"host:port\", not 'a b:1'"),
    ({"replicas": [PEER, {**PEER, "id": 1}, PEER]}, "replicas[2]: replica id 0 appears twice"),
])
def test_bad_peers_bodies(body, expected):
    assert message(PeersRequest, body) == expected


def test_peer_entries_keep_their_shape():
    conn = {"ip": "h", "raft_port": 1, "blob_port": None}
    body = parse(PeersRequest, {"replicas": [PEER, {**PEER, "id": 1, "node": "n", "connection": conn}]})
    assert [r.entry() for r in body.replicas] == [
        {"id": 0, "node": "", "raft": "h:1", "blob": "h:2"},
        {"id": 1, "node": "n", "raft": "h:1", "blob": "h:2", "connection": conn},
    ]


@pytest.mark.parametrize("body, expected", [
    ({"gpus": "1", **KERNEL}, "field 'gpus' must be of type int"),
    ({"gpus": False, **KERNEL}, "field 'gpus' must be a number"),
    ({"replicas": 3.0, **KERNEL}, "field 'replicas' must be of type int"),
    ({"gpus": -1, **KERNEL}, "gpus must be >= 0 and replicas 1..7"),
    ({"replicas": 0, **KERNEL}, "gpus must be >= 0 and replicas 1..7"),
    ({"replicas": 8}, "gpus must be >= 0 and replicas 1..7"),  # checked before kernel_id, as always
    ({"gpus": 1}, "missing field 'kernel_id'"),
    ({"kernel_id": "k1"}, "missing field 'key'"),
    ({**KERNEL, "key": 5}, "field 'key' must be of type str"),
    ({**KERNEL, "cwd": None}, "field 'cwd' must be of type str"),
])
def test_bad_kernel_bodies(body, expected):
    assert message(KernelRequest, body) == expected


def test_kernel_body_defaults():
    k = parse(KernelRequest, KERNEL)
    assert (k.gpus, k.replicas, k.cwd) == (0, 3, "")
