"""Which notebook host a new server goes to: the one whose agent runs the fewest units, asked
of the real agents (gpuhub/hub/spawner.py, ``least_loaded_agent``)."""

from __future__ import annotations

import asyncio

import pytest

from gpuhub.dev.cluster import DevCluster
from gpuhub.hub.spawner import least_loaded_agent
from tests.integration.test_replicated import take_the_gpu


@pytest.fixture
def hosts(tmp_path):
    c = DevCluster(tmp_path, nodes=3, gpus_per_node=1).start()
    yield c
    c.stop()


def test_a_new_server_goes_to_the_least_busy_host_that_answers(hosts):
    gpu1, gpu2, gpu3 = hosts.agents
    urls = [a.url for a in hosts.agents]
    tokens = {a.url: a.token for a in hosts.agents}  # each agent its own
    choose = lambda: asyncio.run(least_loaded_agent(urls, tokens.__getitem__))  # noqa: E731
    assert choose() == gpu1.url  # all idle: the first listed
    take_the_gpu(gpu1, "busy1")
    assert choose() == gpu2.url
    take_the_gpu(gpu2, "busy2")
    assert choose() == gpu3.url
    gpu3.stop(kill=True)  # a host that does not answer is passed over
    assert choose() in (gpu1.url, gpu2.url)
    gpu1.stop(kill=True)
    gpu2.stop(kill=True)
    with pytest.raises(RuntimeError, match="no notebook host answers"):
        choose()
