"""The labelled dataset: the prompts it is made from, its shards and manifest on disk, its batches, the labels a head learns from."""
