"""Free drafts read from the context (prompt lookup, suffix trees) and what is known about their proposals.

A light package: its modules import only the standard library, numpy, torch, safetensors and (lazily)
arctic_inference, never transformers nor a specheads module outside it (but the dependency-free errors), so vLLM's
environment can import it. `proposers` makes the proposals (`ngram_propose`, `SuffixProposer`), `features` the
token-only inputs a head reads of them, `token_head` runs an exported token head, `planning` reads the verify length
from per-position acceptance estimates. The round engine drafts with them through `specheads.decoding.free_draft`.
"""
