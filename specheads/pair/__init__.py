"""The draft/target pair: model specs, loading (derived drafts included), placement over devices, the embedded SmolLM2, file digests."""
