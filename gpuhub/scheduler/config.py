"""gpuhub-scheduler's settings: the keys of /etc/gpuhub/scheduler.toml (``gpuhub-scheduler --help-all``)."""

from __future__ import annotations

from traitlets import Bool, Dict, Float, Int, TraitError, Unicode, validate

from gpuhub.platform.http_server import HttpLimits, MetricsAccess
from gpuhub.platform.tls import TlsSettings


class SchedulerConfig(HttpLimits, MetricsAccess, TlsSettings):
    """The scheduler's settings; in the TOML file as top-level keys."""

    listen_address = Unicode("127.0.0.1", config=True, help="Address the scheduler's HTTP API listens on.")
    port = Int(8600, min=1, max=65535, config=True, help="Port of the scheduler's HTTP API.")
    token_file = Unicode("/etc/gpuhub/secrets/scheduler.token", config=True,
                         help="File with the token agents and admins present to the scheduler (mode 0600).")
    agent_token_file = Unicode("/etc/gpuhub/secrets/agent.token", config=True,
                               help="File with the one token the scheduler presents to every agent (mode 0600); "
                                    "not read when agent_token_dir is set.")
    agent_token_dir = Unicode("", config=True,
                              help="Directory of each agent's own token, <node>.token each (0600), read at each "
                                   "call; empty: agent_token_file for every agent.")
    node_token_dir = Unicode("", config=True,
                             help="Directory of the servers' own tokens, <node>.token each (0600): a server's "
                                  "agent may heartbeat and ask for migrations with it, for itself only; "
                                  "empty: agents use the scheduler token.")
    hub_api_url = Unicode("http://127.0.0.1:8081/hub/api", config=True,
                          help="JupyterHub's API, which tells whose a user token is.")
    hub_kernel_scope = Unicode("custom:gpuhub:kernels", config=True,
                               help="JupyterHub scope a user's token must carry to start, see and stop kernels "
                                    "(the hub gives it to the tokens of the user's own servers); '': any token "
                                    "of the user.")
    state_dir = Unicode("/var/lib/gpuhub/scheduler", config=True, help="Directory of the scheduler's books.")
    max_subscription_ratio = Float(7.0, config=True,
                                   help="Admission limit: a node takes a replica only while its subscription ratio "
                                        "after placing stays at or under this (gpuhub/scheduler/placement.py).")
    node_timeout_s = Float(30.0, config=True, help="A node with no heartbeat this long is counted lost.")
    node_forget_after_s = Float(86400.0, min=0.0, config=True,
                                help="A lost node with no replica is dropped from the books after this long "
                                     "without a heartbeat (it comes back with its next one).")
    kernel_orphan_after_s = Float(3600.0, min=0.0, config=True,
                                  help="A kernel its user's server has not asked about for this long is stopped: the "
                                       "server crashed or its host was lost (a running Jupyter server asks every few "
                                       "seconds). Counted from the scheduler's start for kernels it already had; 0: "
                                       "never.")
    kernel_max_gpus = Int(0, min=0, config=True,
                          help="Most GPUs one kernel may ask for (the roles set the largest profile's); 0: no limit.")
    user_max_kernels = Int(0, min=0, config=True,
                           help="Most kernels one user may have at once, over all their servers; 0: no limit.")
    user_max_placed_gpus = Int(0, min=0, config=True,
                               help="Most GPUs one user's kernels may ask for together (placements, not grants: "
                                    "a kernel of 2 GPUs counts 2 whether its cells run or not); 0: no limit.")
    replica_dead_grace_s = Float(10.0, min=0.0, config=True,
                                 help="A replica whose unit has been dead this long on a live node is replaced.")
    migration_interval_s = Float(10.0, min=0.0, config=True,
                                 help="A kernel moves a replica at most once in this many seconds (a cell waiting "
                                      "for a GPU asks again after that if the last move did not help).")
    pool_enabled = Bool(False, config=True,
                        help="Run the elastic GPU pool (docs/install.md): keep only the servers the load needs "
                             "active, lend the others through the hooks. Without hooks it only reports.")
    pool_release_command = Unicode("", config=True,
                                   help="Command that lends a drained, empty server (its name is appended), e.g. "
                                        "'scontrol update state=resume nodename' to give it to Slurm; '': none.")
    pool_acquire_command = Unicode("", config=True,
                                   help="Command that takes a lent server back (its name is appended); the server "
                                        "is active again once its agent heartbeats.")
    pool_min_active = Int(3, min=1, config=True, help="The pool never keeps fewer active servers.")
    pool_max_active = Int(0, min=0, config=True, help="The pool never keeps more active servers; 0: no limit.")
    pool_headroom_gpus = Int(0, min=0, config=True, help="Idle GPUs the pool keeps active beyond the demand.")
    pool_spare_servers = Int(1, min=0, config=True,
                             help="Active servers the pool keeps able to grant the largest GPU request at once.")
    pool_spare_recent_s = Float(1200.0, min=0.0, config=True,
                                help="The spare server is kept for the largest request of a cell that ran or "
                                     "waited within this many seconds.")
    pool_release_after_s = Float(180.0, min=0.0, config=True,
                                 help="A surplus of servers must last this long before the pool drains one.")
    pool_interval_s = Float(10.0, config=True, help="How often the pool decides.")
    pool_hook_timeout_s = Float(120.0, config=True, help="A hook still running after this long is killed: failed.")
    pool_acquire_timeout_s = Float(600.0, config=True,
                                   help="An acquired server whose agent does not heartbeat within this long failed "
                                        "to come back: it stays lent.")
    pool_retry_s = Float(600.0, min=0.0, config=True,
                         help="A server whose acquire failed is not acquired again for this long.")
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

    @validate("pool_interval_s", "pool_hook_timeout_s", "pool_acquire_timeout_s")
    def _check_positive(self, proposal) -> float:
        if proposal.value <= 0:
            raise TraitError(f"{proposal.trait.name} must be positive, not {proposal.value}")
        return proposal.value

    def pool_problem(self) -> str | None:
        """Why the pool settings cannot work together, or None."""
        if bool(self.pool_release_command) != bool(self.pool_acquire_command):
            return ("pool_release_command and pool_acquire_command go together: a server the pool lends must "
                    "have a way back (set both, or neither to only report)")
        if self.pool_max_active and self.pool_max_active < self.pool_min_active:
            return f"pool_max_active ({self.pool_max_active}) is below pool_min_active ({self.pool_min_active})"
        return None

    @validate("node_timeout_s")
    def _check_node_timeout(self, proposal) -> float:
        if proposal.value <= 0:
            raise TraitError(f"node_timeout_s must be positive, not {proposal.value}")
        return proposal.value
