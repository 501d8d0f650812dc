"""The development harness: real daemons and replicas on 127.0.0.1, for tests, benchmarks and
``gpuhub local-kernel``. Never imported by a daemon, a replica or the user's server."""
