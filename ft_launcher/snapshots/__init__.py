"""In-memory snapshots of the ranks' training state, on this node (``--ft-snapshot-every``).

- ``area``: where the snapshots live (a private per-job directory in shared memory, one
  subdirectory per global rank), made at the first cycle and removed when the job ends.
- ``pick``: pure: the newest iteration every rank of the new world holds a checked copy of.
- ``reports``: the ranks' snapshot reports (untrusted JSON), decoded field by field.
- ``service``: the job's snapshots: at each cycle start it checks the copies, picks the
  iteration, discards the rest and gives each rank its environment; it turns the ranks'
  reports into events.

Several nodes: each launcher knows only its own ranks' copies, so with more than one node
``begin_cycle`` restores nothing yet (``snapshot_picked`` says so). The seam for it:
``pick.choose`` and ``pick.pick_iteration`` work on any mapping of ranks, so the missing
piece is an exchange of each node's checked per-rank iterations through the rendezvous
store, with ``pick_iteration`` applied to the union, in place of the single-node branch of
``JobSnapshots.begin_cycle``. Replication to other nodes (``--ft-snapshot-replicas``) is to
be a module of its own here that adds copies a rank may restore from (``source``
"replica").
"""
