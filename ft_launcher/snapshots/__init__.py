"""In-memory snapshots of the ranks' training state (on by default; ``--ft-snapshot-every``).

- ``area``: where the snapshots live (a private per-job directory in shared memory, one
  subdirectory per global rank), made at the first cycle and removed when the job ends.
- ``pick``: pure: the newest iteration every rank of the new world holds a checked copy of.
- ``reports``: the ranks' snapshot reports (untrusted JSON), decoded field by field.
- ``service``: the job's snapshots: at each cycle start it checks the copies, picks the
  iteration, discards the rest and gives each rank its environment; it turns the ranks'
  reports into events, or hands them to the coordinator.
- ``coordinator``: the plan every holder follows during a cycle (which copies to keep:
  ``ft_agent.snapshot_retention``; with the default frequency, which iterations to
  snapshot: ``ft_agent.snapshot_frequency``), moved on from the ranks' reports and, with
  several nodes, from every launcher's summary through the round's store.
- ``world``: several nodes: each launcher's holdings published through the round's
  rendezvous store, the one choice every launcher computes from them (pure), and the
  second exchange that lets the world restore only when every node can.
- ``replication``: ``--ft-snapshot-replicas``: this node's replica server and the pushes of
  its ranks' newest commits to its buddies (``buddy``), over ``replica``'s transfers.
"""
