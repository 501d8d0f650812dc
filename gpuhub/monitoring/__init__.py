"""Monitoring as code: Grafana dashboards for gpuhub (see docs/monitoring.md)."""
