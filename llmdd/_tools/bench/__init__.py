"""``llmdd bench``: llmdd's transfers measured against this machine's own limits.

``runner`` drives one run: anchors (memcpy, gather, ``process_vm_readv``, raw sockets)
and llmdd workloads per available transport, each in spawned worker processes
(``worker``); ``report`` turns the results into ratios, targets, a table and plots;
``peers`` merges NIXL / Mooncake anchor results written by ``bench/run_peers.sh``.
"""
