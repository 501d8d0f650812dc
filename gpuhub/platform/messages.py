"""What gpuhub adds to the Jupyter messaging protocol between a kernel's router (gpuhub/server)
and its replicas (gpuhub/kernel). Clients never see these: the router signs and sends the notes,
drops the status messages a replica publishes while it takes one, and keeps group changes to itself.

``gpuhub_dispatch_request``, a *dispatch note*, content ``{"cell": msg_id, ...}`` about one
execute_request (the cell), sent only when not every replica gets every cell:

- ``"missed": true``, on shell just before the cell, to a replica that did not get the previous
  execute_request (the router counted it dead, or it is new): its log may not show yet who ran
  that cell, so it must catch up before it acts on the executor lease;
- ``"to": [replica ids]``, on control just after the cell, to the replicas that got it, when some
  did not: a lease holder that did not get the cell cannot run it, so the others elect another;
- ``"late": true``, with ``"missed"``, to a replica handed the running cell after the others
  (it joined the group, or its connection broke as the cell was sent: the copy may have died with
  an old process): the others were told who got the cell without it, so a lease holder handed it
  late must not run it under the lease, only through the election.

``gpuhub_group_change``, published by a replica on iopub (parent: the waiting cell), content
``{"target": server}``: the scheduler is moving one of the kernel's replicas to ``server`` for a
cell none of its servers can grant (docs/architecture.md, "Migration"). The router asks the
scheduler for the new group at once instead of at its next poll, so that it hands the waiting cell
to the new replica as soon as that one is up.
"""

DISPATCH_NOTE = "gpuhub_dispatch_request"
GROUP_CHANGE = "gpuhub_group_change"
