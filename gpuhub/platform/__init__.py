"""What every gpuhub process builds on, one way each: the HTTP API server and client plumbing,
configuration files and secrets, atomic state files, the daemon bootstrap."""
