"""Snapshots of the ranks' training state: local slots and their replicas on other nodes."""
