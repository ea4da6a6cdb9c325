"""The KV offload tier: full prefix blocks kept below the block pool, in host memory or on disk, and restored
instead of recomputed (docs/KV_OFFLOAD.md). Nothing here is imported unless `--kv-offloading-size` is given."""
