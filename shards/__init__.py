"""Everything semix keeps on disk: sources, shard writer/reader, manifests, the Hub."""
