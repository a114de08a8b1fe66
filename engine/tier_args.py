"""The KV tier options of the engine (`--kv-offload-memory`, `--kv-offload-disk`, `--kv-verify`)."""
from __future__ import annotations

import argparse

from pdserve.engine.units.tiers import parse_offload_disk, parse_size


def add_tier_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--kv-offload-memory", default=None, metavar="SIZE",
                   help="a KV tier in host memory below the pools, shared by every unit (e.g. 8GiB): a prefix-cached "
                        "block a pool evicts is written to it, and a prompt whose prefix continues there has those "
                        "blocks copied back instead of prefilled; least recently used first (default: off)")
    g.add_argument("--kv-offload-disk", default=None, metavar="[PATH:]SIZE",
                   help="a KV tier in a file of at most SIZE in folder PATH (default folder: kv-tiers in the cache "
                        "folder), written through with the memory tier and kept across restarts; every block is "
                        "checked on read, one that fails is recomputed (default: off)")
    g.add_argument("--kv-verify", action="store_true",
                   help="checksum each prefill-to-decode KV copy at both ends; a copy that differs is made again, "
                        "and a request whose copy fails twice ends with an error (default: off)")


def tier_options(args: argparse.Namespace) -> dict:
    """The CacheConfig fields of the tier options; ValueError naming the option for a value that cannot work."""
    memory = None if args.kv_offload_memory is None else parse_size("--kv-offload-memory", args.kv_offload_memory)
    disk = None if args.kv_offload_disk is None else parse_offload_disk(args.kv_offload_disk)
    if (memory or disk) and not args.enable_prefix_caching:
        raise ValueError("--kv-offload-memory and --kv-offload-disk keep prefix-cached blocks: they need "
                         "--enable-prefix-caching")
    if (memory or disk) and args.distributed_executor_backend == "ray":
        raise ValueError("--kv-offload-memory and --kv-offload-disk are one host's store: not with "
                         "--distributed-executor-backend ray")
    return {"kv_offload_memory": memory, "kv_offload_disk": disk, "kv_verify": args.kv_verify}
