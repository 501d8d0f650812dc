"""Who counts as a notebook user on a host: an account whose uid is at least the site's ``min_uid``
(the agent's setting, ``gpuhub_agent_min_uid``), never root and never nobody's. The agent starts
units only for such accounts; ``gpuhub quota grant`` refuses hours to anyone else."""

from __future__ import annotations

import pwd

# uids that are no one's: the kernel's overflow uid (nobody) and (uid_t)-1, -2
NOBODY_UIDS = frozenset({65534, 4294967294, 4294967295})


class AccountError(ValueError):
    """No such account, or not one a unit may run as; the message says which."""


def notebook_account(name: str, min_uid: int) -> pwd.struct_passwd:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise AccountError(f"user {name!r} does not exist on this node") from None
    if pw.pw_uid == 0 or pw.pw_uid < min_uid:
        raise AccountError(f"refusing to run as {name!r} (uid {pw.pw_uid} is below min_uid {min_uid})")
    if pw.pw_uid in NOBODY_UIDS:
        raise AccountError(f"refusing to run as {name!r} (uid {pw.pw_uid} is nobody's: its files would be "
                           "every such unit's)")
    return pw
