"""`python -m bench [NAME …]`: run the benchmarks and print their markdown sections.

Each benchmark module has a ``main()`` that returns (or prints) a markdown section with its command.
Results are pasted into docs/benchmarks.md by hand, with the date and machine.
"""

from __future__ import annotations

import importlib
import sys

BENCHES = {"kernel": "bench.kernel_bench", "sim": "bench.sim_bench", "replicated": "bench.replicated_bench",
           "lease": "bench.lease_bench", "dirty": "bench.dirty_bench", "start": "bench.start_bench",
           "lab-start": "bench.lab_start_bench", "digest": "bench.digest_bench",
           "gpu": "bench.gpu_bench", "migration": "bench.migration_bench",
           "migration-policy": "bench.migration_policy_bench",
           "cluster-migration": "bench.cluster_migration_bench", "elastic": "bench.elastic_bench",
           "elastic-bound": "bench.elastic_bound", "load": "bench.load_bench",
           "device-gate": "bench.device_gate_bench", "cluster-kernel": "bench.cluster_kernel_bench",
           "websocket": "bench.websocket_bench", "process-entry": "bench.process_entry_bench",
           "image-size": "bench.image_size_bench", "process-cpu": "bench.process_cpu_bench"}
# Run only when named: they need a deployed podman cluster (scripts/cluster.sh).
NEEDS_CLUSTER = ("cluster-migration", "load", "device-gate", "cluster-kernel")


def main(argv: list[str]) -> int:
    names = argv or [n for n in BENCHES if n not in NEEDS_CLUSTER]
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}", file=sys.stderr)
        return 2
    for name in names:
        print(f"# running {name} …", file=sys.stderr, flush=True)
        out = importlib.import_module(BENCHES[name]).main()
        if isinstance(out, str):
            print(out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
