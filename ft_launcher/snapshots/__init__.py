"""In-memory snapshots of the ranks' training state (``--ft-snapshot-every``).

- ``area``: where the snapshots live (a private per-job directory in shared memory, one
  subdirectory per global rank), made at the first cycle and removed when the job ends.
- ``pick``: pure: the newest iteration every rank of the new world holds a checked copy of.
- ``reports``: the ranks' snapshot reports (untrusted JSON), decoded field by field.
- ``service``: the job's snapshots: at each cycle start it checks the copies, picks the
  iteration, discards the rest and gives each rank its environment; it turns the ranks'
  reports into events.
- ``world``: several nodes: each launcher's holdings published through the round's
  rendezvous store, the one choice every launcher computes from them (pure), and the
  second exchange that lets the world restore only when every node can.
- ``replication``: ``--ft-snapshot-replicas``: this node's replica server and the pushes of
  its ranks' newest commits to its buddies (``buddy``), over ``replica``'s transfers.
"""
