"""Daemons that own state: the shard server and the coordinator."""
