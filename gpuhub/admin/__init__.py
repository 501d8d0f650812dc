"""The admin's side: the ``gpuhub`` command and what it installs (kernelspecs, at install time)."""
