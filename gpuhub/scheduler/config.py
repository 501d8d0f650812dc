"""gpuhub-scheduler's settings: the keys of /etc/gpuhub/scheduler.toml (``gpuhub-scheduler --help-all``)."""

from __future__ import annotations

from traitlets import Dict, Float, Int, TraitError, Unicode, validate
from traitlets.config import Configurable


class SchedulerConfig(Configurable):
    """The scheduler's settings; in the TOML file as top-level keys."""

    listen_address = Unicode("127.0.0.1", config=True, help="Address the scheduler's HTTP API listens on.")
    port = Int(8600, min=1, max=65535, config=True, help="Port of the scheduler's HTTP API.")
    token_file = Unicode("/etc/gpuhub/secrets/scheduler.token", config=True,
                         help="File with the token agents and admins present to the scheduler (mode 0600).")
    agent_token_file = Unicode("/etc/gpuhub/secrets/agent.token", config=True,
                               help="File with the token the scheduler presents to the agents (mode 0600).")
    hub_api_url = Unicode("http://127.0.0.1:8081/hub/api", config=True,
                          help="JupyterHub's API, which tells whose a user token is.")
    state_dir = Unicode("/var/lib/gpuhub/scheduler", config=True, help="Directory of the scheduler's books.")
    max_subscription_ratio = Float(7.0, config=True,
                                   help="Admission limit: a node takes a replica only while its subscription ratio "
                                        "after placing stays at or under this (gpuhub/scheduler/placement.py).")
    node_timeout_s = Float(30.0, config=True, help="A node with no heartbeat this long is counted lost.")
    replica_dead_grace_s = Float(10.0, min=0.0, config=True,
                                 help="A replica whose unit has been dead this long on a live node is replaced.")
    migration_interval_s = Float(10.0, min=0.0, config=True,
                                 help="A kernel moves a replica at most once in this many seconds (a cell waiting "
                                      "for a GPU asks again after that if the last move did not help).")
    quota_default = Dict(config=True,
                         help="Limits for every user without an entry in quota_users, e.g. {gpus = 2, "
                              "gpu_hours_per_week = 30}; empty: none (docs/quotas.md).")
    quota_users = Dict(config=True, help="Per-user limits: user -> {gpus, gpu_hours_per_week}; replaces the default.")
    quota_groups = Dict(config=True,
                        help="Shared limits: group -> {members = [...], gpus, gpu_hours_per_week}; each applies "
                             "to the sum of its members' use.")
    static_user_tokens = Dict(Unicode(), config=True,
                              help="Development only: fixed user tokens (token -> user name) instead of asking "
                                   "JupyterHub.")

    @validate("max_subscription_ratio")
    def _check_ratio(self, proposal) -> float:
        if proposal.value <= 0:
            raise TraitError(f"max_subscription_ratio must be positive, not {proposal.value}")
        return proposal.value

    @validate("node_timeout_s")
    def _check_node_timeout(self, proposal) -> float:
        if proposal.value <= 0:
            raise TraitError(f"node_timeout_s must be positive, not {proposal.value}")
        return proposal.value
