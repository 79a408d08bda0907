"""The node among the job's nodes: how the agent reaches the job's store, its membership
and lease, the job's generation as this node knows it, and node loss.

- _cluster.py: :class:`~stalwart.agent.cluster._cluster.Cluster`, the node's membership
  (joining, the launch record, lost nodes and who adopts them) over the job's
  :class:`~stalwart.coordinator.Coordinator`, which it opens (``Cluster.coord``);
- _link.py: how the agent reaches the store (it hosts it, connects to node 0's with calls
  bounded by the lease, or is an etcd client); etcd.py: ``--rdzv etcd://...``;
  _address.py: the rendezvous endpoint and the address a node advertises;
- _members.py: the live nodes from a watch, and the ring (each node's successor);
- _fencing.py: this node's lease as the agent knows it, and what a lost one means;
  _grace.py: the partition grace (a silent expiry is *missing* for a while);
- _peerwatch.py: node loss in milliseconds when a peer agent's process dies;
- _generation.py: :class:`~stalwart.agent.cluster._generation.JobGeneration`, the
  generation, restart count and ``MASTER_PORT`` of this node, over the coordinator;
  _genfeed.py: the generation as a watch delivers it;
- _replica.py: this node's newest snapshots kept in its ring successor's memory.
"""
