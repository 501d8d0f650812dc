"""Who a kernel or server unit may run as, and where it may start (gpuhub/agent/units.py)."""

from __future__ import annotations

import pwd

import pytest

from gpuhub.agent.units import UnitError, lookup_user, under


def test_root_system_accounts_and_nobody_are_refused():
    with pytest.raises(UnitError, match="below min_uid"):
        lookup_user("root", 0)
    with pytest.raises(UnitError, match="below min_uid"):
        lookup_user("daemon", 1000)
    nobody = pwd.getpwuid(65534).pw_name  # "nobody" on Debian
    with pytest.raises(UnitError, match="nobody's"):
        lookup_user(nobody, 1000)
    with pytest.raises(UnitError, match="does not exist"):
        lookup_user("no-such-user-here", 1000)


def test_under_compares_whole_path_components():
    assert under("/home/alice/work", "/home/alice") and under("/home/alice", "/home/alice")
    assert not under("/home/alicebob", "/home/alice") and not under("/home/bob", "/home/alice")
    assert under("/home/alice/../bob", "/home") and not under("/home/alice/../bob", "/home/alice")
