"""KV tiers below the pools: host memory and a disk file, the bytes of `engine.core.kv_tiers`' slots."""
