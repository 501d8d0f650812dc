"""Exit statuses by which a unit's process tells its supervisor what happened: the agent names
them in the unit (systemd's ``RestartPreventExitStatus=``), the process exits with them."""

DISK_FULL_EXIT = 74  # EX_IOERR (sysexits.h): a replica's disk is full, so restarting it would only meet it again
