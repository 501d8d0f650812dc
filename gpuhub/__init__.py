"""gpuhub: on-prem GPU notebooks on plain systemd.

Where things live (see docs/architecture.md):
- GPUs are granted per cell in :mod:`gpuhub.agent.leases` (pure logic) served by :mod:`gpuhub.agent.api`.
- Replicas are placed in :mod:`gpuhub.scheduler.placement` (pure logic) served by :mod:`gpuhub.scheduler.api`.
- A cell is executed in :mod:`gpuhub.kernel.kernel` (forked GPU child: :mod:`gpuhub.kernel.child`).
"""

__version__ = "0.1.0"
